"""`cp_usp` (Ulysses inside groups x the ring across them) at model level on 4 gloo ranks: cp 4 as 2 x 2, and the
degrees that reduce it (1: the ring alone; 4: Ulysses alone, with kv heads (2) fewer than the degree, replicated),
for Qwen3 (plain, packed, left/right-padded and odd-length batches) and Llama, Mistral (sliding window 5) and
Gemma3 (a sliding and a full layer) on packed, left-padded and odd-length ones. Loss, logits (gathered in the USP layout) and every gradient against
the unsharded model; and a cp_usp sweep point's projection against its measurement. One spawn runs every case.

cp 4 x fsdp 2 needs 8 ranks: `test_usp_with_fsdp` runs them (8 gloo processes of a 2-layer model: about 17 s on a
2-core machine, the ranks forked from the preloaded server of tests/spawn.py)."""

from __future__ import annotations

import pytest
import torch

from tests.dist.models import GRAD_RTOL, LOGITS_ATOL, LOSS_RTOL
from tests.dist.test_ring_models import compare_layout

FAMILIES = ("qwen3", "llama", "mistral", "gemma3")
KINDS = ("plain", "packed", "left_pad", "right_pad", "odd")
OTHER_KINDS = ("packed", "left_pad", "odd")


def cases():
    """Qwen3: every kind at degree 2, the packed and odd-length ones at the reducing degrees 1 and 4; the others:
    their mask kinds at degree 2."""
    out = [("qwen3", 2, k) for k in KINDS] + [("qwen3", d, k) for d in (1, 4) for k in ("packed", "odd")]
    return out + [(f, 2, k) for f in FAMILIES if f != "qwen3" for k in OTHER_KINDS]
CP = 4


def _batch(kind: str) -> dict:
    from tests.dist.models import make_batch

    return make_batch("plain", seq_len=19) if kind == "odd" else make_batch(kind, seq_len=24)


# A sweep point of cp_usp, measured here (the sweep worker's own `run_point`) and projected in the test process
# (fake tensors, fake process group): every rank's peak, breakdown and collectives must be equal to the byte.
PROJECTED = ('model = "tiny-qwen3"\nseq_lens = [128]\ncp_sizes = [4]\ncp_styles = ["cp_usp"]\ncp_ulysses_degree = 2\n'
             'batch_kind = "packed"\nattn_implementations = ["sdpa"]\nwarmup_steps = 3\nmeasured_steps = 1\n'
             'parity = "off"\n')


def _projected_point():
    from cpbench.harness.suite.spec import load_suite

    point, = load_suite("u.toml", text=PROJECTED).points()
    return point


def usp_worker(paths: dict) -> dict:
    from transformers import AutoModelForCausalLM

    import cpbench
    from cpbench.harness.run import worker
    from tests.dist.models import reference
    from tests.e2e.estimate_workers import _columns

    if not torch.distributed.is_initialized():  # from_pretrained would, later; the sweep point runs first
        torch.distributed.init_process_group("gloo")
    record = worker.run_point(_projected_point(), rank=torch.distributed.get_rank(), device=torch.device("cpu"),
                              budget=None, cache_dir=None)
    results, refs = {"measured": _columns(record)}, {}
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


def test_the_projection_of_a_usp_point_equals_its_measurement(results):
    """cp_usp's two groups (Ulysses pairs, the ring across them) under the fake process group as on gloo."""
    from cpbench.harness.project import projection
    from tests.e2e.estimate_workers import _columns

    point = _projected_point()
    assert point.cp_ulysses_degree == 2 and "/cp_usp-u2/" in point.point_id
    assert projection.projected_ranks(point) == [0, 1, 2, 3]  # a packed batch: every rank's masks differ
    for rank, per_rank in enumerate(results):
        projected = _columns(projection.project_rank(point, rank))
        assert projected == per_rank["measured"], (rank, per_rank["measured"], projected)
    assert results[0]["measured"]["comm_all_to_all_count"] > 0 and results[0]["measured"]["comm_p2p_count"] > 0


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
