"""`cp_usp` (Ulysses inside groups x the ring across them) at model level on 4 gloo ranks: cp 4 as 2 x 2, and the
degrees that reduce it (1: the ring alone; 4: Ulysses alone, with kv heads (2) fewer than the degree, replicated),
for Qwen3 (plain, packed, left/right-padded and odd-length batches) and Llama, Mistral (sliding window 5) and
Gemma3 (a sliding and a full layer) on packed, left-padded and odd-length ones. Loss, logits (gathered in the USP layout) and every gradient against
the unsharded model. One spawn runs every case.

cp 4 x fsdp 2 needs 8 ranks: `test_usp_with_fsdp` runs it, opt-in (`-m heavy`): 8 gloo processes of a 2-layer
model take about a minute on a 2-core machine, more than the default suite's budget allows."""

from __future__ import annotations

import pytest
import torch

from tests.dist.models import GRAD_RTOL, LOGITS_ATOL, LOSS_RTOL
from tests.dist.test_ring_models import compare_layout

FAMILIES = ("qwen3", "llama", "mistral", "gemma3")
KINDS = ("plain", "packed", "left_pad", "right_pad", "odd")
DEGREES = (2, 1, 4)
# Qwen3 runs every batch kind at every degree; the other families (their masks: sliding windows, mixed layers)
# the kinds that exercise them at degree 2.
OTHER_KINDS = ("packed", "left_pad", "odd")


def cases():
    out = [("qwen3", d, k) for d in DEGREES for k in KINDS]
    return out + [(f, 2, k) for f in FAMILIES if f != "qwen3" for k in OTHER_KINDS]
CP = 4


def _batch(kind: str) -> dict:
    from tests.dist.models import make_batch

    return make_batch("plain", seq_len=19) if kind == "odd" else make_batch(kind, seq_len=24)


def usp_worker(paths: dict) -> dict:
    from transformers import AutoModelForCausalLM

    import cpbench
    from tests.dist.models import reference

    results, refs = {}, {}
    for family, degree in dict.fromkeys((f, d) for f, d, _ in cases()):
        model = AutoModelForCausalLM.from_pretrained(
            paths[family], attn_implementation="sdpa", dtype=torch.float32,
            distributed_config=cpbench.DistributedConfig(
                cp_size=CP, cp_ulysses_degree=degree, cp_plan={"model.layers.*.self_attn": "cp_usp"}),
        )
        for kind in (k for f, d, k in cases() if (f, d) == (family, degree)):
            if (family, kind) not in refs:
                refs[family, kind] = reference(paths[family], _batch(kind), "sdpa")
            results[f"{family}-u{degree}-{kind}"] = compare_layout(model, _batch(kind), refs[family, kind])
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from tests.dist.models import save_tiny
    from tests.spawn import run_ranks

    root = tmp_path_factory.mktemp("usp")
    paths = {f: save_tiny(f, root / f) for f in FAMILIES}
    return run_ranks(usp_worker, CP, paths, timeout=400)


@pytest.mark.parametrize("family,degree,kind", cases())
def test_usp_matches_unsharded(results, family, degree, kind):
    for rank, per_rank in enumerate(results):
        errs = per_rank[f"{family}-u{degree}-{kind}"]
        assert errs["loss"] <= LOSS_RTOL, f"rank {rank}: loss relative error {errs['loss']:.3g}"
        assert errs["logits"] <= LOGITS_ATOL, f"rank {rank}: logits error {errs['logits']:.3g}"
        assert errs["grad"] <= GRAD_RTOL, f"rank {rank}: gradient error {errs['grad']:.3g} in {errs['grad_where']}"


@pytest.mark.heavy
def test_usp_with_fsdp(spawn, tmp_path):
    """fsdp 2 x cp 4 (cp_usp 2 x 2) on 8 ranks: each fsdp pair of cp groups sees its own batch, and FSDP must
    average their gradients; loss, gathered logits and gradients against the unsharded runs."""
    from tests.dist import cp_workers as w
    from tests.dist.models import save_tiny
    from tests.dist.test_cp_parity import check

    path = save_tiny("qwen3", tmp_path)
    results = spawn(w.usp_fsdp_worker, 8, path, "sdpa", timeout=400)
    assert len(results) == 8
    for result in results:
        check(result)
