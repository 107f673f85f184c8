"""The gate on doctored copies of a fixture run: what passes, what fails, what is refused, what is reported."""

from pathlib import Path

import pandas as pd
import pytest

from cpbench.report.gate import GateRefusal, check_comparable, gate, render, rules_across_hardware
from cpbench.report.gate_rules import Rule, load_rules
from cpbench.report.runs.schema import SCHEMA_VERSION
from tests.report_fixtures import make_run, row_of, slowed

RULES = load_rules(Path(__file__).parents[2] / "results" / "baselines" / "gate-rules.toml")
RING_512 = "llama-tiny/s512/cp2/sdpa/cp_ring"
# The statistical machinery with a tight threshold (a quiet machine's rules); the committed CPU rule is looser.
TIGHT_TIME = Rule(metric="step_times_s", test="mannwhitney", alpha=0.01, threshold=0.2, improvement=0.2)
TIGHT = [r for r in RULES if r.metric != "step_times_s"] + [TIGHT_TIME]


@pytest.fixture
def baseline():
    return make_run(seed=0)


def failures(result):
    return [(f.point, f.what) for f in result.of("fail")]


def test_a_run_passes_against_itself(baseline):
    result = gate(baseline, baseline.copy(), RULES)
    assert result.exit_code == 0 and result.points_checked == len(baseline)
    assert result.findings == []


@pytest.mark.parametrize("rules", [RULES, TIGHT])
def test_noise_of_the_same_spread_passes(baseline, rules):
    result = gate(baseline, make_run(seed=1), rules)
    assert result.exit_code == 0, render(result, "baseline", "run")


def test_a_thirty_percent_slow_down_fails_every_point_that_ran_under_a_tight_rule(baseline):
    result = gate(baseline, slowed(make_run(seed=1), 1.3), TIGHT)
    failed = failures(result)
    assert len(failed) == (baseline["status"] == "ok").sum()
    assert all(what == "step_times_s" for _, what in failed)
    assert "×1.3" in render(result, "b", "r") and "Mann–Whitney" in render(result, "b", "r")


@pytest.mark.parametrize("rules, factor", [(TIGHT, 0.7), (RULES, 0.3)])
def test_a_speed_up_is_reported_as_an_improvement(baseline, rules, factor):
    result = gate(baseline, slowed(make_run(seed=1), factor), rules)
    assert result.exit_code == 0 and {f.what for f in result.of("improvement")} == {"step_times_s"}


def test_more_memory_fails_and_says_by_how_much(baseline):
    run = baseline.copy()
    run.loc[row_of(run, RING_512), "peak_bytes"] += 3 * 1024**2
    result = gate(baseline, run, RULES)
    assert failures(result) == [(RING_512, "peak_bytes")]
    assert "+3.00 MiB" in result.of("fail")[0].message


def test_less_memory_is_an_improvement(baseline):
    run = baseline.copy()
    run.loc[row_of(run, RING_512), "activations_bytes"] *= 0.5
    result = gate(baseline, run, RULES)
    assert result.exit_code == 0 and [f.what for f in result.of("improvement")] == ["activations_bytes"]


def test_a_parity_failure_fails_even_on_a_new_point(baseline):
    run = baseline.copy()
    run.loc[row_of(run, RING_512), ["parity_status", "grad_max_rel_err"]] = ["fail", 3e-2]
    new = make_run(seq_lens=(4096,), cp_sizes=(2,), styles=("cp_ring",))
    new["parity_status"] = "fail"
    result = gate(baseline, pd.concat([run, new], ignore_index=True), RULES)
    assert (RING_512, "parity") in failures(result)
    assert ("llama-tiny/s4096/cp2/sdpa/cp_ring", "parity") in failures(result)
    assert "grad_max_rel_err 0.030 (tolerance 0.00010)" in render(result, "b", "r")


def test_parity_errors_growing_beyond_their_rule_fail(baseline):
    run = baseline.copy()
    run.loc[row_of(run, RING_512), "grad_max_rel_err"] *= 10
    assert failures(gate(baseline, run, RULES)) == [(RING_512, "grad_max_rel_err")]


def test_parity_that_can_no_longer_be_judged_fails(baseline):
    run = baseline.copy()
    run.loc[row_of(run, RING_512), "parity_status"] = "reference_oom"
    assert failures(gate(baseline, run, RULES)) == [(RING_512, "parity")]


@pytest.mark.parametrize("status", ["oom", "error", "timeout", "skipped"])
def test_ok_to_anything_else_fails(baseline, status):
    run = baseline.copy()
    run.loc[row_of(run, RING_512), ["status", "status_detail"]] = [status, "CUDA out of memory"]
    result = gate(baseline, run, RULES)
    assert failures(result) == [(RING_512, "status")]
    assert f"status ok → {status} (CUDA out of memory)" in result.of("fail")[0].message


def test_oom_to_ok_is_an_improvement(baseline):
    run = make_run(oom_cp1_at=None)
    result = gate(baseline, run, RULES)
    assert result.exit_code == 0
    assert [f.message for f in result.of("improvement") if f.what == "status"] == ["status oom → ok", "status skipped → ok"]


def test_a_missing_baseline_point_fails_and_a_new_one_is_listed(baseline):
    run = baseline[baseline["point_id"] != RING_512]
    run = run.assign(seq_len=run["seq_len"].where(run["point_id"] != "llama-tiny/s256/cp1/sdpa/none", 128))
    result = gate(baseline, run, RULES)
    assert sorted(failures(result)) == [("llama-tiny/s256/cp1/sdpa/none", "missing"), (RING_512, "missing")]
    assert len(result.of("new")) == 1


def test_different_hardware_or_schema_is_refused_unless_allowed(baseline):
    run = baseline.assign(hardware_id="NVIDIA H100 80GB HBM3 x 8")
    with pytest.raises(GateRefusal, match="hardware_id: baseline .*--allow-hardware-mismatch"):
        check_comparable(baseline, run)
    assert check_comparable(baseline, run, allow_hardware_mismatch=True) is False
    assert check_comparable(baseline, baseline) is True
    with pytest.raises(GateRefusal, match="schema_version"):
        check_comparable(baseline, baseline.assign(schema_version=SCHEMA_VERSION + 1))
    # a baseline of a version whose successors only added columns (schema.ADDED_SINCE) gates as it is
    assert check_comparable(baseline.assign(schema_version=7), baseline) is True
    with pytest.raises(GateRefusal, match="schema_version"):
        check_comparable(baseline.assign(schema_version=6), baseline)


def test_too_few_samples_make_a_slow_down_a_warning_not_a_failure():
    baseline = make_run(steps=3)
    result = gate(baseline, slowed(make_run(seed=1, steps=3), 3.0), RULES)  # 3 vs 3: p >= 0.05
    assert result.exit_code == 0
    assert result.of("warn") and all("inconclusive" in f.message for f in result.of("warn"))


@pytest.mark.parametrize("factor, fails", [(1.3, True), (1.0, False)])
def test_the_bootstrap_test_agrees(baseline, factor, fails):
    rules = [Rule(metric="step_times_s", test="bootstrap", threshold=0.2, alpha=0.01)]
    result = gate(baseline, slowed(make_run(seed=1), factor), rules)
    assert bool(result.of("fail")) is fails


def test_a_warn_rule_lists_but_does_not_fail(baseline):
    run = baseline.copy()
    run["rss_peak_bytes"] = run["rss_peak_bytes"] * 2
    result = gate(baseline, run, RULES)
    assert result.exit_code == 0 and {f.what for f in result.of("warn")} == {"rss_peak_bytes"}


TOKENS = Rule(metric="tokens_per_s", direction="higher", threshold=0.1, improvement=0.05)
GRAD = Rule(metric="grad_max_rel_err", direction="lower", threshold=1.0, abs_threshold=1e-6, improvement=0.05)


@pytest.mark.parametrize("rule, new, kind", [
    (TOKENS, 500.0, "improvement"),    # higher is better, 0 → more: better, not a failure
    (TOKENS, -500.0, "fail"),          # higher is better, 0 → less: worse
    (GRAD, 1e-3, "fail"),              # lower is better, 0 → more: worse
    (GRAD, -1e-3, "improvement"),      # lower is better, 0 → less: better
])
def test_a_change_from_zero_is_judged_by_the_way_it_went(baseline, rule, new, kind):
    base = baseline.copy()
    base.loc[row_of(base, RING_512), rule.metric] = 0.0
    run = base.copy()
    run.loc[row_of(run, RING_512), rule.metric] = new
    result = gate(base, run, [rule])
    assert [(f.kind, f.point, f.what) for f in result.findings] == [(kind, RING_512, rule.metric)]
    assert result.exit_code == (1 if kind == "fail" else 0)


@pytest.mark.parametrize("metric", ["grad_max_rel_err", "loss_rel_err", "logits_max_err", "peak_bytes"])
def test_a_nan_metric_in_the_run_fails(baseline, metric):
    run = baseline.copy()
    run[metric] = run[metric].astype(float)
    run.loc[row_of(run, RING_512), metric] = float("nan")
    result = gate(baseline, run, RULES)
    assert failures(result) == [(RING_512, metric)]
    assert "→ NaN" in result.of("fail")[0].message


def test_a_nan_step_time_sample_fails(baseline):
    run = baseline.copy()
    index = row_of(run, RING_512)
    run.at[index, "step_times_s"] = list(run.at[index, "step_times_s"][:-1]) + [float("nan")]
    result = gate(baseline, run, RULES)
    assert failures(result) == [(RING_512, "step_times_s")]
    assert "1 of 10 samples are NaN" in result.of("fail")[0].message


def test_a_metric_null_in_both_runs_is_not_judged(baseline):
    base = baseline.assign(grad_max_rel_err=float("nan"))
    assert gate(base, base.copy(), RULES).findings == []


# Step times (s) of one point on the CI machine kind, 6 measured steps (the default CPU suite).
BASE_STEPS = [0.100, 0.097, 0.104, 0.099, 0.112, 0.101]
STEP_CASES = {
    # a loaded machine: two steps untouched, the rest slower; ×1.8 in the median, spreads overlap (U = 28, p > 0.01)
    "x1.8 load, overlapping": ([0.095, 0.103, 0.178, 0.184, 0.195, 0.320], False),
    # the whole run slowed by load: ×1.8 and significant (p = 1/924) — still below the ×2.5 rule
    "x1.8 load, every step": ([t * 1.8 for t in BASE_STEPS], False),
    # a real slow-down: ×3, every step
    "x3 every step": ([t * 3.0 for t in BASE_STEPS], True),
    # ×3 with one step at the old speed: U = 35 of 36, p = 0.0022, still significant
    "x3 one fast step": ([0.105, 0.29, 0.30, 0.31, 0.33, 0.35], True),
}


def _one_point(samples):
    frame = make_run(seq_lens=(512,), cp_sizes=(2,), styles=("cp_ring",), steps=6)
    frame.at[0, "step_times_s"] = list(samples)
    return frame


@pytest.mark.parametrize("case", STEP_CASES)
def test_the_committed_time_rule_with_six_steps_fails_a_large_slow_down_not_machine_load(case):
    samples, fails = STEP_CASES[case]
    result = gate(_one_point(BASE_STEPS), _one_point(samples), RULES)
    assert failures(result) == ([(RING_512, "step_times_s")] if fails else []), render(result, "b", "r")
    assert result.of("warn") == []  # conclusive either way: 6 vs 6 can reach the committed alpha


def test_six_against_six_steps_can_reach_the_committed_alpha():
    from scipy.stats import mannwhitneyu

    from cpbench.report.stats import _min_p

    (rule,) = [r for r in RULES if r.metric == "step_times_s"]
    assert _min_p(6, 6) == pytest.approx(1 / 924) and _min_p(6, 6) < rule.alpha
    assert _min_p(3, 3) >= rule.alpha and _min_p(3, 6) >= rule.alpha  # a 3-step baseline cannot fail on time
    separated = mannwhitneyu([t * 3 for t in BASE_STEPS], BASE_STEPS, alternative="greater").pvalue
    assert separated == pytest.approx(1 / 924)
    assert 1.8 < 1 + rule.threshold < 3.0  # above the load noise seen on CI, below a ×3 slow-down


def test_across_cuda_hardware_memory_only_warns_too():
    rules = rules_across_hardware(TIGHT, cuda=True)
    assert {r.metric: r.action for r in rules if r.metric.endswith("_bytes") or r.metric == "step_times_s"} == {
        r.metric: "warn" for r in TIGHT if r.metric.endswith("_bytes") or r.metric == "step_times_s"}
    assert all(r.action == "fail" for r in rules if r.metric == "grad_max_rel_err")


def test_across_hardware_time_only_warns_while_memory_still_fails(baseline):
    rules = rules_across_hardware(TIGHT, cuda=False)
    assert [r.action for r in rules if r.metric == "step_times_s"] == ["warn"]
    assert all(r.action == "fail" for r in rules if r.metric in ("peak_bytes", "grad_max_rel_err"))
    slow = gate(baseline, slowed(make_run(seed=1), 3.0), rules)
    assert slow.exit_code == 0 and {f.what for f in slow.of("warn")} == {"step_times_s"}
    fat = make_run(seed=1)
    fat.loc[row_of(fat, RING_512), "peak_bytes"] *= 1.5
    assert failures(gate(baseline, fat, rules)) == [(RING_512, "peak_bytes")]
