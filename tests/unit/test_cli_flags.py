"""Every flag of `estimate`, `plan` and `sweep` applies (it changes what the command runs: the suite, its points or
the options) or is refused with its name in the error: none is dropped without a word. The walk reads each
subcommand's flags from the parser itself, so a flag added without a sample here fails it."""

from __future__ import annotations

import pytest

from cpbench.cli import build_parser

SUITE = """name = "flags"
model = "tiny-qwen3"
seq_lens = [256]
cp_sizes = [1, 2]
attn_implementations = ["eager"]
warmup_steps = 1
measured_steps = 1
"""

# A value for each flag that differs from the suite file's field and from the flag's own default.
ESTIMATE = {
    "--gpu": ["h100-sxm"], "--sdpa-kernel": ["flash"], "--device-memory": ["80GiB"], "--host-memory": ["2TiB"],
    "--gpus-per-node": ["4"], "--max-seq": [], "--granularity": ["512"], "--jobs": ["1"], "--out": ["elsewhere"],
    "--run-name": ["named"], "--wait": [], "--model": ["tiny-llama"], "--seq": ["512"], "--cp": ["1,4"],
    "--attn": ["sdpa"], "--styles": ["cp_ring"], "--dtype": ["float16"], "--device": ["cuda"], "--world-size": ["4"],
    "--batch-kind": ["packed"], "--batch-size": ["2"], "--loss": ["chunked"], "--recompute": [],
    "--recompute-every": ["2"], "--recompute-policy": ["op"], "--norm": ["fused"], "--optimizer": ["fused"],
    "--max-grad-norm": ["1.0"], "--offload-activations": [], "--offload-params": [], "--tiled-mlp": ["2"],
    "--mixed-precision": [], "--cp-plan": ["cp_ring"], "--documents": ["100,156"], "--compile": [],
    "--balance": ["sequence"], "--override": ["num_hidden_layers=3"],
}
# Refused with a suite file, each for its reason (the error names the flag):
ESTIMATE_REFUSED = {
    "--model": "a suite file and --model are two suites",
    "--sdpa-kernel": "prices SDPA on a GPU profile: only with --gpu",
    "--granularity": "the step of --max-seq's search: only with --max-seq",
    "--max-seq": "needs a capacity (--gpu, --device-memory)",
    "--recompute-every": "a lever of activation checkpointing, which the suite does not turn on",
    "--recompute-policy": "the same",
    "--offload-activations": "offloads recompute checkpoints, which the suite does not keep",
    "--mixed-precision": "FSDP2's, and the suite has no FSDP (world_size 1) and computes in float32",
}
PLAN_BASE = ["plan", "--model", "tiny-llama", "--seq", "8192", "--gpus", "2", "--gpu", "h100-sxm"]
PLAN = {
    "--model": ["tiny-qwen3"], "--seq": ["4096"], "--gpus": ["4"], "--gpu": ["h200"], "--nodes": ["2"],
    "--host-memory": ["2TiB"], "--device-memory": ["40GiB"], "--headroom": ["2GiB"], "--styles": ["cp_ring"],
    "--attn": ["eager"], "--override": ["num_hidden_layers=3"], "--min-gain": ["0.1"], "--top": ["3"],
    "--out": ["suites-out"], "--results": ["elsewhere"], "--jobs": ["1"], "--no-prune": [],
    "--documents": ["4096,4096"], "--cp-plan": ["cp_ring"], "--norm": ["fused"], "--optimizer": ["fused"],
    "--max-grad-norm": ["1.0"],
}
SWEEP = {
    "--out": ["elsewhere"], "--run-name": ["named"], "--resume": [], "--wait": [], "--cp-plan": ["cp_ring"],
    "--documents": ["100,156"], "--compile": [], "--balance": ["sequence"], "--memory-budget": ["1GiB"],
    "--no-progress": [], "--allow-faults": [], "--launcher": ["submitit-local"], "--nodes": ["2"],
    "--gpus-per-node": ["2"], "--partition": ["p"], "--account": ["a"],
}
SWEEP_REFUSED = {"--nodes", "--gpus-per-node", "--partition", "--account"}  # a cluster's, with the local launcher


def _flags(command: str) -> list[str]:
    sub = next(a for a in build_parser()._subparsers._group_actions if command in a.choices).choices[command]
    return [a.option_strings[-1] for a in sub._actions if a.option_strings and a.dest != "help"]


def _walk(samples: dict, base: list[str], effect) -> dict[str, str]:
    """{flag: "applied" | "refused"} for every flag of the subcommand; fails on a flag with no effect."""
    assert set(samples) == set(_flags(base[0])), "give every flag of the subcommand a sample"
    before = effect(build_parser().parse_args(base))
    seen = {}
    for flag, value in samples.items():
        try:
            after = effect(build_parser().parse_args([*base, flag, *value]))
        except ValueError as e:
            assert flag in str(e), f"{flag}: refused without naming it: {e}"
            seen[flag] = "refused"
            continue
        assert after != before, f"{flag} {' '.join(value)} changed nothing: dropped without a word"
        seen[flag] = "applied"
    return seen


@pytest.fixture
def suite_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.toml").write_text(SUITE)
    return "s.toml"


def test_every_estimate_flag_with_a_suite_file_sets_its_field_or_is_refused(suite_file):
    from cpbench.harness.estimate_cli import estimate_options
    from cpbench.harness.project.estimate import preflight

    def effect(args):
        opts = estimate_options(args)
        return opts, preflight(opts)

    seen = _walk(ESTIMATE, ["estimate", suite_file], effect)
    assert {f for f, what in seen.items() if what == "refused"} == set(ESTIMATE_REFUSED)


def test_flags_with_a_suite_file_are_what_its_points_run(suite_file):
    from cpbench.harness.estimate_cli import estimate_options

    args = build_parser().parse_args(["estimate", suite_file, "--seq", "512", "--cp", "2", "--styles", "cp_ring",
                                      "--recompute", "--loss", "chunked", "--override", "num_hidden_layers=3"])
    (point,) = estimate_options(args).suite.points()
    assert (point.seq_len, point.cp_size, point.cp_style, point.activation_checkpointing, point.loss_mode) == (
        512, 2, "cp_ring", True, "chunked")
    assert point.model_overrides == {"num_hidden_layers": 3} and point.attn_implementation == "eager"  # the file's


def test_every_estimate_flag_of_the_quick_form_applies(tmp_path, monkeypatch):
    from cpbench.harness.estimate_cli import estimate_options

    monkeypatch.chdir(tmp_path)
    # the quick form's defaults: cuda, bfloat16, sdpa
    samples = {**ESTIMATE, "--device": ["cpu"], "--dtype": ["float32"], "--attn": ["eager"]}
    seen = _walk(samples, ["estimate", "--model", "tiny-qwen3", "--seq", "256"], lambda a: estimate_options(a))
    assert seen["--model"] == seen["--seq"] == seen["--recompute"] == seen["--override"] == "applied"


def test_every_plan_flag_shapes_the_search_or_what_it_prints(monkeypatch):
    from cpbench.harness.project.commands import plan_options

    seen = _walk(PLAN, PLAN_BASE, lambda a: (plan_options(a), a.top, a.out))
    assert set(seen.values()) == {"applied"}


def test_every_sweep_flag_sets_the_run_or_is_refused(suite_file):
    from cpbench.harness.commands import _options

    seen = _walk(SWEEP, ["sweep", suite_file], _options)
    assert {f for f, what in seen.items() if what == "refused"} >= SWEEP_REFUSED
