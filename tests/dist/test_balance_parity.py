"""Parity of the zigzag ring's per-document placement (cpbench/cp/balance.py) with the unsharded run.

Loss, logits (through `gather_sequence` with `model.cp_layout`, which follows the forward's placement) and every
gradient, for packed rows of odd-length documents, packed-and-padded rows (a pad segment: token 0, label -100),
2-D padded rows, an odd total length (the layout pads) and rows whose documents differ, on Qwen3 and on Mistral with
a sliding window; through the CPU kernels (fp32) and the CUDA kernel choice on its emulations (bf16: the varlen
tiles). Each batch runs twice: with the default granularity (short documents whole, placed by their work) and with
every document split into the 2R chunks (`balance.MIN_CHUNK` = 1), so both halves of the placement meet every mask.
cp 2 (cp_ring_zigzag) by default; cp 4 and 8 (cp_ring_zigzag, and cp_usp with Ulysses pairs) under `-m heavy`.
"""

from __future__ import annotations

import pytest
import torch

FAMILIES = {"qwen3": ("qwen3", {}), "mistral-w6": ("mistral", {"sliding_window": 6})}
KINDS = ("packed", "packed_padded", "padded", "odd", "row_packed")
SEQ = 48


def rows_of(kind: str) -> list[list[int]]:
    """Each row's document lengths (a negative one is a pad segment), for the packed kinds."""
    return {"packed": [[17, 5, 9, 3, 14]] * 2, "packed_padded": [[13, 7, 19, -9]] * 2, "odd": [[11, 23, 7, 4]] * 2,
            "row_packed": [[20, 28], [5, 30, 13]]}[kind]


def batch_for(kind: str) -> dict:
    from tests.dist.models import make_batch

    if kind == "padded":
        batch = make_batch("plain", seq_len=SEQ)
        mask = torch.ones(2, SEQ, dtype=torch.long)
        mask[0, -6:], mask[1, :5] = 0, 0
        return {**batch, "attention_mask": mask, "labels": batch["input_ids"].masked_fill(mask == 0, -100)}
    rows = rows_of(kind)
    batch = make_batch("plain", seq_len=sum(abs(n) for n in rows[0]))
    positions = torch.stack([torch.cat([torch.arange(abs(n)) for n in row]) for row in rows])
    pad = torch.stack([torch.cat([torch.full((abs(n),), n < 0) for n in row]) for row in rows])
    ids = batch["input_ids"].masked_fill(pad, 0)
    return {"input_ids": ids, "labels": ids.masked_fill(pad, -100), "position_ids": positions}


def cases(cp: int) -> list[tuple]:
    """(family, kernels, dtype, style, kind, granularity)."""
    styles = ("cp_ring_zigzag",) if cp == 2 else ("cp_ring_zigzag", "cp_usp")
    return [(family, kernels, dtype, style, kind, grain) for family in FAMILIES
            for kernels, dtype in (("cpu", "float32"), ("cuda-emulated", "bfloat16")) for style in styles
            for kind in KINDS for grain in ("default", "split")]


def balance_worker(paths: dict, cp: int) -> dict:
    from transformers import AutoModelForCausalLM

    import cpbench
    from cpbench.cp import balance
    from tests.dist.test_ring_cuda_models import _errors, _reference, stand_in_cuda_kernels

    stand_in_cuda_kernels()
    default_grain, refs, models, results = balance.MIN_CHUNK, {}, {}, {}
    for family, kernels, dtype_name, style, kind, grain in cases(cp):
        dtype = getattr(torch, dtype_name)
        if (family, dtype_name, kind) not in refs:
            refs[(family, dtype_name, kind)] = _reference(paths[family], batch_for(kind), dtype)
        if (family, kernels, style) not in models:
            config = cpbench.DistributedConfig(
                cp_size=cp, cp_plan={"model.layers.*.self_attn": style}, cp_ulysses_degree=2 if style == "cp_usp"
                else None, cp_kernel_device="cuda" if kernels == "cuda-emulated" else None)
            models[(family, kernels, style)] = AutoModelForCausalLM.from_pretrained(
                paths[family], attn_implementation="sdpa", dtype=dtype, distributed_config=config)
        model = models[(family, kernels, style)]
        balance.MIN_CHUNK = 1 if grain == "split" else default_grain
        errs = _errors(model, batch_for(kind), refs[(family, dtype_name, kind)])
        layout = model.cp_layout(batch_for(kind)["input_ids"].shape[1])
        errs["placed"] = layout.placement is not None
        results[(family, kernels, dtype_name, style, kind, grain)] = errs
    balance.MIN_CHUNK = default_grain
    # the off switch: the plain zigzag on a packed batch, still exact
    model = models[("qwen3", "cpu", "cp_ring_zigzag")]
    balance.use_balance(model, "sequence")
    errs = _errors(model, batch_for("packed"), refs[("qwen3", "float32", "packed")])
    results["off"] = {**errs, "placed": model.cp_layout(SEQ).placement is not None}
    return results


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    from tests.dist.models import save_tiny

    root = tmp_path_factory.mktemp("balance_parity")
    return {name: save_tiny(family, root / name, **overrides) for name, (family, overrides) in FAMILIES.items()}


def _check(results, key, dtype: str, cp: int) -> None:
    from cpbench.harness.measure.parity import tolerances

    tol = tolerances(dtype, cp)
    for rank, per_rank in enumerate(results):
        errs = per_rank[key]
        assert errs["loss"] <= tol["loss_rtol"], f"rank {rank}: loss relative error {errs['loss']:.3g}"
        assert errs["logits"] <= tol["logits_atol"], f"rank {rank}: logits error {errs['logits']:.3g}"
        assert errs["grad"] <= tol["grad_rtol"], f"rank {rank}: gradient error {errs['grad']:.3g} in {errs['grad_where']}"


@pytest.fixture(scope="module")
def cp2(paths):
    from tests.spawn import run_ranks

    return run_ranks(balance_worker, 2, paths, 2, timeout=400)


@pytest.mark.parametrize("family,kernels,dtype,style,kind,grain", cases(2))
def test_placed_layout_matches_unsharded_at_cp2(cp2, family, kernels, dtype, style, kind, grain):
    key = (family, kernels, dtype, style, kind, grain)
    assert cp2[0][key]["placed"]  # the batch's documents (or padding) placed the ring's slots
    _check(cp2, key, dtype, 2)


def test_the_off_switch_keeps_the_plain_zigzag_and_parity(cp2):
    assert not cp2[0]["off"]["placed"]
    _check(cp2, "off", "float32", 2)


@pytest.fixture(scope="module")
def wide(paths):
    from tests.spawn import run_ranks

    return {cp: run_ranks(balance_worker, cp, paths, cp, timeout=1200) for cp in (4, 8)}


@pytest.mark.heavy
@pytest.mark.parametrize("cp,family,kernels,dtype,style,kind,grain", [(cp, *c) for cp in (4, 8) for c in cases(cp)])
def test_placed_layout_matches_unsharded_at_cp4_and_cp8(wide, cp, family, kernels, dtype, style, kind, grain):
    key = (family, kernels, dtype, style, kind, grain)
    assert wide[cp][0][key]["placed"]
    _check(wide[cp], key, dtype, cp)
