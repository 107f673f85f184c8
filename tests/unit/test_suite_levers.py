"""The long-context levers as suite fields (cpbench/harness/suite/levers.py): what a point carries, how it is named,
and every wrong value refused with its field, value and fix, all at once."""

from __future__ import annotations

import pytest
import torch

from cpbench.harness.suite.spec import load_suite
from cpbench.harness.suite.suite_errors import SuiteErrors

BASE = 'model = "tiny-qwen3"\nseq_lens = [256]\ncp_sizes = [1, 2]\n'


def _suite(extra: str):
    return load_suite("t.toml", text=BASE + extra)


def test_levers_reach_the_points_and_their_names():
    points = _suite("activation_checkpointing = true\nrecompute_every_n_layers = 2\noffload_activations = true\n"
                    "offload_params = true\ntiled_mlp = 4\n").points()
    cp1, cp2 = points
    assert (cp2.recompute_every_n_layers, cp2.offload_activations, cp2.offload_params, cp2.tiled_mlp) == (
        2, True, True, "4")
    assert cp1.offload_params is False  # one rank: no FSDP to offload
    assert cp2.point_id.endswith("/recompute2/offload-act/offload-params/tiled-mlp-4")
    assert cp1.point_key != _suite("activation_checkpointing = true\n").points()[0].point_key  # a key column


@pytest.mark.parametrize("value,column", [("true", "auto"), ('"auto"', "auto"), ("false", "off"), ("1", "off"),
                                          ("8", "8")])
def test_tiled_mlp_values(value, column):
    assert _suite(f"tiled_mlp = {value}\n").points()[0].tiled_mlp == column


def test_every_wrong_lever_is_reported_at_once():
    with pytest.raises(SuiteErrors) as e:
        _suite('recompute_every_n_layers = 2\noffload_activations = true\ntiled_mlp = "many"\noffload_params = 1\n')
    text = str(e.value)
    for needle in ("`recompute_every_n_layers` = 2", "set activation_checkpointing = true, or drop it",
                   "`offload_activations` = True", "holds the recompute checkpoints",
                   "`tiled_mlp` = 'many'", "\"auto\"", "`offload_params` = 1", "must be true or false"):
        assert needle in text, (needle, text)


def test_parameter_offload_needs_more_than_one_rank():
    with pytest.raises(SuiteErrors, match="`offload_params` = True.*needs more than one rank"):
        load_suite("t.toml", text='model = "tiny-qwen3"\nseq_lens = [256]\ncp_sizes = [1]\noffload_params = true\n')


@pytest.mark.parametrize("value,column", [("false", "off"), ('"off"', "off"), ("true", "default"), ('"on"', "default"),
                                          ('"max-autotune-no-cudagraphs"', "max-autotune-no-cudagraphs")])
def test_compile_values(value, column):
    cp1, cp2 = _suite(f"compile = {value}\n").points()
    assert cp2.compile == column
    suffix = {"off": "", "default": "/compiled"}.get(column, f"/compiled-{column}")
    assert cp2.point_id == _suite("").points()[1].point_id + suffix
    assert (cp2.point_key == _suite("").points()[1].point_key) == (column == "off")  # a key column, default "off"


def test_a_wrong_compile_mode_is_refused():
    with pytest.raises(SuiteErrors, match="`compile` = 'fast'.*torch.compile mode"):
        _suite('compile = "fast"\n')


def test_the_recompute_policy_reaches_the_point_and_is_checked():
    (point,) = load_suite("t.toml", text=BASE.replace("[1, 2]", "[1]") + 'activation_checkpointing = true\n'
                          'recompute_policy = "op"\n').points()
    assert point.recompute_policy == "op" and point.point_id.endswith("/recompute-op")
    assert point.point_key != _suite("activation_checkpointing = true\n").points()[0].point_key
    assert _suite("").points()[0].recompute_policy == "full"
    with pytest.raises(SuiteErrors) as e:
        _suite('recompute_policy = "op"\n')
    assert "`recompute_policy` = 'op'" in str(e.value) and "set activation_checkpointing = true" in str(e.value)
    with pytest.raises(SuiteErrors) as e:
        _suite('activation_checkpointing = true\nrecompute_policy = "selective"\n')
    assert "`recompute_policy` = 'selective'" in str(e.value) and "'full', 'op'" in str(e.value)


@pytest.mark.parametrize("extra,needle", [
    ('attn_implementations = ["sdpa", "flash_attention_4"]\n', "FlashAttention-4"),
    ('compile = true\n', "not supported with compile")])
def test_op_recompute_is_refused_where_it_cannot_keep_what_it_says(extra, needle):
    with pytest.raises(SuiteErrors) as e:
        _suite('activation_checkpointing = true\nrecompute_policy = "op"\ndevice = "cuda"\n' + extra)
    assert "`recompute_policy` = 'op'" in str(e.value) and needle in str(e.value)


def test_the_fused_norm_reaches_the_points_and_their_names():
    eager, fused = _suite("").points()[1], _suite('norm = "fused"\n').points()[1]
    assert (eager.norm, fused.norm) == ("eager", "fused")
    assert fused.point_id == eager.point_id + "/fused-norm"
    assert fused.point_key != eager.point_key  # a key column, default "eager"


def test_a_norm_the_fused_op_cannot_compute_is_refused_before_a_launch():
    with pytest.raises(SuiteErrors) as e:
        load_suite("t.toml", text='model = "tiny-gemma3"\nseq_lens = [256]\ncp_sizes = [1]\nnorm = "fused"\n')
    assert "`norm` = 'fused'" in str(e.value) and "Gemma3RMSNorm" in str(e.value) and 'norm = "eager"' in str(e.value)
    with pytest.raises(SuiteErrors, match="`norm` = 'triton'.*must be one of 'eager', 'fused'"):
        _suite('norm = "triton"\n')


def test_an_attention_level_suite_refuses_the_fused_norm():
    text = ('model = "attention-h8-d64"\nlevel = "attention"\nimplementations = ["cpbench"]\nseq_lens = [256]\n'
            'cp_sizes = [1, 2]\ncp_styles = ["cp_ulysses"]\n')
    assert load_suite("t.toml", text=text).points()  # the same suite with the eager norm runs
    with pytest.raises(SuiteErrors, match="`norm` = 'fused': is a model-level setting"):
        load_suite("t.toml", text=text + 'norm = "fused"\n')


def test_the_fused_adamw_reaches_the_points_their_names_and_their_optimizer():
    from cpbench.harness.measure.step import make_optimizer

    plain, fused = _suite("").points()[1], _suite('optimizer = "fused"\n').points()[1]
    assert (plain.optimizer, fused.optimizer) == ("foreach", "fused")
    assert fused.point_id == plain.point_id + "/fused-adamw"
    assert fused.point_key != plain.point_key  # a key column, default "foreach": older rows keep their keys
    model = torch.nn.Linear(4, 4)
    assert make_optimizer(model, fused).defaults["fused"] is True
    assert not make_optimizer(model, plain).defaults["fused"]  # torch's own pick: the per-tensor loop on the CPU
    with pytest.raises(SuiteErrors, match="`optimizer` = 'apex'.*must be one of 'foreach', 'fused'"):
        _suite('optimizer = "apex"\n')
    text = ('model = "attention-h8-d64"\nlevel = "attention"\nimplementations = ["cpbench"]\nseq_lens = [256]\n'
            'cp_sizes = [1, 2]\ncp_styles = ["cp_ulysses"]\noptimizer = "fused"\n')
    with pytest.raises(SuiteErrors, match="`optimizer` = 'fused': is a model-level setting"):
        load_suite("t.toml", text=text)


def test_gradient_clipping_reaches_the_points_and_their_names_and_is_checked():
    plain, clipped = _suite("").points()[1], _suite("max_grad_norm = 1\n").points()[1]
    assert (plain.max_grad_norm, clipped.max_grad_norm) == (0.0, 1.0)
    assert clipped.point_id == plain.point_id + "/clip1"
    assert clipped.point_key != plain.point_key and _suite("max_grad_norm = 0.0\n").points()[1] == plain
    for wrong in ("-1", "true", '"1.0"', "inf", "nan"):
        with pytest.raises(SuiteErrors, match="`max_grad_norm` = .*a finite number >= 0"):
            _suite(f"max_grad_norm = {wrong}\n")
    text = ('model = "attention-h8-d64"\nlevel = "attention"\nimplementations = ["cpbench"]\nseq_lens = [256]\n'
            'cp_sizes = [1, 2]\ncp_styles = ["cp_ulysses"]\nmax_grad_norm = 1.0\n')
    with pytest.raises(SuiteErrors, match="`max_grad_norm` = 1.0: is a model-level setting"):
        load_suite("t.toml", text=text)


def test_the_loop_reaches_the_points_and_their_names_and_is_checked():
    own, trainer = _suite("").points()[1], _suite('loop = "trainer"\n').points()[1]
    assert (own.loop, trainer.loop) == ("own", "trainer")
    assert trainer.point_id == own.point_id + "/trainer-loop"
    # a point of cpbench's own loop keeps the key it had before the field existed (its baselines, its cache)
    assert trainer.point_key != own.point_key and _suite('loop = "own"\n').points()[1] == own
    with pytest.raises(SuiteErrors) as wrong:
        _suite('loop = "trainers"\nkeep_outputs = true\nnorm = "fast"\n')
    assert "`loop` = 'trainers'" in str(wrong.value) and "'own', 'trainer'" in str(wrong.value)
    assert "`norm`" in str(wrong.value)  # every mistake at once
    with pytest.raises(SuiteErrors, match="`keep_outputs` = True: keeps the whole output .* loop = \"trainer\""):
        _suite('loop = "trainer"\nkeep_outputs = true\n')


def test_a_projection_refuses_the_trainer_loop_naming_sweep():
    from cpbench.harness.project.estimate import EstimateOptions, run_estimate

    with pytest.raises(ValueError, match="measured only.*cpbench sweep"):
        run_estimate(EstimateOptions(suite=_suite('loop = "trainer"\n'), out="unused"))
