"""CP under torch.compile: every decoder layer compiled (`layer.compile()`), 2 gloo ranks, sdpa. Dynamo's own counters
say how many times it broke the graph and how many graphs it compiled after the first step of a shape; the first step
keeps the unsharded eager run's parity (tolerances: tests/dist/models.py).

cp_ulysses traces whole (functional all-to-alls); the ring styles run their attention as one custom op
(cpbench/cp/ring/compiled.py) in an otherwise whole graph. Compile is slow on this machine's two cores: the default suite
runs cp_ulysses on plain rows of a one-layer model only; the packed rows and the ring styles are `heavy`.
"""

from __future__ import annotations

import pytest

from tests.dist.compile_workers import compiled_worker
from tests.dist.models import GRAD_RTOL, LOGITS_ATOL, LOSS_RTOL, save_tiny


def _check(result: dict) -> None:
    assert abs(result["loss"] - result["ref_loss"]) <= LOSS_RTOL * abs(result["ref_loss"]), result
    assert result["logits_err"] <= LOGITS_ATOL, result
    assert result["grad_err"] <= GRAD_RTOL, result
    assert result["graph_breaks"] == 0, result["reasons"]
    assert result["recompiles"] == 0, result


def test_ulysses_compiles_whole(spawn, tmp_path):
    path = save_tiny("qwen3", tmp_path, num_hidden_layers=1)  # one layer: half the compile time
    for rank_result in spawn(compiled_worker, 2, path, "cp_ulysses", ["plain"], timeout=600):
        _check(rank_result["plain"])


@pytest.mark.heavy
def test_ulysses_compiles_whole_on_packed_rows(spawn, tmp_path):
    path = save_tiny("qwen3", tmp_path)
    for rank_result in spawn(compiled_worker, 2, path, "cp_ulysses", ["plain", "packed"], steps=3, timeout=900):
        _check(rank_result["plain"])
        _check(rank_result["packed"])


@pytest.mark.heavy
@pytest.mark.parametrize("style", ["cp_ring", "cp_ring_zigzag", "cp_usp"])
def test_ring_styles_compile_whole_around_their_op(spawn, tmp_path, style):
    path = save_tiny("qwen3", tmp_path)
    for rank_result in spawn(compiled_worker, 2, path, style, ["plain", "packed"], steps=3, timeout=900):
        _check(rank_result["plain"])
        _check(rank_result["packed"])
