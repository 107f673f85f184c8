"""The CP core against unsharded runs of the same weights (fp32, gloo, spawned ranks).

Every case checks the loss, this rank's logits (gathered back to global order) and every parameter's gradient.
Tolerances and their reasons are in tests/dist/models.py.
"""

import pytest

from tests.dist import cp_workers as w
from tests.dist.models import GRAD_RTOL, LOGITS_ATOL, LOSS_RTOL, save_tiny

KINDS = ["plain", "packed", "left_pad", "right_pad", "ignore_labels"]
CASES = KINDS + ["odd_length", "inputs_embeds"]


def check(result: dict) -> None:
    assert abs(result["loss"] - result["ref_loss"]) <= LOSS_RTOL * abs(result["ref_loss"]), result
    assert result["logits_err"] <= LOGITS_ATOL, result
    assert result["grad_err"] <= GRAD_RTOL, result


@pytest.fixture(scope="module", params=[("qwen3", "sdpa"), ("llama", "eager")], ids=lambda p: f"{p[0]}-{p[1]}")
def cp2_run(request, tmp_path_factory):
    family, attn = request.param
    path = save_tiny(family, tmp_path_factory.mktemp(family))
    from tests.spawn import run_ranks

    return run_ranks(w.batch_kinds_worker, 2, path, attn, KINDS)


@pytest.mark.parametrize("case", CASES)
def test_cp2_matches_unsharded(cp2_run, case):
    for rank_result in cp2_run:
        check(rank_result[case])


def test_cp2_logits_are_this_ranks_slice(cp2_run):
    # 16 tokens over 2 ranks: 8 each; 15 tokens: padded to 16, the last rank returns only its 7 real tokens.
    assert [r["plain"]["logits_shape"][1] for r in cp2_run] == [8, 8]
    assert [r["odd_length"]["logits_shape"][1] for r in cp2_run] == [8, 7]


def test_default_plan_is_readable(cp2_run):
    assert cp2_run[0]["cp_plan"] == {"model.layers.*": "cp_split_sequence", "model.layers.*.self_attn": "cp_ulysses"}


@pytest.mark.parametrize("call", ["use_cache", "past_key_values", "generate"])
def test_cache_and_generate_are_refused(cp2_run, call):
    message = cp2_run[0]["refusals"][call]
    assert message is not None and "cp_size > 1" in message


def test_gqa_fewer_kv_heads_than_ranks(spawn, tmp_path):
    # 4 query heads, 2 kv heads, cp=4: each rank gets one query head and a replica of its kv head.
    path = save_tiny("llama", tmp_path, num_attention_heads=4, num_key_value_heads=2)
    for rank_result in spawn(w.gqa_worker, 4, path, "sdpa"):
        check(rank_result["plain"])
        check(rank_result["packed"])


def test_fsdp_and_replicate_with_cp(spawn, tmp_path):
    # untied and tied embeddings (one FSDP group for the tied head and embedding, tests/dist/tied_workers.py)
    paths = [save_tiny("qwen3", tmp_path / "untied"), save_tiny("qwen3", tmp_path / "tied", tie_word_embeddings=True)]
    for rank_result in spawn(w.fsdp_cp_workers, 4, paths, "sdpa"):
        for per_model in rank_result:
            check(per_model["fsdp2_cp2"])
            check(per_model["replicate2_cp2"])


def test_custom_attention_style(spawn, tmp_path):
    path = save_tiny("qwen3", tmp_path)
    for rank_result in spawn(w.custom_style_worker, 2, path, "sdpa"):
        check(rank_result)
        assert rank_result["calls"] == 2  # one per layer: attention went through the custom style
        # flash attention picks its kernel from this: it must be the model's implementation, not CP's dispatch key
        assert rank_result["inner_sees"] == {"sdpa"}
        assert rank_result["plan"]["model.layers.*.self_attn"] == "test_counting_ulysses"


def test_save_pretrained_round_trips(spawn, tmp_path):
    path = save_tiny("qwen3", tmp_path / "src")
    results = spawn(w.save_worker, 2, path, "sdpa", str(tmp_path))
    assert results[0]["gathered_keys_match"]
    for r in results:
        assert r["gathered_max_diff"] == 0.0 and r["dcp_max_diff"] == 0.0, r


def test_parallelize_from_config(spawn):
    for rank_result in spawn(w.parallelize_worker, 2, "llama", "sdpa"):
        check(rank_result)


def test_base_model_tuple_outputs_and_double_parallelize(spawn, tmp_path):
    path = save_tiny("qwen3", tmp_path)
    results = spawn(w.heads_worker, 2, path, "sdpa")
    # A base model returns this rank's real tokens: 15 = 8 + 7.
    assert [r["hidden_shape"][1] for r in results] == [8, 7]
    for r in results:
        # A base model's plan has no `model.` prefix, as transformers' base_model_tp_plan.
        assert r["plan"] == {"layers.*": "cp_split_sequence", "layers.*.self_attn": "cp_ulysses"}
        assert r["hidden_err"] <= LOGITS_ATOL, r
        assert "cp_size > 1" in r["base_cache_refused"]
        assert r["tuple_loss"] == r["dict_loss"]
        assert "already distributed" in r["parallelize_twice"]
