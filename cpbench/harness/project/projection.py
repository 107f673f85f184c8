"""A projection: one rank of a point's step on fake tensors against a fake process group, in this process.

The step is `measure/step.py`'s, as a measured run takes it (the model, the plan, FSDP2 over fsdp x cp, the loss,
AdamW); only the tensors and the process group are swapped, and the kernels are those of the point's device
(`DistributedConfig.cp_kernel_device`, the optimizer's foreach choice). Memory is tracked by the same tracker as a
measured CPU run (probes.py), so on CPU the two are held equal by tests.

What has to hold for the fake step to take the real one's decisions:
- the device mesh is built outside the fake-tensor mode (DeviceMesh reads its rank tensor with `.tolist()`);
- the batch's small integer tensors (ids, positions, padding mask: O(batch x seq)) are fake tensors that carry
  their real values as constants, and torch's constant propagation is allowed for tensors of that size, so a
  decision that reads values (is this batch packed? padded?) reads the real ones. Anything computed from the
  model's weights or activations stays a plain fake tensor;
- transformers would treat any fake tensor as tracing and build a dense S x S mask where a real run builds
  none: `hf_compat.known_values_are_not_tracing` lets it read those constants instead.
"""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from cpbench.harness.measure import step
from cpbench.harness.measure.probes import memory_probe
from cpbench.harness.project import flops
from cpbench.harness.project.timing import simulate
from cpbench.harness.project.trace import StepTrace
from cpbench.harness.suite.spec import Point

# Fake tensors up to this many elements keep their values when computed from known values (torch's default: 1).
# The batch's integer tensors and what is derived from them element-wise are O(batch x seq). torch computes an op on
# known values for real before it looks at the result's size: the one S x S result built from them, a packed row's
# mask (known positions indexed by the query and key indices), is built without them (hf_compat).
KNOWN_VALUES_MAX_NUMEL = 1 << 26


@contextlib.contextmanager
def fake_world(world_size: int, rank: int):
    """torch.distributed initialised with a fake process group: every collective returns at once."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a projection needs its own process group, but torch.distributed is initialised here")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_tensors():
    """A FakeTensorMode in which known values propagate (see the module docstring)."""
    import torch._subclasses.fake_tensor as fake

    from cpbench.cp import hf_compat

    limit = fake.CONSTANT_NUMEL_LIMIT
    fake.CONSTANT_NUMEL_LIMIT = KNOWN_VALUES_MAX_NUMEL
    try:
        with fake.FakeTensorMode() as mode, hf_compat.known_values_are_not_tracing(), hf_compat.value_free_init():
            yield mode
    finally:
        fake.CONSTANT_NUMEL_LIMIT = limit


# Batch tensors whose values no decision reads: plain fake tensors. The labels only pick each token's target in the
# loss (gathers, and a count of the ignored ones that stays a tensor); carried as constants, every one of a chunked
# loss's hundreds of chunks would compute on their real values (half a projection's time at 1M tokens).
VALUES_UNREAD = ("labels",)


def known(mode, batch: dict) -> dict:
    """Fake copies of real tensors that carry the real values (see the module docstring)."""
    return {k: mode.fake_tensor_converter.from_real_tensor(mode, v, make_constant=k not in VALUES_UNREAD)
            for k, v in batch.items()}


def _mesh(point: Point):
    if point.world_size == 1:
        return None
    import cpbench
    from cpbench.cp.mesh import build_mesh

    config = cpbench.DistributedConfig(
        cp_size=point.cp_size, fsdp_size=point.fsdp_size, dp_replicate_size=point.dp_replicate_size,
        cp_ulysses_degree=point.cp_ulysses_degree,
    )
    return build_mesh(config, "cpu")


def kernel_target_of(point: Point, hardware=None):
    """The GPU a projection's kernels are chosen for: the profile's capability and cuDNN (and the SDPA kernel it
    names, which `--sdpa-kernel` overrides), as torch chooses on that card; a CUDA point without a profile, or a
    profile that names no capability, stands for an A100 (cp/ring/target.py)."""
    from cpbench.cp.ring.target import SDPA_KERNELS, KernelTarget

    if point.device != "cuda" or hardware is None or getattr(hardware, "capability", None) is None:
        return point.device
    sdpa = getattr(hardware, "sdpa_kernel", None)  # "fa3"/"fa4" price a model's own call: the ring keeps torch's rule
    return KernelTarget(device="cuda", capability=tuple(hardware.capability),
                        cudnn_version=getattr(hardware, "cudnn_version_number", None),
                        sdpa_kernel=sdpa if sdpa in SDPA_KERNELS else None)


# A flash backend's CUDA kernels cannot run on fake tensors: its point runs as sdpa's fused kernels (per call the same
# output and fp32 log-sum-exp, so the same memory up to the kernels' workspaces) and its attention calls are priced as
# the backend's own kernel (trace.StepTrace's attention_family; gpus.toml's attention_fa3/fa4 efficiencies).
PRICED_AS = {"flash_attention_2": ("", "FlashAttention-2"), "flash_attention_3": ("_fa3", "FlashAttention-3"),
             "flash_attention_4": ("_fa4", "FlashAttention-4")}


def runs_as(point: Point) -> Point:
    """The point a projection runs: a flash backend's as sdpa (PRICED_AS), any other as it is."""
    return replace(point, attn_implementation="sdpa") if point.attn_implementation in PRICED_AS else point


@contextlib.contextmanager
def _sdpa_wrapped(wrap):
    """transformers' sdpa attention function replaced by `wrap(original)` meanwhile, then as it was: a local
    override kept, none left behind to shadow a later global registration."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa, local = ALL_ATTENTION_FUNCTIONS["sdpa"], ALL_ATTENTION_FUNCTIONS._local_mapping.get("sdpa")
    ALL_ATTENTION_FUNCTIONS["sdpa"] = wrap(sdpa)
    try:
        yield
    finally:
        if local is None:
            del ALL_ATTENTION_FUNCTIONS["sdpa"]
        else:
            ALL_ATTENTION_FUNCTIONS["sdpa"] = local


def flash_view(trace, padding=None):
    """While a flash backend's point runs as sdpa: each masked model attention call tells `trace` what its flash path
    would hand the kernel (flops.flash_as_called), which the call is counted by, not by its mask's square.
    `padding`: a padded batch's (tokens of each row, row length), its attention mask's sums: what the flash path
    computes of a call over the rows' whole length."""
    rows, width = padding or (None, None)

    def wrap(sdpa):
        def attention(module, query, key, value, attention_mask, **kwargs):
            if attention_mask is None:  # an unmasked call is counted by its own is_causal
                return sdpa(module, query, key, value, attention_mask, **kwargs)
            whole = rows is not None and query.shape[0] == len(rows) and key.shape[-2] == width
            trace.flash_call = flops.flash_as_called(module, key.shape[-2], kwargs.get("sliding_window"),
                                                     kwargs.get("position_ids"), kwargs.get("is_causal"),
                                                     rows if whole else None)
            try:
                return sdpa(module, query, key, value, attention_mask, **kwargs)
            finally:
                trace.flash_call = None
        return attention
    return _sdpa_wrapped(wrap)


def values_padded():
    """While a CUDA point runs on fake CPU tensors: a model's SDPA call whose values have a smaller head dim than its
    queries and keys (multi-head latent attention: 192 against 128) gets them zero-padded to it and its output cut
    back, as transformers' flash path (integrations/flash_attention.py) and cpbench's ring pad them. CUDA runs a
    fused kernel there; torch's CPU flash kernel takes one head dim, and SDPA's math path it would fall back to holds
    the S x S scores. The call is priced at the padded head dim (its PV product 1.5 times DeepSeek's)."""
    def wrap(sdpa):
        def attention(module, query, key, value, attention_mask, **kwargs):
            d_v = value.shape[-1]
            if d_v >= query.shape[-1] or key.shape[-1] != query.shape[-1]:
                return sdpa(module, query, key, value, attention_mask, **kwargs)
            padded = torch.nn.functional.pad(value, [0, query.shape[-1] - d_v])
            out, weights = sdpa(module, query, key, padded, attention_mask, **kwargs)
            return out[..., :d_v], weights
        return attention
    return _sdpa_wrapped(wrap)


def pricing_of(point: Point) -> str:
    """How a projection prices `point`'s step (the row's `projected_pricing`)."""
    if point.attn_implementation in PRICED_AS:
        kernel = PRICED_AS[point.attn_implementation][1]
        return (f"eager; {point.attn_implementation} run as sdpa on fake tensors, its attention calls priced as "
                f"{kernel}")
    return "eager"


def project_rank(point: Point, rank: int, hardware=None, gpus_per_node: int = 8, keep_trace: bool = False) -> dict:
    """One rank's record, like a measured rank's (worker.run_point) without parity; with a GPU profile
    (`hardware`), its projected time (timing.py). `keep_trace`: the record keeps the op trace (`trace`), for
    pricing again on other hardware (calibrate.py)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    t0 = time.perf_counter()
    family, pricing = PRICED_AS.get(point.attn_implementation, (None,))[0], pricing_of(point)
    point = runs_as(point)
    with fake_world(point.world_size, rank):
        mesh = _mesh(point)
        with fake_tensors() as mode:
            model = step.build_model(point, "cpu")
            num_params = sum(p.numel() for p in model.parameters())
            model = step.distribute(model, point, mesh=mesh, kernel_device=kernel_target_of(point, hardware))
            with unset_fake_temporarily():
                batch = step.make_batch(point, model.config.vocab_size, "cpu")
                mask = batch.get("attention_mask")
                padding = None if mask is None else (mask.sum(-1).tolist(), mask.shape[-1])
            batch = known(mode, batch)
            optimizer = step.make_optimizer(model, point)
            on_shards = steps_on_local_shards(optimizer)
            probe = memory_probe("cpu", model, optimizer, None)
            first_state(model, optimizer)  # what step 0 leaves, untracked
            trace = (StepTrace(probe.host, gpus_per_node, attention_family=family)
                     if hardware is not None or keep_trace else None)
            hooks = trace.optimizer_hooks(optimizer) + trace.checkpoint_hooks(model) if trace else []
            viewed = (flash_view(trace, padding) if trace is not None and family is not None
                      else contextlib.nullcontext())
            padded = values_padded() if point.device == "cuda" else contextlib.nullcontext()
            try:  # the optimizer's are torch's global hooks: removed whatever the step does
                with padded, viewed:  # fake steps are identical: one is traced
                    comm = step.tracked_steps(point, model, optimizer, batch, probe, steps=1,
                                              last=[trace] if trace else [])
            finally:
                for h in hooks + on_shards:
                    h.remove()
            record = {"rank": rank, "status": "ok", **probe.result(), **comm, "rss_peak_bytes": None,
                      "step_times_s": [], "num_params": num_params, "model_type": model.config.model_type,
                      "parity_mode": "off", "run_s": time.perf_counter() - t0}
            if trace is not None:
                trace.close()
                if hardware is not None:
                    # priced at the pace of the slowest of the step's GPUs (hardware.at_scale); MFU at the peak
                    record["time"] = {"gpu": hardware.name, "peak_flops": hardware.peak(point.dtype), "pricing": pricing,
                                      **simulate(trace.ops, hardware.at_scale(point.world_size), point.dtype)}
                if keep_trace:
                    record["trace"] = trace.ops
            del model, optimizer, probe, batch
    gc.collect()
    # What survives (torch, transformers, the caller's own state) lives on: the next projection's collections
    # (each tracked segment starts with one) then scan only what it makes. A third of a small projection's time.
    gc.freeze()
    return record


def steps_on_local_shards(optimizer) -> list:
    """The optimizer steps on its DTensor parameters' local shards, its state still keyed by the parameters: the
    same local ops and allocations (DTensor desugars into them), without a sharding propagation per tensor of every
    foreach op (two fifths of a projection's time). Own pre-hooks registered before (the clipping's all-reduce)
    still see the DTensors. Returns the hook handles (tests/unit/test_projection_shard_steps.py)."""
    from cpbench.harness.measure.host import local_tensor as shard

    owned = [list(group["params"]) for group in optimizer.param_groups]

    def to_shards(opt, *_):
        for group, params in zip(opt.param_groups, owned):
            group["params"] = [shard(p) for p in params]
            for p, s in zip(params, group["params"]):
                s.grad = None if p.grad is None else shard(p.grad)
                if p in opt.state:
                    opt.state[s] = opt.state.pop(p)

    def back(opt, *_):
        for group, params in zip(opt.param_groups, owned):
            for p, s in zip(params, group["params"]):
                s.grad = None
                if s in opt.state:
                    opt.state[p] = opt.state.pop(s)
            group["params"] = params

    return [optimizer.register_step_pre_hook(to_shards), optimizer.register_step_post_hook(back)]


def first_state(model, optimizer) -> None:
    """The optimizer state a first training step leaves, without running the step: every trainable parameter's
    gradient (zeros, of the parameter's own sharding and dtype, as backward leaves it) and one optimizer step.
    Fake steps are identical, so the forward and backward of a step 0 only repeated the tracked step's work, untracked:
    two fifths of a projection's time. Measured runs keep their warmup steps (tests hold the two equal)."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def projected_ranks(point: Point) -> list[int]:
    """The cp ranks a projection runs; `stand_in` says which of them each other rank repeats.

    Ranks that differ only in their fsdp or replicate index hold equal shards and run the same step on another
    batch: the same memory, so only cp ranks are ever projected. Within a cp group:
    - a plain batch under Ulysses, or under zigzag ring attention, at a length that splits evenly: every rank holds
      the same shapes and does the same work at every step (zigzag's point), so rank 0 stands for all;
    - any other plain batch (the contiguous ring, whose ranks skip different tiles; USP; a length the layout pads,
      which shortens the last rank's slice): the first, the middle and the last rank. Their work differs only with
      the rank's place in the ring, and tests hold these three equal to every rank's projection;
    - packed or padded batches: every cp rank (each rank's masks differ with where the documents and the padding
      fall)."""
    cp = point.cp_size
    chunks = {"cp_ulysses": cp, "cp_ring_zigzag": 2 * cp}.get(point.cp_style)
    if point.batch_kind != "plain":
        return list(range(cp))
    if chunks and point.seq_len % chunks == 0:
        return [0]
    return sorted({0, cp // 2, cp - 1})


def stand_in(point: Point, rank: int) -> int:
    """The projected cp rank whose record stands for global rank `rank` (cp is the innermost mesh dimension): the
    nearest projected rank at or below its cp rank."""
    cp_rank = rank % point.cp_size
    return max(r for r in projected_ranks(point) if r <= cp_rank)
