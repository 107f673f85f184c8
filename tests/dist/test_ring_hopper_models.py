"""Model-level parity of each backend's fastest kernels on a Hopper target, on CPU, through the emulations written from
the kernels' sources (tests/emulation/), against the unsharded run of the same weights with the same backend.

What an H100 would run: `DistributedConfig(cp_kernel_device="cuda", cp_kernel_capability=(9, 0))`. An sdpa model's
ring tiles then go to cuDNN's attention (aten_cudnn.py; packed and windowed tiles to flash varlen, or cuDNN run by
run), a flash_attention_3 model's to FlashAttention-3 (flash_attn_3.py) and a flash_attention_4 model's to
FlashAttention-4 (flash_attn_4.py), whose masked (DENSE) tiles take cuDNN with a bias. The flash_attention_3/4 models
are loaded as such (hf_backends.py lets transformers take the emulations on CPU): their own attention - the
reference, and every cp_ulysses row - runs the emulated public functions.

Every row names the kernels its tiles ran (`kernels`: calls per op over its forward and backward). The matrix
(`cases`): bf16; families with head dims 64 (GQA 4:2), 80 with a sliding window of 12, 128 and 256 (over cuDNN's 128
on torch 2.13's cuDNN: the flash kernel), and deepseek_v3's multi-head latent attention (q/k 16, v 8: cuDNN and
FlashAttention-3/-4 take a value head dim of their own); batches plain, packed, left/right padded, odd-length (15) and
packed differently per row (for the flash backends: one packed row, see `batch_for`); cp 2 (cp_ring, cp_ring_zigzag,
and cp_ulysses for the flash backends) and cp 4 (the same and cp_usp, 2 x 2). The default run keeps a slice of it that
reaches every kernel (`DEFAULT`); the whole matrix is marked heavy (CI runs it).
"""

from __future__ import annotations

import pytest
import torch

FAMILIES = {  # name: (family, config overrides)
    "qwen3-d64": ("qwen3", {"head_dim": 64}),
    "mistral-d80-w12": ("mistral", {"head_dim": 80, "sliding_window": 12}),
    "qwen3-d128": ("qwen3", {"head_dim": 128}),
    "qwen3-d256": ("qwen3", {"head_dim": 256}),
    "deepseek-mla": ("deepseek_v3", {}),  # multi-head latent attention: q/k 16, v 8 (tests/dist/test_sinks_and_mla.py)
}
KINDS = ("plain", "packed", "left_pad", "right_pad", "odd", "row_packed")
BACKENDS = ("sdpa", "flash_attention_3", "flash_attention_4")
STYLES = {2: ("cp_ring", "cp_ring_zigzag", "cp_ulysses"), 4: ("cp_ring", "cp_ring_zigzag", "cp_usp", "cp_ulysses")}
H100 = (9, 0)
# The default slice: every backend and every ring style, the batches that reach varlen and cuDNN's bias, cp 2
DEFAULT = {2: [("qwen3-d64", impl, style, kind) for impl in BACKENDS for style in ("cp_ring_zigzag", "cp_ulysses")
               for kind in ("plain", "row_packed") if impl != "sdpa" or style != "cp_ulysses"]
           + [("mistral-d80-w12", "flash_attention_3", "cp_ring", "left_pad"),
              ("mistral-d80-w12", "sdpa", "cp_ring", "row_packed"),
              ("deepseek-mla", "sdpa", "cp_ring_zigzag", "packed"),
              ("deepseek-mla", "flash_attention_3", "cp_ring_zigzag", "plain")]}


def cases(cp: int) -> list[tuple]:
    """(family, backend, style, batch kind) of the whole matrix at `cp`. Ulysses runs the model's own attention
    (the flash backends' public functions); an sdpa model's runs CPU sdpa here, so its rows are the ring's only."""
    return [(name, impl, style, kind) for name in FAMILIES for impl in BACKENDS for style in STYLES[cp]
            for kind in KINDS if not (impl == "sdpa" and style == "cp_ulysses")]


def batch_for(kind: str, impl: str) -> dict:
    """The batch of `kind`. Packed rows for a flash backend come one row at a time: transformers' flash attention
    keeps packed documents apart only for a batch of one row (modeling_flash_attention_utils._is_packed_sequence:
    `batch_size != 1 -> False`), and attends across them otherwise, which the ring (documents from position_ids)
    does not reproduce; the unsharded run is the reference, so such a batch is left out of the parity matrix."""
    from tests.dist.models import make_batch
    from tests.dist.test_ring_cuda_models import batch_for as cuda_batch

    if impl == "sdpa" or kind not in ("packed", "row_packed"):
        return cuda_batch(kind)
    if kind == "packed":
        return make_batch("packed", batch=1)
    batch = make_batch("plain", seq_len=20, batch=1)
    batch["position_ids"] = torch.cat([torch.arange(n) for n in (3, 14, 3)])[None]
    return batch


def _calls() -> dict:
    from tests.emulation import flash_attn_3, flash_attn_4

    return {**_ATEN.calls, **flash_attn_3.CALLS, **flash_attn_4.CALLS}


_ATEN = None  # the worker's counted aten ops (set in `hopper_models_worker`)


def _reference(path: str, impl: str, batch: dict) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=impl, dtype=torch.bfloat16)
    out = model(**batch, use_cache=False)
    out.loss.backward()
    return {"loss": out.loss.detach().float(), "logits": out.logits.detach().float(),
            "grads": {n: p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None}}


def hopper_models_worker(paths: dict, cp: int, rows: list) -> dict:
    """Each row's errors against its reference and the kernels its tiles ran, on this rank."""
    from transformers import AutoModelForCausalLM

    import cpbench
    from cpbench.cp.ring import cuda as ring_cuda
    from tests.dist.test_ring_cuda_models import _errors
    from tests.emulation import aten_sdpa, hf_backends

    global _ATEN
    _ATEN = aten_sdpa.Counted()
    ring_cuda.aten_ops = lambda: _ATEN
    refs, models, results = {}, {}, {}
    with hf_backends.installed(capability=H100):
        for name, impl, style, kind in rows:
            key = (name, impl, kind)
            if key not in refs:
                refs[key] = _reference(paths[name], impl, batch_for(kind, impl))
            if (name, impl, style) not in models:
                config = cpbench.DistributedConfig(
                    cp_size=cp, cp_plan={"model.layers.*.self_attn": style}, cp_kernel_device="cuda",
                    cp_kernel_capability=H100, cp_ulysses_degree=2 if style == "cp_usp" else None)
                models[(name, impl, style)] = AutoModelForCausalLM.from_pretrained(
                    paths[name], attn_implementation=impl, dtype=torch.bfloat16, distributed_config=config)
            before = dict(_calls())
            errs = _errors(models[(name, impl, style)], batch_for(kind, impl), refs[key])
            ran = {op: n - before.get(op, 0) for op, n in _calls().items() if n - before.get(op, 0)}
            kernels = ",".join(f"{k}:{v}" for k, v in sorted(ran.items()))
            results[(name, impl, style, kind)] = {**errs, "kernels": kernels}
    return results


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return {"root": tmp_path_factory.mktemp("ring_hopper_models")}


def _save(paths: dict, names) -> dict:
    """The tiny checkpoints of `names`, each saved once per module (the default slice needs three of them)."""
    from tests.dist.models import save_tiny
    from tests.dist.test_sinks_and_mla import save_tiny as save_mla

    for name in names:
        if name not in paths:
            family, overrides = FAMILIES[name]
            path = paths["root"] / name
            paths[name] = save_mla(family, path) if family == "deepseek_v3" else save_tiny(family, path, **overrides)
    return {name: paths[name] for name in names}


def _run(paths, cp: int, rows: list) -> list:
    from tests.spawn import run_ranks

    saved = _save(paths, sorted({row[0] for row in rows}))
    return run_ranks(hopper_models_worker, cp, saved, cp, rows, timeout=900)


def _check(per_rank: list, cp: int, row: tuple) -> None:
    from cpbench.harness.measure.parity import tolerances

    tol = tolerances("bfloat16", cp)
    name, impl, style, kind = row
    for rank, results in enumerate(per_rank):
        errs = results[row]
        where = f"rank {rank}, kernels {errs['kernels'] or 'none counted'}"
        assert errs["loss"] <= tol["loss_rtol"], f"{where}: loss relative error {errs['loss']:.3g}"
        assert errs["logits"] <= tol["logits_atol"], f"{where}: logits error {errs['logits']:.3g}"
        assert errs["grad"] <= tol["grad_rtol"], f"{where}: gradient error {errs['grad']:.3g} in {errs['grad_where']}"
        # Only the CUDA kernels' emulations are counted: a row that ran none ran CPU kernels, and proves nothing.
        # (A rank whose tiles varlen cannot say runs cuDNN's masked form only, whatever the backend.)
        assert errs["kernels"], f"{where}: no CUDA kernel ran"


@pytest.fixture(scope="module")
def default_results(paths):
    return {cp: _run(paths, cp, rows) for cp, rows in DEFAULT.items()}


@pytest.mark.parametrize("cp,row", [(cp, row) for cp, rows in DEFAULT.items() for row in rows],
                         ids=lambda x: "-".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_hopper_kernels_match_unsharded(default_results, cp, row):
    _check(default_results[cp], cp, row)


def test_every_new_kernel_ran_in_the_default_slice(default_results):
    """cuDNN (plain tiles), flash varlen (packed, windowed), cuDNN with a bias or run by run where a tile is masked,
    FlashAttention-3 and -4 forward and backward: a slice that ran the CPU kernels would pass the parity above."""
    ran = {}
    for results in default_results[2]:
        for errs in results.values():
            for item in filter(None, errs["kernels"].split(",")):
                op, n = item.split(":")
                ran[op] = ran.get(op, 0) + int(n)
    for op in ("cudnn", "cudnn_backward", "varlen", "varlen_backward", "fa3", "fa3_backward", "fa4", "fa4_backward"):
        assert ran.get(op, 0) > 0, (op, ran)
    print("\nkernels per row (rank 0):")
    for row, errs in sorted(default_results[2][0].items()):
        print(f"  cp2 {'/'.join(row):60s} {errs['kernels']}")


@pytest.fixture(scope="module")
def heavy_results(paths):
    return {cp: _run(paths, cp, cases(cp)) for cp in STYLES}


@pytest.mark.heavy
@pytest.mark.parametrize("cp,row", [(cp, row) for cp in STYLES for row in cases(cp)],
                         ids=lambda x: "-".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_whole_matrix_matches_unsharded(heavy_results, cp, row):
    _check(heavy_results[cp], cp, row)
