"""DistributedConfig, the mesh arithmetic and the model-level refusals, with no process group."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import cpbench
from cpbench.cp import config as config_module
from cpbench.cp.apply import check_model_class, resolve_for
from cpbench.cp.mesh import check_world_size
from tests.dist.models import tiny_config


def test_dp_size_includes_cp():
    cfg = cpbench.DistributedConfig(fsdp_size=2, cp_size=2, dp_replicate_size=2)
    assert cfg.dp_size == 8
    assert cfg.world_size == 8
    assert cfg.mesh_shape == (1, 2, 2, 2, 1)
    assert cpbench.DistributedConfig().cp_size == 1


@pytest.mark.parametrize("field", ["tp_size", "pp_size"])
def test_cp_with_tp_or_pp_is_refused(field):
    with pytest.raises(ValueError, match=rf"`{field}=2` together with `cp_size=2`.*Set `{field}=1` or `cp_size=1`"):
        cpbench.DistributedConfig(cp_size=2, **{field: 2})


def test_cp_with_ep_is_refused():
    with pytest.raises(ValueError, match=r"`ep_size=2` together with `cp_size=2`"):
        cpbench.DistributedConfig(cp_size=2, fsdp_size=2, ep_size=2)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_cp_size_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=r"`cp_size` must be an integer >= 1"):
        cpbench.DistributedConfig(cp_size=bad)


def test_cp_plan_must_be_a_dict():
    with pytest.raises(TypeError, match="`cp_plan` must be a dict"):
        cpbench.DistributedConfig(cp_size=2, cp_plan="cp_ring")


def test_old_torch_is_refused(monkeypatch):
    monkeypatch.setattr(config_module, "_torch_version", lambda: (2, 9))
    with pytest.raises(ValueError, match=r"needs torch>=2\.10.*set `cp_size=1`"):
        cpbench.DistributedConfig(cp_size=2)


def test_world_size_mismatch_states_both_numbers():
    cfg = cpbench.DistributedConfig(fsdp_size=2, cp_size=2)
    check_world_size(cfg, 4)
    with pytest.raises(ValueError, match=r"needs 4 processes, but the world has 3"):
        check_world_size(cfg, 3)


def _tiny(family="qwen3", attn="sdpa", **overrides):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(family, **overrides), attn_implementation=attn)


def test_resolve_for_a_real_model():
    plan = resolve_for(_tiny(), cpbench.DistributedConfig(cp_size=2))
    assert plan.split_modules == ("model.layers.0", "model.layers.1")
    assert set(plan.attention_modules.values()) == {"cp_ulysses"}


def test_ulysses_refuses_heads_cp_does_not_divide():
    model = _tiny(num_attention_heads=6, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"num_attention_heads=6, which cp_size=4 does not divide.*cp_ring"):
        resolve_for(model, cpbench.DistributedConfig(cp_size=4))


def test_style_that_cannot_serve_the_backend_is_refused():
    cpbench.register_attention_style("test_sdpa_only", lambda *a, **k: None, implementations=("sdpa",), replace=True)
    try:
        model = _tiny(attn="eager")
        cfg = cpbench.DistributedConfig(cp_size=2, cp_plan={"model.layers.*.self_attn": "test_sdpa_only"})
        with pytest.raises(ValueError, match=r"cannot serve attn_implementation='eager'.*\['sdpa'\]"):
            resolve_for(model, cfg)
    finally:
        cpbench.cp.STYLES.unregister("test_sdpa_only")


def test_model_class_opting_out_is_refused():
    class NoCP(torch.nn.Module):
        _supports_context_parallel = False

    with pytest.raises(ValueError, match=r"`NoCP` sets `_supports_context_parallel = False`"):
        check_model_class(NoCP)


def test_refused_family_is_refused_even_with_a_plan():
    with pytest.raises(ValueError, match=r"model_type='gemma4_text'.*set `cp_size=1`"):
        check_model_class(torch.nn.Module, "gemma4_text")


def test_family_without_default_plan_needs_one():
    model = _tiny()
    model.config.model_type = "my_new_family"
    with pytest.raises(ValueError, match="has no `cp_plan`"):
        resolve_for(model, cpbench.DistributedConfig(cp_size=2))
    plan = {"model.layers.*": "cp_split_sequence", "model.layers.*.self_attn": "cp_ulysses"}
    assert resolve_for(model, cpbench.DistributedConfig(cp_size=2, cp_plan=plan)).attention_modules


def test_the_inner_attention_sees_the_models_implementation():
    # flash_attention_forward picks its kernel from module.config._attn_implementation: behind the CP view the
    # module reports cpbench's dispatch key, so the view handed to the inner attention must restore the model's.
    from cpbench.cp import hf_compat

    model = _tiny(attn="sdpa")
    attn = model.model.layers[0].self_attn
    hf_compat.bind_attention(attn, object())
    assert attn.config._attn_implementation == hf_compat.CP_ATTENTION_KEY
    view = hf_compat.ModuleView(attn, config=hf_compat.model_config(attn))
    assert view.config._attn_implementation == "sdpa"
    assert view.num_key_value_groups == attn.num_key_value_groups and view.q_proj is attn.q_proj


def test_heads_other_than_causal_lm_are_refused():
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(tiny_config("qwen3", num_labels=3))
    with pytest.raises(ValueError, match=r"`Qwen3ForSequenceClassification` is neither a causal LM nor a base model"):
        resolve_for(model, cpbench.DistributedConfig(cp_size=2))


def test_base_model_plan_has_no_prefix():
    from transformers import AutoModel

    model = AutoModel.from_config(tiny_config("qwen3"))
    plan = resolve_for(model, cpbench.DistributedConfig(cp_size=2))
    assert plan.split_modules == ("layers.0", "layers.1")
