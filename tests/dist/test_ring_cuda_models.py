"""Model-level parity of the ring's CUDA kernel choice, on CPU, through emulations of the kernels written from their
own sources (tests/emulation/), against the unsharded run of the same weights.

What a GPU would run: `DistributedConfig(cp_kernel_device="cuda")` makes every ring style pick the CUDA kernels
(`CudaSdpaKernel` for sdpa models: aten's flash, varlen flash and memory-efficient ops; `FlashAttnKernel` for
flash_attention_2 models: flash-attn's functions, with the sdpa kernel for the tiles flash-attn cannot take). Here
those ops are the emulations, which read tensors through the strides the kernels assume, check shapes as the
kernels do (no broadcasting) and apply flash's window rules, so a glue mistake that a real GPU would turn into wrong
gradients or a crash fails here. flash_attention_2 needs flash-attn to load a model, so that case loads the model
with sdpa and makes the ring choose as it would for a flash_attention_2 model (the reference is sdpa either way).

The matrix (`cases`): cp 2 (cp_ring, cp_ring_zigzag) with fp32 and bf16, GQA (4 query heads, 2 kv heads), head dims
64, 80 (a sliding window of 12) and 12 (not a multiple of 8), batches plain, packed, left- and right-padded,
odd-length and packed differently per row (sequence 20: rows [8, 12] and [3, 14, 3], where the sliding-window model
meets the off-diagonal varlen window that flash cannot say); cp 4 (the same styles and cp_usp, 2 x 2) on the cases
a wider ring changes (bf16, and fp32 for the window model). bf16 is held to its dtype-derived tolerance (`cpbench.harness.measure.parity.tolerances`), fp32
to the fp32 one. Each of the four defects of issue 16 fails this test without its fix (a crash in the emulated
kernel's checks, or NaN).
"""

from __future__ import annotations

import pytest
import torch

FAMILIES = {  # name: (family, config overrides)
    "qwen3-d64": ("qwen3", {"head_dim": 64}),
    "qwen3-d12": ("qwen3", {"head_dim": 12}),
    "mistral-d80-w12": ("mistral", {"head_dim": 80, "sliding_window": 12}),
}
KINDS = ("plain", "packed", "left_pad", "right_pad", "odd", "row_packed")
STYLES = {2: ("cp_ring", "cp_ring_zigzag"), 4: ("cp_ring", "cp_ring_zigzag", "cp_usp")}


def cases(cp: int) -> list[tuple]:
    """(family, dtype, implementation, style, batch kind) at `cp`. fp32 never reaches flash-attn (its kernels take
    fp16/bf16 only, so a flash_attention_2 model's fp32 tiles take the sdpa kernel: the sdpa case covers them). cp 4
    keeps what a wider ring adds: the odd head dim and the window model in bf16 on the batches that take every route,
    and the window model in fp32 (every tile on the efficient kernel)."""
    if cp == 2:
        return _product(tuple(FAMILIES), ("float32", "bfloat16"), STYLES[2], KINDS)
    return (_product(("qwen3-d12", "mistral-d80-w12"), ("bfloat16",), STYLES[4], ("right_pad", "row_packed"))
            + _product(("mistral-d80-w12",), ("float32",), STYLES[4], ("row_packed",)))


def _product(families, dtypes, styles, kinds) -> list[tuple]:
    return [(name, dtype, impl, style, kind) for name in families for dtype in dtypes
            for impl in (("sdpa",) if dtype == "float32" else ("sdpa", "flash_attention_2"))
            for style in styles for kind in kinds]


def batch_for(kind: str) -> dict:
    from tests.dist.models import make_batch

    if kind == "odd":
        return make_batch("plain", seq_len=15)
    if kind == "row_packed":
        batch = make_batch("plain", seq_len=20)
        rows = [(8, 12), (3, 14, 3)]
        batch["position_ids"] = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
        return batch
    return make_batch(kind)


def _reference(path: str, batch: dict, dtype: torch.dtype) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=dtype)
    out = model(**batch, use_cache=False)
    out.loss.backward()
    return {"loss": out.loss.detach().float(), "logits": out.logits.detach().float(),
            "grads": {n: p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None}}


def _errors(model, batch: dict, ref: dict) -> dict:
    import cpbench
    from tests.dist.models import full_grads, worst_grad_error

    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    layout = model.cp_layout(batch["input_ids"].shape[1])
    logits = cpbench.gather_sequence(out.logits.detach(), layout, model.cp_group).float()
    real = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
    grads = {n: g.float() for n, g in full_grads(model).items()}
    grad, where = worst_grad_error(grads, ref["grads"])
    return {
        "loss": abs(out.loss.item() - ref["loss"].item()) / abs(ref["loss"].item()),
        "logits": (logits - ref["logits"])[real].abs().max().item(),
        "grad": grad,
        "grad_where": where,
    }


class _CountedFunctions:
    """flash-attn's four functions (emulated) behind a counter, in the order `ring_flash._flash_ops` returns them."""

    def __init__(self, functions: dict):
        self.calls = {name: 0 for name in functions}
        self.functions = functions

    def ops(self) -> tuple:
        def counted(name):
            def call(*args, **kwargs):
                self.calls[name] += 1
                return self.functions[name](*args, **kwargs)
            return call
        return tuple(counted(name) for name in ("fwd", "bwd", "varlen_fwd", "varlen_bwd"))


def stand_in_cuda_kernels() -> dict:
    """Make the ring's CUDA kernel choice run through the emulations; returns the call counters."""
    from cpbench.cp.ring import cuda as ring_cuda
    from cpbench.cp.ring import flash as ring_flash
    from tests.emulation import aten_sdpa, flash_attn

    aten = aten_sdpa.Counted()
    ring_cuda.aten_ops = lambda: aten
    flash = _CountedFunctions(flash_attn.FUNCTIONS)
    ring_flash._flash_ops = flash.ops
    return {"aten": aten, "flash_attn": flash}


def cuda_models_worker(paths: dict, cp: int) -> dict:
    from transformers import AutoModelForCausalLM

    import cpbench
    from cpbench.cp.ring import attention as ring
    counters = stand_in_cuda_kernels()
    sdpa_choice = ring.model_attention_implementation
    refs, models, results = {}, {}, {}
    for name, dtype_name, impl, style, kind in cases(cp):
        dtype = getattr(torch, dtype_name)
        if (name, dtype_name, kind) not in refs:
            refs[(name, dtype_name, kind)] = _reference(paths[name], batch_for(kind), dtype)
        if (name, dtype_name, style) not in models:
            config = cpbench.DistributedConfig(
                cp_size=cp, cp_plan={"model.layers.*.self_attn": style}, cp_kernel_device="cuda",
                cp_ulysses_degree=2 if style == "cp_usp" else None)
            models[(name, dtype_name, style)] = AutoModelForCausalLM.from_pretrained(
                paths[name], attn_implementation="sdpa", dtype=dtype, distributed_config=config)
        ring.model_attention_implementation = sdpa_choice if impl == "sdpa" else (lambda module: "flash_attention_2")
        results[(name, dtype_name, impl, style, kind)] = _errors(models[(name, dtype_name, style)], batch_for(kind),
                                                                 refs[(name, dtype_name, kind)])
    ring.model_attention_implementation = sdpa_choice
    results["calls"] = {**counters["aten"].calls, **{f"fa:{k}": v for k, v in counters["flash_attn"].calls.items()}}
    return results


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    from tests.dist.models import save_tiny

    root = tmp_path_factory.mktemp("ring_cuda_models")
    return {name: save_tiny(family, root / name, **overrides) for name, (family, overrides) in FAMILIES.items()}


@pytest.fixture(scope="module")
def results(paths):
    from tests.spawn import run_ranks

    return {cp: run_ranks(cuda_models_worker, cp, paths, cp, timeout=400) for cp in STYLES}


@pytest.mark.parametrize("cp,name,dtype,impl,style,kind", [(cp, *case) for cp in STYLES for case in cases(cp)])
def test_cuda_kernel_choice_matches_unsharded(results, cp, name, dtype, impl, style, kind):
    from cpbench.harness.measure.parity import tolerances

    tol = tolerances(dtype, cp)
    for rank, per_rank in enumerate(results[cp]):
        errs = per_rank[(name, dtype, impl, style, kind)]
        assert errs["loss"] <= tol["loss_rtol"], f"rank {rank}: loss relative error {errs['loss']:.3g}"
        assert errs["logits"] <= tol["logits_atol"], f"rank {rank}: logits error {errs['logits']:.3g}"
        assert errs["grad"] <= tol["grad_rtol"], f"rank {rank}: gradient error {errs['grad']:.3g} in {errs['grad_where']}"


def test_every_cuda_route_ran(results):
    """The matrix reaches every op: flash (FULL/CAUSAL tiles), varlen (SEGMENTS), efficient (DENSE tiles and fp32),
    and flash-attn's four functions; a matrix that silently ran the CPU kernels would pass the parity above."""
    calls = results[2][0]["calls"]
    for op in ("flash", "flash_backward", "efficient", "efficient_backward", "varlen", "varlen_backward"):
        assert calls[op] > 0, (op, calls)
    for op, n in calls.items():
        if op.startswith("fa:"):
            assert n > 0, (op, calls)
