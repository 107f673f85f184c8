"""Activation checkpointing (`model.activation_checkpointing_enable()`, transformers' recompute of every decoder
layer in backward) with every CP style, against the unsharded run (fp32, gloo): the split hook, the rotary cut
and the batch facts are made once, outside the recomputed forward, and the ring's autograd runs again in the
recompute (its transfers included, on every rank alike)."""

from __future__ import annotations

import pytest

from tests.dist.cp_workers import _load, _parity
from tests.dist.models import make_batch, save_tiny
from tests.dist.test_cp_parity import check

STYLES = ["cp_ulysses", "cp_ring", "cp_ring_zigzag"]
KINDS = ["plain", "packed", "left_pad"]


def worker(path: str, attn: str) -> dict:
    out = {}
    for style in STYLES:
        model = _load(path, attn, cp_size=2, cp_plan={"model.layers.*.self_attn": style})
        model.activation_checkpointing_enable()
        model.train()
        assert all(layer.gradient_checkpointing for layer in model.model.layers)
        calls = []
        model.model.layers[0].self_attn.register_forward_hook(lambda *_: calls.append(1))
        for kind in KINDS:
            out[(style, kind)] = _parity(model, make_batch(kind), path, attn, 2)
        out[(style, "attention_calls")] = len(calls)
    return out


@pytest.fixture(scope="module", params=[("qwen3", "sdpa", True), ("llama", "eager", False)],
                ids=["qwen3-sdpa-tied", "llama-eager"])
def results(request, tmp_path_factory):
    from tests.spawn import run_ranks

    family, attn, tied = request.param
    path = save_tiny(family, tmp_path_factory.mktemp(family), tie_word_embeddings=tied)
    return run_ranks(worker, 2, path, attn)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("kind", KINDS)
def test_recompute_matches_the_unsharded_run(results, style, kind):
    for rank_result in results:
        check(rank_result[(style, kind)])
        # the first layer's attention ran twice per step (forward, then the recompute in backward)
        assert rank_result[(style, "attention_calls")] == 2 * len(KINDS)
