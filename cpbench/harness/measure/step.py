"""The training step of a point: its model, batch, optimizer and the steps whose memory is tracked.

One definition, used by both modes of the harness: a measured run (`run/worker.py`, real tensors and process group)
and a projection (`project/projection.py`, fake tensors and a fake process group). Only the tensors and the process
group differ between them; every choice here is the point's, including the ones that follow its device (the
optimizer's foreach kernels are CUDA's default, the single-tensor loop CPU's).
"""

from __future__ import annotations

import contextlib

import torch

from cpbench.harness.measure import parity
from cpbench.harness.measure.collectives import CollectiveCounter
from cpbench.harness.suite.presets import get_preset
from cpbench.harness.suite.spec import NO_STYLE, Point


def make_batch(point: Point, vocab_size: int, device) -> dict:
    """The point's batch. `position_ids` are always given (0..S-1, or restarting per packed document): transformers
    decides from their values whether a batch is packed, and giving them makes that decision the same whether the
    values are real or a projection's known constants (it computes the same arange itself otherwise)."""
    g = torch.Generator().manual_seed(point.seed + 1)
    ids = torch.randint(0, vocab_size, (point.batch_size, point.seq_len), generator=g)
    positions = torch.arange(point.seq_len)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if point.documents != "none":  # the point's documents (a shipped mix or lengths given): positions restart at each
        return {k: v.to(device) for k, v in _packed_documents(point, batch).items()}
    if point.batch_kind == "packed":  # four documents per row; positions restart at each
        positions = positions % -(-point.seq_len // 4)
    elif point.batch_kind == "padded":  # every other row right-padded by a quarter
        mask = torch.ones_like(ids)
        mask[::2, point.seq_len - point.seq_len // 4 :] = 0
        batch["attention_mask"] = mask
        batch["labels"] = ids.masked_fill(mask == 0, -100)
    batch["position_ids"] = positions.expand(point.batch_size, -1).clone()
    return {k: v.to(device) for k, v in batch.items()}


def _packed_documents(point: Point, batch: dict) -> dict:
    """Rows of the point's documents: `position_ids` restart at every document; a pad segment (documents.py) holds
    token 0 and label -100, its positions restarting too."""
    from cpbench.harness.suite import documents

    rows = documents.rows(point.documents, point.document_lengths, point.seq_len, point.batch_size, point.seed,
                          padded=point.batch_kind == "padded")
    positions = torch.stack([torch.cat([torch.arange(s.length) for s in row]) for row in rows])
    pad = torch.stack([torch.cat([torch.full((s.length,), s.pad) for s in row]) for row in rows])
    ids = batch["input_ids"].masked_fill(pad, 0)
    return {"input_ids": ids, "labels": ids.masked_fill(pad, -100), "position_ids": positions}


def build_model(point: Point, device) -> torch.nn.Module:
    """The point's model with seeded random weights: identical on every rank and in the reference."""
    from transformers import AutoModelForCausalLM

    config = get_preset(point.preset).config(point.model_overrides)
    # Mixed precision keeps fp32 master weights; FSDP2 casts them to the point's dtype for compute.
    dtype = torch.float32 if point.mixed_precision else parity.DTYPES[point.dtype]
    torch.manual_seed(point.seed)
    if torch.device(device).type == "cuda":
        torch.cuda.manual_seed(point.seed)
    with torch.device(device):  # initialised where it runs: no host copy of a large model
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=point.attn_implementation
        )
    if point.activation_checkpointing:
        model.activation_checkpointing_enable()
    return model


def build_reference_model(point: Point, device) -> torch.nn.Module:
    """The unsharded reference: the point's model, computing in the point's dtype. Under mixed precision that is
    the fp32 weights cast to it, as FSDP2 casts them for every forward."""
    model = build_model(point, device)
    return model.to(parity.DTYPES[point.dtype]) if point.mixed_precision else model


def distribute(model: torch.nn.Module, point: Point, mesh=None, kernel_device=None) -> torch.nn.Module:
    """The point's levers (selective recompute, activation offload, the fused norm, the tiled MLP), FSDP2 over
    fsdp x cp (with parameter offload), the point's CP style and its loss. `mesh`: one built beforehand (a
    projection builds it outside its fake-tensor mode); `kernel_device`: whose attention kernels CP picks, a device
    type or the `KernelTarget` of a GPU (see DistributedConfig)."""
    import cpbench

    if point.activation_checkpointing and (point.recompute_every_n_layers > 1 or point.offload_activations
                                           or point.recompute_policy != "full"):
        # transformers' own selective recompute and checkpoint offload (torch's save_on_cpu around checkpoint), with
        # cpbench's op-level policy; the unsharded reference keeps plain recompute and the sharded one whole layers
        # (measure/reference.py): the levers change where and when values live, never the values (the fused norm
        # below, on a GPU, by one rounding: the references keep the eager norm and hold it to them).
        cpbench.use_recompute(model, point.recompute_policy, every_n_layers=point.recompute_every_n_layers,
                              offload=point.offload_activations)
    if point.norm == "fused":  # before the tiled MLP, which moves a norm's call into its tiles
        cpbench.use_fused_norm(model)
    if point.tiled_mlp != "off":
        cpbench.use_tiled_mlp(model, "auto" if point.tiled_mlp == "auto" else int(point.tiled_mlp))
    if point.world_size > 1:
        model = _parallelize(model, point, mesh, kernel_device)
        if point.cp_size > 1 and point.balance != "documents":  # the plain zigzag (the balance off)
            cpbench.use_balance(model, point.balance)
    return cpbench.use_loss(model, point.loss_mode) if point.loss_mode != "full" else model


def _parallelize(model, point: Point, mesh, kernel_device):
    import cpbench

    from cpbench.cp.apply import model_cp_plan

    plan = None
    if point.cp_style != NO_STYLE:  # the point's style on the attention entries (the suite's plan's, or the family's)
        plan = dict(point.cp_plan) or model_cp_plan(model) or {}
        attention = [k for k, v in plan.items() if v != "cp_split_sequence"] or ["model.layers.*.self_attn"]
        plan.update(dict.fromkeys(attention, point.cp_style))
    config = cpbench.DistributedConfig(
        cp_size=point.cp_size, fsdp_size=point.fsdp_size, dp_replicate_size=point.dp_replicate_size, cp_plan=plan,
        fsdp_mixed_precision=point.mixed_precision, fsdp_cpu_offload=point.offload_params,
        cp_ulysses_degree=point.cp_ulysses_degree, **_kernel_fields(kernel_device),
    )
    return cpbench.parallelize(model, config, mesh=mesh)


def _kernel_fields(kernel_device) -> dict:
    """DistributedConfig's kernel fields for a device type, or for a `KernelTarget` (a projection's GPU: its
    capability, cuDNN and forced SDPA kernel, cpbench/cp/ring/target.py)."""
    from cpbench.cp.ring.target import KernelTarget

    if not isinstance(kernel_device, KernelTarget):
        return {"cp_kernel_device": kernel_device}
    t = kernel_device
    return {"cp_kernel_device": t.device, "cp_kernel_capability": t.capability,
            "cp_kernel_cudnn_version": t.cudnn_version, "cp_sdpa_kernel": t.sdpa_kernel}


def make_optimizer(model: torch.nn.Module, point: Point) -> torch.optim.Optimizer:
    # torch picks foreach kernels for CUDA parameters and the per-tensor loop for CPU ones; a projection of a CUDA
    # point (CPU fake tensors) must hold the foreach temporaries that CUDA would, so the choice follows the point.
    # With parameter offload the optimizer runs on the host's copies: the per-tensor loop, as torch picks for CPU.
    # `optimizer = "fused"`: torch's fused kernel (CUDA's, or the CPU's for host copies), on every device alike.
    foreach = point.device == "cuda" and not point.offload_params
    if point.optimizer == "fused":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=foreach)
    # a training loop's clip_grad_norm_ right before each optimizer.step(), as its first hook (Trainer clips itself)
    if point.max_grad_norm and point.loop == "own":
        params = list(model.parameters())

        def clip(*_) -> None:
            clip_gradients(params, point.max_grad_norm, foreach)

        optimizer.register_step_pre_hook(clip)
    return optimizer


def clip_gradients(params: list, max_norm: float, foreach: bool) -> torch.Tensor:
    """Every gradient scaled so their global norm is at most `max_norm`; returns that norm before the scaling. For
    FSDP2's DTensor gradients torch sums each rank's shards' norms over the ranks (one all-reduce), so the norm is the
    unsharded gradients' (tests/dist/test_levers.py)."""
    return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=foreach)


def optimizer_phase_hooks(optimizer, enter, leave) -> list:
    """Calls `enter` before `optimizer`'s step and its own pre-hooks, `leave` after the step and its own post-hooks:
    torch's global step hooks, which run first and last (torch/optim/optimizer.py, Optimizer.profile_hook_step),
    filtered to `optimizer`. Returns their handles."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def pre(opt, *_):
        if opt is optimizer:
            enter()

    def post(opt, *_):
        if opt is optimizer:
            leave()

    return [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]


def forward(model, batch: dict):
    """A training forward. No KV cache: CP refuses one, and with a cache transformers skips the packed-sequence
    mask (position_ids restarting), so every point and the reference run the same computation."""
    return model(**batch, use_cache=False)


def train_step(model, optimizer, batch, keep_outputs: bool = False) -> None:
    """One step as a training loop writes it. By default only the loss lives through backward, as in
    `loss = model(**batch).loss` (transformers' Trainer): the logits are freed before backward. With
    `keep_outputs` the whole output (the logits) lives through backward and the optimizer step, as in
    `out = model(**batch); out.loss.backward()`."""
    if keep_outputs:
        out = forward(model, batch)
        out.loss.backward()
    else:
        forward(model, batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def tracked_steps(point: Point, model, optimizer, batch, probe, steps: int | None = None, last=()) -> dict:
    """The steps whose memory counts: identical steps after step 0, each its own segment (the smallest peak counts,
    see probes.py). The collectives of the last one are counted; returns them per kind. `last`: more dispatch modes
    to run the last step under (a projection's op trace)."""
    steps = point.warmup_steps if steps is None else steps
    probe.track_state()  # the optimizer state that step 0 made
    counter = CollectiveCounter()
    with probe.host.levers(point, model, optimizer):  # what the offload levers hold on the host, and move (host.py)
        for i in range(steps):
            with contextlib.ExitStack() as modes:
                modes.enter_context(probe.segment(repeat="step"))
                for mode in ([counter, *last] if i == steps - 1 else []):
                    modes.enter_context(mode)
                train_step(model, optimizer, batch, point.keep_outputs)
    return counter.columns()
