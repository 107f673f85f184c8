"""`model` as the user's own model: a path to a Hugging Face config.json, a directory holding one, or a hub id whose
config is in the local cache; the new presets; refusals that say what to do; readable point names."""

from __future__ import annotations

import json

import pytest
from transformers import BertConfig, FalconH1Config, LlavaConfig, Phi3Config, Qwen3Config, T5Config

from cpbench.harness.suite.presets import PRESETS, get_preset
from cpbench.harness.suite.spec import load_suite
from cpbench.harness.suite.suite_errors import SuiteErrors

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8)


def _suite(model: str):
    return load_suite("t.toml", text=f'model = "{model}"\nseq_lens = [64]\ncp_sizes = [1, 2]\n')


def test_a_config_file_or_its_directory_is_a_model(tmp_path):
    Qwen3Config(**TINY).save_pretrained(tmp_path / "my-qwen")
    for model in (tmp_path / "my-qwen", tmp_path / "my-qwen" / "config.json"):
        points = _suite(str(model)).points()
        assert [p.model for p in points] == ["my-qwen", "my-qwen"]  # the directory's name, not the path
        assert all(p.point_id.startswith("my-qwen/s64/") for p in points)
        config = get_preset(str(model)).config()
        assert type(config) is Qwen3Config and config.hidden_size == 32 and config.num_key_value_heads == 2


@pytest.mark.parametrize("config,why", [
    (BertConfig(), "is an encoder"),
    (T5Config(), "not a decoder-only causal LM"),
    (LlavaConfig(), "is a multimodal config"),
    (FalconH1Config(), r"cannot be context-parallel at cp_size \[2\]: Mamba-2 mixer in parallel with attention.*"
                       r"Run it at cp_size 1 \(`--cp 1`"),
])
def test_configs_cpbench_cannot_run_are_refused_saying_why(tmp_path, config, why):
    config.save_pretrained(tmp_path / "m")
    with pytest.raises(SuiteErrors, match=why):
        _suite(str(tmp_path / "m"))


def test_a_hybrid_family_is_a_model_like_any_other_at_cp_size_1(tmp_path):
    """docs/families.md: a refused family runs unsharded; only its cp > 1 points are refused."""
    from transformers import Qwen3NextConfig

    Qwen3NextConfig(**TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=32).save_pretrained(tmp_path / "m")
    suite = load_suite("t.toml", text=f'model = "{tmp_path / "m"}"\nseq_lens = [64]\ncp_sizes = [1]\n')
    assert [p.point_id for p in suite.points()] == ["m/s64/cp1/sdpa/none"]
    with pytest.raises(SuiteErrors, match=r"\(qwen3_next\) cannot be context-parallel at cp_size \[2, 4\]: gated "
                                          r"delta net.*Run it at cp_size 1"):
        load_suite("t.toml", text=f'model = "{tmp_path / "m"}"\nseq_lens = [64]\ncp_sizes = [1, 2, 4]\n')


def test_an_unknown_name_says_what_model_may_be_and_never_downloads():
    with pytest.raises(SuiteErrors) as e:
        _suite("some-org/not-a-cached-model")
    text = str(e.value)
    assert "Use one of" in text and "config.json" in text and "local Hugging Face cache" in text
    assert "suite name" not in text and text.count("`model`") + text.count("model =") >= 1


def test_a_file_without_model_type_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(SuiteErrors, match="has no `model_type`"):
        _suite(str(tmp_path))


def test_the_new_presets_have_their_published_sizes():
    qwen, llama = PRESETS["qwen3-8b"].config(), PRESETS["llama-3.1-70b"].config()
    assert (qwen.hidden_size, qwen.num_hidden_layers, qwen.intermediate_size, qwen.num_key_value_heads) == (
        4096, 36, 12288, 8)
    assert (llama.hidden_size, llama.num_hidden_layers, llama.intermediate_size, llama.num_attention_heads) == (
        8192, 80, 28672, 64)


PHI3_PLAN = 'cp_plan = {"model.layers.*" = "cp_split_sequence", "model.layers.*.self_attn" = "cp_ulysses"}\n'


def test_a_family_the_audit_does_not_know_needs_a_plan_and_says_how_to_give_one(tmp_path, monkeypatch):
    from cpbench.cp.families import table

    known = dict(table.families())
    del known["phi3"]  # as a family of a newer transformers would be
    monkeypatch.setattr(table, "families", lambda: known)
    Phi3Config().save_pretrained(tmp_path / "m")
    with pytest.raises(SuiteErrors, match="has no default CP plan.*--cp-plan cp_ulysses.*DistributedConfig"):
        _suite(str(tmp_path / "m"))


def test_a_family_with_a_suite_cp_plan_runs_with_it(tmp_path):
    """With the suite's `cp_plan` (here the default plan's shape, written out) the points exist, their model name
    carries the plan's hash, each point's style goes on the plan's attention entries, and the step projects."""
    from cpbench.harness.project.projection import project_rank

    Phi3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, pad_token_id=0).save_pretrained(tmp_path / "phi")
    text = (f'model = "{tmp_path / "phi"}"\nseq_lens = [64]\ncp_sizes = [2]\nwarmup_steps = 1\nparity = "off"\n'
            f'cp_styles = ["cp_ulysses", "cp_ring_zigzag"]\n')
    points = load_suite("t.toml", text=text + PHI3_PLAN).points()
    assert {p.cp_style for p in points} == {"cp_ulysses", "cp_ring_zigzag"}
    assert all(p.model.startswith("phi+") and p.cp_plan["model.layers.*"] == "cp_split_sequence" for p in points)
    record = project_rank(points[1], 0)
    assert record["status"] == "ok" and record["peak_bytes"] > 0 and record["comm_p2p_count"] > 0  # the ring ran
    with pytest.raises(SuiteErrors, match="cp_plan.*not registered"):
        load_suite("t.toml", text=text + 'cp_plan = {"model.layers.*" = "cp_split_sequence", "x" = "cp_nope"}\n')
    with pytest.raises(SuiteErrors, match="cp_plan.*needs a sequence split"):
        load_suite("t.toml", text=text + 'cp_plan = {"model.layers.*.self_attn" = "cp_ulysses"}\n')


def test_cp_plan_from_the_command_line_is_a_json_plan_or_a_style_name():
    from cpbench.harness.suite.presets import plan_from_flag

    preset = get_preset("qwen3-0.6b")
    assert plan_from_flag("cp_ring_zigzag", preset) == {"model.layers.*": "cp_split_sequence",
                                                         "model.layers.*.self_attn": "cp_ring_zigzag"}
    assert plan_from_flag('{"model.layers.*": "cp_split_sequence"}', preset) == {"model.layers.*": "cp_split_sequence"}
    assert plan_from_flag("cp_ulysses", get_preset("tiny-qwen3"))["model.layers.*.self_attn"] == "cp_ulysses"
    with pytest.raises(ValueError, match="not valid JSON"):
        plan_from_flag('{"model.layers.*": ', preset)
    with pytest.raises(ValueError, match="registered style name"):
        plan_from_flag("cp_nope", preset)


def test_estimate_runs_a_family_without_a_default_plan_one_flag_away(tmp_path, monkeypatch, capsys):
    from cpbench.cli import main
    from cpbench.cp.families import table

    known = dict(table.families())
    del known["phi3"]  # as a family the audit does not know
    monkeypatch.setattr(table, "families", lambda: known)
    Phi3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, pad_token_id=0).save_pretrained(tmp_path / "phi")
    argv = ["estimate", "--model", str(tmp_path / "phi"), "--seq", "64", "--cp", "2", "--styles", "cp_ring_zigzag",
            "--device", "cpu", "--dtype", "float32", "--jobs", "1", "--out", str(tmp_path / "out")]
    assert main(argv) == 2 and "--cp-plan cp_ulysses" in capsys.readouterr().err
    assert main(argv + ["--cp-plan", "cp_ulysses"]) == 0
    out = capsys.readouterr().out
    assert "cp_ring_zigzag" in out and ": ok" in out  # each point's style on the plan's attention entries
