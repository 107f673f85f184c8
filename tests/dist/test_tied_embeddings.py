"""Tied input/output embeddings under CP against unsharded runs (fp32, gloo, spawned ranks).

A tied head and embedding must stay one parameter, be gathered by one FSDP group once per step (not once for the
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
def from_pretrained_run(tmp_path_factory):
    from tests.spawn import run_ranks

    path = save_tiny("qwen3", tmp_path_factory.mktemp("tied"), tie_word_embeddings=True)
    return run_ranks(w.from_pretrained_worker, 2, path, "sdpa", STYLES)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("kind", ["plain", "packed"])
def test_from_pretrained_tied_matches_unsharded(from_pretrained_run, style, kind):
    for rank_result in from_pretrained_run:
        check(rank_result[style][kind])
        check_tie(rank_result[style]["facts"])


@pytest.mark.parametrize("family, attn", [("qwen3", "sdpa"), ("gemma3", "eager")])
def test_parallelize_tied_matches_unsharded(spawn, tmp_path, family, attn):
    # The harness's path: a model built from its config, tied before it is distributed.
    path = save_tiny(family, tmp_path, seed=0, tie_word_embeddings=True)
    for rank_result in spawn(w.parallelize_worker, 2, family, path, attn, ["cp_ulysses", "cp_ring_zigzag"]):
        for style in ("cp_ulysses", "cp_ring_zigzag"):
            check(rank_result[style]["plain"])
            check_tie(rank_result[style]["facts"])


def test_tied_with_fsdp_and_replicate(spawn, tmp_path):
    path = save_tiny("qwen3", tmp_path, tie_word_embeddings=True)
    for rank_result in spawn(w.fsdp_cp_worker, 4, path, "sdpa"):
        check(rank_result["fsdp2_cp2"])
        check(rank_result["replicate2_cp2"])
