"""Tied input/output embeddings under CP against unsharded runs (fp32, gloo, spawned ranks).

(fsdp2 x cp2 and replicate2 x cp2 with a tied model: tests/dist/test_cp_parity.py.) A tied head and embedding
must stay one parameter, be gathered by one FSDP group once per step (not once for the
embedding and again for the head), and get the gradient of both uses, as in the unsharded model.
"""

import pytest

from tests.dist import tied_workers as w
from tests.dist.models import save_tiny
from tests.dist.test_cp_parity import check

STYLES = ["cp_ulysses", "cp_ring", "cp_ring_zigzag"]


def check_tie(facts: dict) -> None:
    assert facts["tied"], "the head and the embedding are no longer one parameter"
    assert facts["gathered"] == facts["unique"], f"a parameter is gathered by two FSDP groups: {facts}"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One 2-rank launch: from_pretrained (ties after loading) for every style, and parallelize (tied already,
    the harness's path) on Qwen3 with sdpa and Gemma3 with eager."""
    from tests.spawn import run_ranks

    path = save_tiny("qwen3", tmp_path_factory.mktemp("tied"), tie_word_embeddings=True)
    gemma = save_tiny("gemma3", tmp_path_factory.mktemp("gemma"), seed=0, tie_word_embeddings=True)
    return run_ranks(w.tied_worker, 2, path, gemma, STYLES)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("kind", ["plain", "packed"])
def test_from_pretrained_tied_matches_unsharded(run, style, kind):
    for rank_result in run:
        check(rank_result["from_pretrained"][style][kind])
        check_tie(rank_result["from_pretrained"][style]["facts"])


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_parallelize_tied_matches_unsharded(run, family):
    for rank_result in run:
        for style in ("cp_ulysses", "cp_ring_zigzag"):
            check(rank_result[family][style]["plain"])
            check_tie(rank_result[family][style]["facts"])
