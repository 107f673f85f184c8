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


def _recompute(path: str, attn: str, cases: list[tuple[str, str]]) -> dict:
    out, models = {}, {}
    for style, kind in cases:
        if style not in models:
            model = _load(path, attn, cp_size=2, cp_plan={"model.layers.*.self_attn": style})
            model.activation_checkpointing_enable()
            model.train()
            assert all(layer.gradient_checkpointing for layer in model.model.layers)
            calls = []
            model.model.layers[0].self_attn.register_forward_hook(lambda *_, calls=calls: calls.append(1))
            models[style] = (model, calls)
        model, calls = models[style]
        before = len(calls)
        out[(style, kind)] = _parity(model, make_batch(kind), path, attn, 2)
        out[(style, kind)]["attention_calls"] = len(calls) - before
    return out


def worker(qwen3: str, llama: str) -> dict:
    """Qwen3 (tied) with sdpa: every style and batch kind; Llama with eager: the ring's uniform rows of
    left-padded queries, recomputed."""
    return {"qwen3": _recompute(qwen3, "sdpa", [(s, k) for s in STYLES for k in KINDS]),
            "llama": _recompute(llama, "eager", [("cp_ring", "left_pad")])}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from tests.spawn import run_ranks

    qwen3 = save_tiny("qwen3", tmp_path_factory.mktemp("qwen3"), tie_word_embeddings=True)
    llama = save_tiny("llama", tmp_path_factory.mktemp("llama"))
    return run_ranks(worker, 2, qwen3, llama)


def _check(case: dict) -> None:
    check(case)
    assert case["attention_calls"] == 2  # the first layer's attention ran twice: forward, then the recompute


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("kind", KINDS)
def test_recompute_matches_the_unsharded_run(results, style, kind):
    for rank_result in results:
        _check(rank_result["qwen3"][(style, kind)])


def test_recompute_keeps_eagers_uniform_rows(results):
    for rank_result in results:
        _check(rank_result["llama"][("cp_ring", "left_pad")])
