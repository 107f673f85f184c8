"""Suite loading, validation (each error names the field and the fix) and expansion into points."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpbench.harness.suite.spec import NO_STYLE, load_suite
from cpbench.harness.suite.suites import DEFAULT_SUITE_TOML, resolve_suite
from cpbench.report.units import parse_bytes

ROOT = Path(__file__).parents[2]
BASE = """
name = "t"
model = "tiny-qwen3"
seq_lens = [128, 64]
cp_sizes = [1, 2]
attn_implementations = ["eager", "sdpa"]
cp_styles = ["cp_ulysses", "cp_ring"]
"""


def _load(text: str, **kw):
    return load_suite("t.toml", text=text, **kw)


def test_expansion_collapses_styles_at_cp1_and_orders_lengths():
    points = _load(BASE).points()
    ids = [p.point_id for p in points]
    assert len(ids) == 2 * 2 + 2 * 2 * 2 and len(set(ids)) == len(ids)
    assert ids[0] == "tiny-qwen3/s64/cp1/eager/none" and ids[1] == "tiny-qwen3/s128/cp1/eager/none"
    assert [p.world_size for p in points] == sorted(p.world_size for p in points)
    assert all(p.cp_style == NO_STYLE for p in points if p.cp_size == 1)


def test_point_keys_are_stable_and_ignore_run_settings():
    a = _load(BASE).points()
    b = _load(BASE.replace('name = "t"', 'name = "other"') + "measured_steps = 9\ntimeout_s = 5\n").points()
    assert [p.point_key for p in a] == [p.point_key for p in b]  # same point, other suite settings
    assert len(a[0].point_key) == 16 and int(a[0].point_key, 16) >= 0
    assert a[0].family_key == a[1].family_key and a[0].point_key != a[1].point_key  # lengths of one family


def test_world_size_makes_fsdp_fill_the_rest():
    s = _load(BASE + "world_size = 4\n")
    by_cp = {p.cp_size: p for p in s.points()}
    assert (by_cp[1].fsdp_size, by_cp[2].fsdp_size) == (4, 2) and {p.world_size for p in s.points()} == {4}


def test_overrides_name_the_model():
    p = _load(BASE + "model_overrides = {num_hidden_layers = 1}\n").points()[0]
    other = _load(BASE + "model_overrides = {num_hidden_layers = 3}\n").points()[0]
    assert p.model.startswith("tiny-qwen3+") and len(p.model) == len("tiny-qwen3+") + 6 and p.preset == "tiny-qwen3"
    assert other.model != p.model and other.point_key != p.point_key  # other overrides, another point


@pytest.mark.parametrize("text,field,fix", [
    (BASE.replace("tiny-qwen3", "tiny-qwen9"), "model = 'tiny-qwen9'", "Use one of"),
    (BASE.replace('"sdpa"', '"sdpa2"'), "attn_implementations", "use one of"),
    (BASE.replace('"sdpa"', '"flash_attention_2"'), "attn_implementations", 'device = "cuda"'),
    (BASE.replace('"cp_ring"', '"cp_rang"'), "cp_styles", "use one of"),
    (BASE.replace("[1, 2]", "[1, 3]"), "cp_sizes", "drop cp_ulysses"),
    (BASE + "world_size = 3\n", "cp_sizes", "divide the world"),
    (BASE.replace("[128, 64]", "[128, 99999]"), "seq_lens", "max_position_embeddings"),
    (BASE + 'dtype = "fp8"\n', "dtype", "use one of"),
    (BASE + 'batch_kind = "ragged"\n', "batch_kind", "use one of"),
    (BASE + "measured_steps = 0\n", "measured_steps", ">= 1"),
    (BASE + "warmup_steps = 0\n", "`warmup_steps` = 0", "memory is measured over the warmup steps"),
    (BASE + "timeout_s = -1\n", "timeout_s", "positive"),
    (BASE + "model_overrides = {hiden_size = 8}\n", "model_overrides", "spelling"),
    (BASE + 'memory_budget = "lots"\n', "memory_budget", "80GiB"),
    (BASE + "colour = 1\n", "unknown suite field `colour`", "the known fields are"),
    (BASE + "cp_size = [2]\n", "unknown suite field `cp_size`", "Did you mean `cp_sizes`?"),
    (BASE + '[faults]\n"*" = "crash"\n', "faults", "--allow-faults"),
    (BASE + "mixed_precision = true\n", "mixed_precision", 'set dtype = "bfloat16"'),
    (BASE + 'mixed_precision = "yes"\n', "`mixed_precision` = 'yes'", "true or false"),
    # wrong types: each used to pass validation and fail later (a traceback, pyarrow, or after the launch)
    (BASE + "model_overrides = 3\n", "`model_overrides` = 3", "must be a table"),
    (BASE + 'world_size = "8"\n', "`world_size` = '8'", "must be an integer"),
    (BASE.replace('name = "t"', "name = 5"), "`name` = 5", "must be a string"),
    (BASE + 'seed = "x"\n', "`seed` = 'x'", "must be an integer"),
    (BASE + "batch_size = true\n", "`batch_size` = True", "not a boolean"),
    (BASE + "measured_steps = 2.5\n", "`measured_steps` = 2.5", "must be an integer"),
    (BASE + "timeout_s = true\n", "`timeout_s` = True", "number of seconds"),
    (BASE.replace("[128, 64]", "[128, true]"), "`seq_lens`", "list of integers"),
    (BASE.replace('["cp_ulysses", "cp_ring"]', '["cp_ulysses", 2]'), "`cp_styles`", "list of strings"),
    (BASE + "seed = -1\n", "`seed` = -1", ">= 0"),
    # the world: never launched with 0 ranks, and fsdp_size cannot contradict world_size
    (BASE + "world_size = 0\n", "`world_size` = 0", ">= 1"),
    (BASE.replace("[1, 2]", "[1, 4]") + "world_size = 2\n", "`cp_sizes` = 4", "divide the world"),
    (BASE + "world_size = 4\nfsdp_size = 2\n", "`fsdp_size` = 2", "Remove fsdp_size"),
    # what a style cannot serve, from the style registry
    (BASE.replace('"sdpa"]', '"flex_attention"]'), "`attn_implementations` = 'flex_attention'",
     "cp_ring serves only"),
    (BASE.replace('"sdpa"]', '"flash_attention_2"]') + 'device = "cuda"\n', "flash_attention_2",
     'dtype = \"bfloat16\"'),
])
def test_bad_suites_are_refused_naming_the_field_and_the_fix(text, field, fix):
    with pytest.raises(ValueError) as e:
        _load(text)
    assert field in str(e.value) and fix in str(e.value)


def test_faults_need_the_test_hook_and_a_known_fault():
    text = BASE + '[faults]\n"*/s64/cp2/*" = "crash"\n'
    points = _load(text, allow_faults=True).points()
    assert {p.point_id for p in points if p.fault == "crash"} == {
        p.point_id for p in points if p.seq_len == 64 and p.cp_size == 2}
    with pytest.raises(ValueError, match="faults"):
        _load(BASE + '[faults]\n"*" = "explode"\n', allow_faults=True)


def test_a_hang_fault_can_carry_its_own_timeout():
    text = BASE + '[faults]\n"*/s64/cp2/*" = { fault = "hang", timeout_s = 7 }\n'
    points = _load(text, allow_faults=True).points()
    hung = [p for p in points if p.fault]
    assert hung and all(p.fault == "hang" and p.timeout_s == 7.0 for p in hung)
    assert all(p.timeout_s == 300.0 for p in points if not p.fault)  # the others keep the suite's
    for bad in ('{ fault = "hang", timeout_s = 0 }', '{ fault = "hang", timeout = 7 }', '{ fault = "nap" }'):
        with pytest.raises(ValueError, match="faults"):
            _load(BASE + f'[faults]\n"*" = {bad}\n', allow_faults=True)


def test_sizes():
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("512") == 512 and parse_bytes(7) == 7
    with pytest.raises(ValueError, match="80GiB"):
        parse_bytes("80 gigs")


def test_the_default_suite_is_shipped_as_a_file_and_covers_the_required_grid():
    assert (ROOT / "suites" / "default-cpu.toml").read_text() == DEFAULT_SUITE_TOML
    s = resolve_suite(None)
    assert s.device == "cpu" and set(s.cp_sizes) == {1, 2} and len(s.seq_lens) >= 2
    assert len(s.attn_implementations) >= 2 and {"cp_ulysses", "cp_ring"} <= set(s.cp_styles)
    assert {p.world_size for p in s.points()} == {1, 2}  # two launches


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "suites").glob("*.toml")))
def test_every_shipped_suite_validates(name):
    suite = resolve_suite(ROOT / "suites" / name)
    assert suite.points()
    # The leak check (peaks that grow every warmup step) needs 3. An attention-level suite times one op with no
    # state to leak (no optimizer, no caches), and its one warmup step keeps the CPU peers suite within 3 minutes.
    assert suite.warmup_steps >= 3 or suite.level == "attention"


def test_ring_styles_are_refused_exactly_the_backends_their_registration_does_not_serve():
    from cpbench.cp import STYLES

    served = STYLES.get("cp_ring").implementations
    assert served is not None and "sdpa" in served
    for backend in ("eager", "sdpa", "flex_attention"):
        text = BASE.replace('["eager", "sdpa"]', f'["{backend}"]').replace('"cp_ulysses", ', "")
        if backend in served:
            assert _load(text).points()
        else:
            with pytest.raises(ValueError, match="cp_ring serves only"):
                _load(text)
    # at cp 1 no style runs, so nothing is refused
    assert _load(BASE.replace("[1, 2]", "[1]").replace('"sdpa"]', '"flex_attention"]')).points()


def test_world_size_with_a_matching_fsdp_size_is_accepted():
    s = _load(BASE.replace("[1, 2]", "[2]") + "world_size = 4\nfsdp_size = 2\n")
    assert {(p.cp_size, p.fsdp_size, p.world_size) for p in s.points()} == {(2, 2, 4)}


def test_the_default_suite_measures_enough_steps_for_the_gate_time_test_to_reach_its_alpha():
    import math
    import tomllib

    from cpbench.report.gate_rules import Rule

    n = resolve_suite(None).measured_steps
    rules = tomllib.loads((ROOT / "results" / "baselines" / "gate-rules.toml").read_text())
    alphas = [Rule(metric="step_times_s", test="mannwhitney").alpha] + [
        v["alpha"] for v in rules.get("metrics", {}).values() if isinstance(v, dict) and "alpha" in v]
    # the smallest one-sided p-value of an exact Mann-Whitney test with n vs n samples
    assert 1 / math.comb(2 * n, n) < min(alphas), (n, alphas)


def test_every_error_of_a_suite_is_reported_at_once():
    text = BASE.replace('"sdpa"', '"sdpa2"').replace("cp_sizes = [1, 2]", "cp_sizes = [1, 2]\nbatch_size = 0") + (
        'dtype = "float8"\nwarmup_steps = 0\nnonsense = 1\n')
    with pytest.raises(ValueError) as raised:
        _load(text)
    message = str(raised.value)
    assert message.startswith("t.toml: 5 errors:")
    for part in ("unknown suite field `nonsense`", "`dtype` = 'float8'", "`batch_size` = 0", "`warmup_steps` = 0",
                 "`attn_implementations` = 'sdpa2'"):
        assert part in message, part


def test_a_wrong_type_hides_no_other_error_and_misspellings_get_the_near_name():
    text = BASE.replace('"sdpa"', '"sdpaa"').replace('"cp_ring"', '"cp_rnig"') + (
        'dtype = 3\nbatch_size = "one"\nloss = "chunkd"\nwarmup_steps = 0\ncp_size = [2]\n')
    with pytest.raises(ValueError) as raised:
        _load(text)
    message = str(raised.value)
    assert message.startswith("t.toml: 7 errors:"), message
    for part in ("`dtype` = 3: must be a string", "`batch_size` = 'one': must be an integer",  # the wrong types
                 "`loss` = 'chunkd': use one of ['full', 'chunked', 'liger']. Did you mean `chunked`?",
                 "`warmup_steps` = 0", "`attn_implementations` = 'sdpaa'", "Did you mean `sdpa`?",
                 "`cp_styles` = 'cp_rnig'", "Did you mean `cp_ring`?", "unknown suite field `cp_size`: Did you mean "
                 "`cp_sizes`?"):
        assert part in message, part
    assert message.count("`dtype`") == 1 and message.count("`batch_size`") == 1  # said once, not again as a default


def test_a_misspelt_preset_is_named_before_any_hub_advice():
    with pytest.raises(ValueError, match=r"`model = 'qwen3-0.6B'` is not a cpbench preset. Did you mean `qwen3-0.6b`"):
        _load(BASE.replace("tiny-qwen3", "qwen3-0.6B"))


def test_a_bad_flag_value_is_refused_before_torch_is_imported():
    """The argument errors of `estimate` exit 2 at parsing, with no torch or transformers import (which takes seconds)."""
    import subprocess
    import sys

    code = ("import sys\nfrom cpbench.cli import main\n"
            "for argv in (['--seq', 'abc'], ['--seq', '1024', '--dtype', 'fp8'], ['--seq', '64', '--loss', 'x']):\n"
            "    try:\n        main(['estimate', '--model', 'tiny-qwen3', *argv])\n"
            "    except SystemExit as e:\n        assert e.code == 2, e.code\n"
            "print(sorted({'torch', 'transformers', 'pandas'} & set(sys.modules)))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr
    assert "argument --seq: 'abc': give comma-separated integers" in proc.stderr
    assert "argument --dtype: invalid choice: 'fp8'" in proc.stderr and "argument --loss: invalid choice" in proc.stderr


def test_a_toml_syntax_error_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text('name = "t"\nmodel = "tiny-qwen3"\nseq_lens = [128,\ncp_sizes = [1]\n')
    with pytest.raises(ValueError, match=r"broken\.toml: not valid TOML: .*line 4"):
        load_suite(path)


def test_mixed_precision_points_are_named_and_one_rank_points_are_skipped_with_why():
    from cpbench.harness.run.skips import SkipRules

    points = load_suite("t.toml", text=BASE + 'mixed_precision = true\ndtype = "bfloat16"\n').points()
    assert all(p.mixed_precision and "/mixed-precision/" in p.point_id for p in points)
    reasons = {p.world_size: SkipRules().why_skip(p) for p in points}
    assert "1-rank point is not sharded" in reasons[1] and reasons[2] is None


def test_an_unknown_choice_in_one_list_hides_no_error_in_the_others():
    text = BASE.replace("[128, 64]", "[512, -3]").replace('"sdpa"]', '"sdpa", "nope"]').replace(
        '"cp_ring"]', '"cp_nope"]')
    with pytest.raises(ValueError) as raised:
        _load(text)
    message = str(raised.value)
    assert message.startswith("t.toml: 3 errors:"), message
    for field, value, fix in (("seq_lens", "-3", "integer >= 2"), ("attn_implementations", "'nope'", "use one of"),
                              ("cp_styles", "'cp_nope'", "use one of")):
        assert f"`{field}` = {value}: " in message and fix in message, (field, message)


def test_every_bad_value_of_a_list_and_the_config_checks_are_reported_beside_other_errors():
    # two unknown backends, a length past max_position_embeddings and a cp size cp_ulysses cannot shard (both need
    # the model's config), next to a wrong dtype: each is reported
    text = BASE.replace('"sdpa"]', '"sdpa", "nope", "nada"]').replace("[128, 64]", "[128, 99999]").replace(
        "[1, 2]", "[1, 2, 3]") + 'dtype = "fp8"\n'
    with pytest.raises(ValueError) as raised:
        _load(text)
    message = str(raised.value)
    for part in ("`attn_implementations` = 'nope'", "`attn_implementations` = 'nada'", "`seq_lens` = 99999",
                 "`cp_sizes` = 3: cp_ulysses shards", "`dtype` = 'fp8'"):
        assert part in message, (part, message)
    assert message.startswith("t.toml: 5 errors:"), message


def test_a_suite_error_is_said_in_the_flags_that_built_it():
    from cpbench.harness.suite.suite_errors import SuiteErrors, err, in_flags

    flags = {"seq_lens": "--seq", "activation_checkpointing": "--recompute", "dtype": "--dtype",
             "cp_styles": "--styles", "world_size": "--world-size", "model_overrides": "--override"}
    errors = SuiteErrors("--model m", [
        str(err("seq_lens", 65536, "raise it with model_overrides = {max_position_embeddings = 131072}.")),
        str(err("activation_checkpointing", True, "drop it.")),
        str(err("dtype", "float64", 'set dtype = "bfloat16", or drop `cp_styles`; world_size = 2 stays.')),
        str(err("warmup_steps", -1, "use 0 or more; keep dtype_hint as it is.")),
    ])
    said = str(in_flags(errors, flags)).splitlines()
    assert said == ["--model m: 4 errors:",
                    "  - `--seq 65536`: raise it with --override max_position_embeddings=131072.",
                    "  - `--recompute`: drop it.",
                    "  - `--dtype float64`: set --dtype bfloat16, or drop `--styles`; --world-size 2 stays.",
                    "  - suite field `warmup_steps` = -1: use 0 or more; keep dtype_hint as it is."]
