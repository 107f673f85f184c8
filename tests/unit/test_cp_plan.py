"""Plan resolution and its errors, with no process group."""

import pytest

from cpbench.cp.plan import (
    DEFAULT_BASE_MODEL_CP_PLAN,
    default_cp_plan,
    merge_plan,
    refusal_reason,
    resolve_plan,
)
from cpbench.cp.styles import STYLES

NAMES = [
    "", "model", "model.embed_tokens", "model.layers", "model.layers.0", "model.layers.0.self_attn",
    "model.layers.0.self_attn.q_proj", "model.layers.0.mlp", "model.layers.1", "model.layers.1.self_attn",
    "model.layers.1.self_attn.q_proj", "model.layers.1.mlp", "model.norm", "lm_head",
]
FULL_DEFAULT = {"model.layers.*": "cp_split_sequence", "model.layers.*.self_attn": "cp_ulysses"}


def resolve(plan, names=NAMES):
    return resolve_plan(plan, names, cp_size=2, model_name="TinyForCausalLM")


def test_default_plan_is_prefixed_with_the_base_model():
    assert default_cp_plan("qwen3", "model") == FULL_DEFAULT
    assert default_cp_plan("llama", "") == DEFAULT_BASE_MODEL_CP_PLAN
    assert default_cp_plan("some_unknown_family", "model") is None
    assert default_cp_plan("some_unknown_family", "model", {"layers.*": "x"}) == {"model.layers.*": "x"}


def test_resolution_expands_layers_in_model_order():
    plan = resolve(FULL_DEFAULT)
    assert plan.split_modules == ("model.layers.0", "model.layers.1")
    assert plan.first_split == "model.layers.0"
    assert plan.attention_modules == {
        "model.layers.0.self_attn": "cp_ulysses", "model.layers.1.self_attn": "cp_ulysses",
    }
    assert plan.layout == "contiguous"


def test_override_merges_and_most_specific_key_wins():
    merged = merge_plan(FULL_DEFAULT, {"model.layers.1.self_attn": "cp_ulysses", "model.layers.*": "cp_split_sequence"})
    assert merged["model.layers.1.self_attn"] == "cp_ulysses"
    assert len(merged) == 3
    assert merge_plan(FULL_DEFAULT, {"model.layers.*.self_attn": None}) == {"model.layers.*": "cp_split_sequence"}


def test_no_plan_error_names_the_fix():
    with pytest.raises(ValueError, match=r"`cp_size=2` was requested, but `TinyForCausalLM` has no `cp_plan`.*"
                       r"Pass `cp_plan`.*or set `cp_size=1`"):
        resolve(None)


def test_plan_matching_nothing_is_an_error():
    with pytest.raises(ValueError, match=r"keys \['model\.decoder\.\*'.*match no module.*e\.g\. \['model\.layers\.\*'"):
        resolve({"model.decoder.*": "cp_split_sequence", "model.decoder.*.attn": "cp_ulysses"})


def test_plan_without_attention_or_split_style():
    with pytest.raises(ValueError, match="without an attention style"):
        resolve({"model.layers.*": "cp_split_sequence"})
    with pytest.raises(ValueError, match="without a sequence-split style"):
        resolve({"model.layers.*.self_attn": "cp_ulysses"})


def test_unknown_style_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"Unknown CP style 'cp_nope'.*cp_split_sequence.*cp_ulysses"):
        resolve({**FULL_DEFAULT, "model.layers.*.self_attn": "cp_nope"})


def test_non_string_style_is_a_type_error():
    with pytest.raises(TypeError, match=r"cp_plan\['model.layers.\*'\]"):
        resolve({"model.layers.*": 3, "model.layers.*.self_attn": "cp_ulysses"})


def test_cut_layer_without_cp_attention_is_refused():
    with pytest.raises(ValueError, match="cuts the sequence at `model.layers.1`"):
        resolve({"model.layers.*": "cp_split_sequence", "model.layers.0.self_attn": "cp_ulysses"})


def test_mixed_layouts_are_refused():
    STYLES.register(type(STYLES.get("cp_ulysses"))("test_zig", lambda *a, **k: None, layout="zigzag"), replace=True)
    try:
        with pytest.raises(ValueError, match="different sequence layouts"):
            resolve({**FULL_DEFAULT, "model.layers.1.self_attn": "test_zig"})
    finally:
        STYLES.unregister("test_zig")


@pytest.mark.parametrize("model_type", ["gemma3n", "gemma3n_text", "gemma4", "gemma4_text", "beam", "ministral3"])
def test_families_with_other_full_sequence_inputs_are_refused(model_type):
    assert refusal_reason(model_type)


@pytest.mark.parametrize("model_type", ["qwen3", "llama", "mistral", "gemma3_text", "ministral"])
def test_supported_families_are_not_refused(model_type):
    assert refusal_reason(model_type) is None
