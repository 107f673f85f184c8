"""The family audit (cpbench/cp/families/) held to the installed transformers: every causal-LM family has a verdict,
docs/families.md is the table rendered, the plans resolve, refused families are refused whatever plan is given, and a
layer that mixes tokens outside attention or computes attention outside the interface is caught for any family."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import cpbench
from cpbench.cp.apply import check_model_class, model_cp_plan
from cpbench.cp.families import mixers, table
from cpbench.cp.plan import resolve_plan
from cpbench.cp.families.tiny import causal_lm_class, tiny_config

ROOT = Path(__file__).parents[2]
SAMPLE = ["llama", "qwen3_moe", "gpt_oss", "deepseek_v3", "gemma2", "gpt_neox", "opt", "longcat_flash", "nemotron"]


def test_every_causal_lm_family_of_the_installed_transformers_has_a_verdict():
    assert set(table.families()) == set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    counts = {v: sum(f.verdict == v for f in table.families().values()) for v in table.VERDICTS}
    assert counts == {"default": 77, "own": 12, "refused": 100}
    for family in table.families().values():
        assert (family.reason is not None) == (family.verdict == "refused"), family
        assert (family.plan is None) == (family.verdict == "refused"), family


def test_the_guide_shows_the_table_as_it_is():
    assert table.markdown() in (ROOT / "docs" / "families.md").read_text()


def _meta_model(family: str):
    with torch.device("meta"):
        return causal_lm_class(family)(tiny_config(family))


@pytest.mark.parametrize("family", SAMPLE)
def test_a_supported_familys_plan_resolves_and_its_layers_mix_tokens_only_in_attention(family):
    model = _meta_model(family)
    plan = resolve_plan(model_cp_plan(model), [n for n, _ in model.named_modules()], cp_size=2, model_name=family)
    assert plan.split_modules and all(any(a.startswith(s + ".") for a in plan.attention_modules)
                                      for s in plan.split_modules)
    assert all(not mixers.other_token_mixers(model.get_submodule(n)) for n in plan.split_modules)


@pytest.mark.parametrize("family,found", [("falcon_h1", "FalconH1Mixer"), ("jamba", "JambaMambaMixer"),
                                          ("qwen3_next", "GatedDeltaNet"), ("bamba", "A_log"),
                                          ("minimax", "MiniMaxLightningAttention"), ("recurrent_gemma", "Rglru")])
def test_a_layer_with_another_token_mixer_is_refused_whatever_the_plan(family, found):
    model = _meta_model(family)
    layers = [n for n, m in model.named_modules() if n.count(".") == 2 and n.split(".")[1] == "layers"]
    assert any(found in m for n in layers for m in mixers.other_token_mixers(model.get_submodule(n)))
    with pytest.raises(ValueError, match="cannot use context parallelism") as refused:
        check_model_class(type(model), model.config.model_type)
    assert table.refusal_reason(family) in str(refused.value)
    with pytest.raises(ValueError, match="mixes tokens outside its attention"):
        mixers.check_layers(model, layers, family)


def test_the_first_forward_catches_an_attention_that_bypasses_the_interface():
    """A cut layer whose bound attention module never calls the interface: refused at its first forward."""
    layer = torch.nn.Sequential(torch.nn.Linear(4, 4))
    layer.self_attn = torch.nn.Linear(4, 4)  # "attention" computed in the module's own code
    root = torch.nn.Module()
    root.layers = torch.nn.ModuleList([layer])
    calls = mixers.AttentionCalls(root, ["layers.0"], ["layers.0.self_attn"], "Toy")
    with pytest.raises(RuntimeError, match=r"never called transformers' attention interface"):
        root.layers[0](torch.zeros(1, 4))
    root.layers[0].self_attn.register_forward_pre_hook(lambda m, a: setattr(m, "_cpbench_calls", 1))
    root.layers[0](torch.zeros(1, 4))  # it went through (the hook stands in for hf_compat's count): watched no more
    assert calls.handles == [] and "_cpbench_calls" not in root.layers[0].self_attn.__dict__


def test_a_plan_given_for_a_refused_family_does_not_help():
    """llama4's NoPE layers would be silently wrong under a cut: refused before any process group, plan or not."""
    model = _meta_model("llama4_text")
    config = cpbench.DistributedConfig(cp_size=2, cp_plan={"model.layers.*": "cp_split_sequence",
                                                           "model.layers.*.self_attn": "cp_ulysses"})
    with pytest.raises(ValueError, match="attn_temperature_tuning") as refused:
        cpbench.parallelize(model, config)
    assert "No `cp_plan` makes a sequence cut exact" in str(refused.value)


@pytest.mark.parametrize("family,why", [(f, None) for f in SAMPLE] + [
    ("falcon_h1", "mixes tokens outside attention"), ("jamba", "mixes tokens outside attention"),
    ("bloom", "does not call the attention interface"), ("bart", "takes other inputs")])
def test_the_automated_audit_agrees_with_the_verdict(family, why):
    from cpbench.cp.families.audit import audit_family, substantive

    finding = audit_family(family)
    assert finding.agrees, finding
    if why is not None:  # a refused family: the automation sees the reason the hand audit gives
        assert any(why in p for p in substantive(finding)), finding


@pytest.mark.heavy
def test_the_automated_audit_agrees_on_every_family():
    from cpbench.cp.families.audit import audit, substantive

    findings = audit()
    assert [f.family for f in findings if not f.agrees] == []
    seen = [f.family for f in findings if f.verdict == "refused" and substantive(f)]
    assert len(seen) >= 75  # 78 in transformers 5.23; the rest are refused on the hand audit's reading alone (docs/families.md)


def test_a_family_that_tells_its_attention_the_window_is_told_apart_from_one_that_does_not():
    from cpbench.cp.families.window import tells_window

    def attention(family):
        return next(m for n, m in _meta_model(family).named_modules() if n.endswith("layers.0.self_attn"))

    assert tells_window(attention("mistral")) and tells_window(attention("gemma3_text"))
    assert not tells_window(attention("phimoe"))  # its window is in the model's mask only
    assert not tells_window(torch.nn.Linear(2, 2))  # no window passed on: the model's mask is kept
