"""CP under torch.compile: every decoder layer compiled (`layer.compile()`), 2 gloo ranks, sdpa. Dynamo's own counters
say how many times it broke the graph and how many graphs it compiled after the first step of a shape; the first step
keeps the unsharded eager run's parity (tolerances: tests/dist/models.py).

cp_ulysses traces whole (functional all-to-alls); the ring styles run their attention as one custom op
(cpbench/cp/ring/compiled.py) in an otherwise whole graph. Compile is slow on this machine's two cores: the default suite
runs cp_ulysses on plain rows of a one-layer model only; the packed rows and the ring styles are `heavy`.

A whole-model compile (`model.compile()`) keeps parity and compiles nothing again, and breaks its graph only outside
the decoder layers: at FSDP2's own hooks, which torch keeps out of dynamo on purpose (`_dynamo_disable`,
torch/distributed/fsdp/_fully_shard/_fsdp_common.py: "skipping FSDP hooks"), and, for a ring style on packed rows,
where the model-level forward reads the batch's documents to the host to place its layout (once a step, by design).

flex_attention (served by cp_ulysses) is compiled forward only: torch 2.13 refuses flex's backward on CPU
(`_validate_device`, torch/nn/attention/flex_attention.py), so its gradients under compile need a GPU.
"""

from __future__ import annotations

import pytest

from tests.dist.compile_workers import compiled_worker, flex_compiled_worker
from tests.dist.models import GRAD_RTOL, LOGITS_ATOL, LOSS_RTOL, save_tiny


FSDP_HOOK = "qualname: disable"  # dynamo's reason for a call into a function marked skipped: FSDP2's hooks
READS_THE_BATCH = ("Data dependent operator", "Dynamic shape operator")  # the layout placed by the batch's documents


def _check(result: dict, allowed: tuple[str, ...] = ()) -> None:
    assert abs(result["loss"] - result["ref_loss"]) <= LOSS_RTOL * abs(result["ref_loss"]), result
    assert result["logits_err"] <= LOGITS_ATOL, result
    assert result["grad_err"] <= GRAD_RTOL, result
    unexpected = {k: n for k, n in result["reasons"].items() if not any(a in k for a in allowed)}
    assert not unexpected, unexpected
    assert result["recompiles"] == 0, result


def test_ulysses_compiles_whole(spawn, tmp_path):
    path = save_tiny("qwen3", tmp_path, num_hidden_layers=1)  # one layer: half the compile time
    for rank_result in spawn(compiled_worker, 2, path, "cp_ulysses", ["plain"], timeout=600):
        _check(rank_result["plain"])


def test_a_whole_model_compile_breaks_only_at_fsdps_hooks(spawn, tmp_path):
    path = save_tiny("qwen3", tmp_path, num_hidden_layers=1)
    for rank_result in spawn(compiled_worker, 2, path, "cp_ulysses", ["plain", "packed"], whole=True, timeout=600):
        for kind in ("plain", "packed"):
            _check(rank_result[kind], allowed=(FSDP_HOOK,))
            assert rank_result[kind]["graph_breaks"] <= 5, rank_result[kind]  # FSDP2's pre/post hooks, root and layer


@pytest.mark.heavy
@pytest.mark.parametrize("style", ["cp_ring_zigzag", "cp_usp"])
def test_a_whole_model_compile_of_a_ring_style(spawn, tmp_path, style):
    path = save_tiny("qwen3", tmp_path, num_hidden_layers=1)
    for rank_result in spawn(compiled_worker, 2, path, style, ["plain", "packed"], whole=True, timeout=900):
        _check(rank_result["plain"], allowed=(FSDP_HOOK,))
        _check(rank_result["packed"], allowed=(FSDP_HOOK, *READS_THE_BATCH))


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


@pytest.mark.heavy
def test_ulysses_over_flex_compiles_whole_forward(spawn, tmp_path):
    # Each layer compiled with inductor around flex_attention's HOP: no break, no recompile on the second forward,
    # the unsharded eager model's loss and logits. Before cp/ulysses.py laid the received heads out with a cat, the
    # query reached flex as a view of a 5-D buffer, which inductor's CPU flex template cannot read ("too many values
    # to unpack", CppFlexAttentionTemplate.choose_flex_template reads the storage's size, not the view's).
    path = save_tiny("qwen3", tmp_path, num_hidden_layers=1)
    for rank_result in spawn(flex_compiled_worker, 2, path, ["plain", "packed"], timeout=600):
        for kind in ("plain", "packed"):
            result = rank_result[kind]
            assert result["logits_shape"] == result["ref_logits_shape"], result
            assert result["loss"] <= LOSS_RTOL, result  # compare's loss: the relative error
            assert result["logits"] <= LOGITS_ATOL, result
            assert result["reasons"] == {} and result["recompiles"] == 0, result
            assert result["compiled_frames"] > 0, result  # the layers really ran compiled
