"""The regression gate: a run against a baseline, point by point (matched on KEY_COLUMNS), per-metric rules.

Fails on any parity failure, a point that was ok and is not any more, a crash that was not there before, a
metric worse than its rule allows, and a baseline point the run lacks. Refuses (GateRefusal) to compare runs
of different hardware or schema versions unless told to; told to compare other hardware, it gates what the
hardware does not set (status, parity, CPU tracked memory) and lists what it does (time; CUDA memory) as
warnings. Large
improvements are listed so the baseline can be refreshed on purpose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from . import units
from .gate_rules import Rule
from .runs.load import schema_versions
from .runs.match import check_unique, match_points, side
from .runs.schema import ADDED_SINCE, SCHEMA_VERSION
from .stats import judge_samples

CRASHES = ("error", "timeout")


class GateRefusal(Exception):
    """The two runs cannot be compared (exit code 2)."""


@dataclass(frozen=True)
class Finding:
    kind: str      # "fail" | "warn" | "improvement" | "new"
    point: str
    what: str      # the metric, or status / parity / missing
    message: str


@dataclass
class GateResult:
    findings: list[Finding] = field(default_factory=list)
    points_checked: int = 0

    def of(self, kind: str) -> list[Finding]:
        return [f for f in self.findings if f.kind == kind]

    @property
    def exit_code(self) -> int:
        return 1 if self.of("fail") else 0


def check_comparable(baseline: pd.DataFrame, run: pd.DataFrame, *, allow_hardware_mismatch: bool = False,
                     allow_schema_mismatch: bool = False, allow_measurement_mismatch: bool = False,
                     allow_suite_mismatch: bool = False) -> bool:
    """Raises GateRefusal unless the runs can be compared; returns whether they ran on the same hardware."""
    base_s, run_s = _values(baseline, "suite"), _values(run, "suite")
    if base_s != run_s and not allow_suite_mismatch:
        raise GateRefusal(f"suite: baseline {base_s}, run {run_s}; a baseline gates the run of its own suite (every "
                          f"point it lacks would read as a regression) — pass the baseline recorded for {run_s}, or "
                          f"--allow-suite-mismatch to gate the points the two share")
    base_v, run_v = schema_versions(baseline), schema_versions(run)
    if base_v != run_v and not allow_schema_mismatch and not _only_added(base_v + run_v):
        raise GateRefusal(f"schema_version: baseline {base_v}, run {run_v}; refresh the baseline with "
                          f"--update-baseline (after checking the run), or pass --allow-schema-mismatch")
    base_m, run_m = _values(baseline, "measurement"), _values(run, "measurement")
    if base_m != run_m and not allow_measurement_mismatch:
        raise GateRefusal(f"measurement: baseline {base_m}, run {run_m}; a projection has no time and no parity, so "
                          f"gate projections against a projected baseline, or pass --allow-measurement-mismatch to "
                          f"gate what both have (status and memory; a measured parity is then reported as lost)")
    base_hw, run_hw = _values(baseline, "hardware_id"), _values(run, "hardware_id")
    if base_hw != run_hw and not allow_hardware_mismatch:
        raise GateRefusal(f"hardware_id: baseline {base_hw}, run {run_hw}; time (and CUDA memory) is only comparable "
                          f"on the same hardware — gate against a baseline recorded there, or pass "
                          f"--allow-hardware-mismatch (then status, parity and CPU memory are gated, the rest listed)")
    return base_hw == run_hw


def _only_added(versions: list[int]) -> bool:
    """Whether every version differs from the current one only by columns added since (schema.ADDED_SINCE): the
    metrics a gate compares are then the same columns with the same meaning."""
    return all(version <= SCHEMA_VERSION and all(v in ADDED_SINCE for v in range(version, SCHEMA_VERSION))
               for version in versions)


def hardware_bound(metric: str, cuda: bool) -> bool:
    """Metrics the hardware sets: times, rates and the process RSS; on CUDA memory too (allocator workspaces and
    kernel choices differ by GPU). On CPU the tracked tensor bytes, parity and status are the software's."""
    return metric.endswith("_s") or metric == "mfu" or metric.startswith("rss_") or (cuda and metric.endswith("_bytes"))


def rules_across_hardware(rules: list[Rule], cuda: bool) -> list[Rule]:
    """The rules for runs on different hardware: a hardware-bound metric is listed as a warning, never failed."""
    return [replace(r, action="warn") if hardware_bound(r.metric, cuda) else r for r in rules]


def _values(frame: pd.DataFrame, column: str) -> list[str]:
    return sorted({str(v) for v in frame[column].dropna()})


def gate(baseline: pd.DataFrame, run: pd.DataFrame, rules: list[Rule]) -> GateResult:
    result = GateResult()
    for name, frame in (("baseline", baseline), ("run", run)):
        try:
            check_unique(frame, name)
        except ValueError as e:
            raise GateRefusal(str(e)) from e
    for _, pair in match_points(baseline, run, ("_b", "_r")).iterrows():
        if pair["_merge"] == "left_only":
            result.findings.append(Finding("fail", pair["point_id_b"], "missing",
                                           "baseline point is missing from the run (not run, or its spec changed)"))
            continue
        row = side(pair, "_r")
        if pair["_merge"] == "right_only":
            result.findings.append(Finding("new", row["point_id"], "new", "not in the baseline"))
            result.findings += _parity_failure(row) + _new_crash(row)
            continue
        result.points_checked += 1
        result.findings += _judge_point(side(pair, "_b"), row, rules)
    return result


def _judge_point(base: pd.Series, run: pd.Series, rules: list[Rule]) -> list[Finding]:
    point = run["point_id"]
    findings = _status_change(base, run) + _parity_failure(run) + _parity_regression(base, run)
    if base["status"] == "ok" and run["status"] == "ok":
        for rule in rules:
            finding = _judge_metric(point, base[rule.metric], run[rule.metric], rule)
            if finding:
                findings.append(finding)
    return findings


def _status_change(base: pd.Series, run: pd.Series) -> list[Finding]:
    old, new = base["status"], run["status"]
    if old == new:
        return [Finding("warn", run["point_id"], "status", f"still {new} (as in the baseline)")] if new in CRASHES else []
    detail = f" ({run['status_detail']})" if isinstance(run["status_detail"], str) else ""
    if old == "ok" or new in CRASHES:
        return [Finding("fail", run["point_id"], "status", f"status {old} → {new}{detail}")]
    if new == "ok":
        return [Finding("improvement", run["point_id"], "status", f"status {old} → ok")]
    return [Finding("warn", run["point_id"], "status", f"status {old} → {new}{detail}")]


def _new_crash(run: pd.Series) -> list[Finding]:
    if run["status"] not in CRASHES:
        return []
    detail = f" ({run['status_detail']})" if isinstance(run["status_detail"], str) else ""
    return [Finding("fail", run["point_id"], "status", f"new point ended {run['status']}{detail}")]


def _parity_failure(run: pd.Series) -> list[Finding]:
    if run["parity_status"] != "fail":
        return []
    errors = [f"{err} {units.sig(run[err], 2)} (tolerance {units.sig(run[tol], 2)})"
              for err, tol in (("loss_rel_err", "loss_rtol"), ("logits_max_err", "logits_atol"),
                               ("grad_max_rel_err", "grad_rtol")) if pd.notna(run[err])]
    worst = f", worst parameter {run['grad_worst_param']}" if isinstance(run["grad_worst_param"], str) else ""
    detail = f"{run['parity_detail']}: " if isinstance(run["parity_detail"], str) else ""
    return [Finding("fail", run["point_id"], "parity", f"parity failed: {detail}{'; '.join(errors)}{worst}")]


def _parity_regression(base: pd.Series, run: pd.Series) -> list[Finding]:
    if base["parity_status"] != "pass" or run["status"] != "ok" or run["parity_status"] in ("pass", "fail"):
        return []
    detail = f" ({run['parity_detail']})" if isinstance(run["parity_detail"], str) else ""
    return [Finding("fail", run["point_id"], "parity", f"parity pass → {run['parity_status']}{detail}")]


def _judge_metric(point: str, old, new, rule: Rule) -> Finding | None:
    if rule.samples:
        return _judge_sample_metric(point, old, new, rule)
    if pd.isna(new):
        if pd.isna(old):
            return None  # measured in neither run (null: the measurement does not apply to this point)
        # a NaN (or a value that was measured and now is not) is never better: judged by the rule's action
        return Finding(rule.action, point, rule.metric,
                       f"{rule.metric}: {_fmt(rule.metric, old)} → NaN (not a number, or no longer measured)")
    if pd.isna(old):
        return None
    delta = float(new) - float(old)
    if abs(delta) <= rule.abs_threshold:
        return None
    worse = delta if rule.direction == "lower" else -delta  # > 0: the change went the worse way
    # from 0 any change is infinitely large, in the direction it went: an improvement from 0 is not a failure
    rel = worse / abs(old) if old else math.copysign(math.inf, worse)
    text = (f"{rule.metric}: {_fmt(rule.metric, old)} → {_fmt(rule.metric, new)} "
            f"({units.change(old, new)}, {'+' if delta > 0 else ''}{_fmt(rule.metric, delta)})")
    if worse > 0 and rel > rule.threshold:
        return Finding(rule.action, point, rule.metric, f"{text}; rule: {rule.direction} is better, "
                                                        f"at most {rule.threshold * 100:+.1f}% the other way")
    if worse < 0 and rule.improvement and -rel >= rule.improvement:
        return Finding("improvement", point, rule.metric, text)
    return None


def _judge_sample_metric(point: str, old, new, rule: Rule) -> Finding | None:
    old_n, new_n = _count(old), _count(new)
    if old_n == 0:
        return None  # nothing to compare against
    if new_n == 0:
        return Finding(rule.action, point, rule.metric, f"{rule.metric}: {old_n} samples → none")
    bad = int((~np.isfinite(np.asarray(new, dtype=float))).sum())
    if bad:  # a NaN compares false with everything: left in, a broken measurement would pass
        return Finding(rule.action, point, rule.metric,
                       f"{rule.metric}: {bad} of {new_n} samples are NaN or infinite (a broken measurement)")
    if not np.isfinite(np.asarray(old, dtype=float)).all():
        return Finding("warn", point, rule.metric,
                       f"{rule.metric}: the baseline's samples hold NaN or infinity; not judged — refresh the baseline")
    verdict = judge_samples(old, new, rule)
    text = (f"{rule.metric}: median {_fmt(rule.metric, pd.Series(old).median())} → "
            f"{_fmt(rule.metric, pd.Series(new).median())} (×{verdict.ratio:.3f}; {verdict.evidence})")
    if verdict.worse:
        action = rule.action if verdict.conclusive else "warn"  # noise cannot be told apart: listed, not failed
        return Finding(action, point, rule.metric, f"{text}; rule: at most ×{1 + rule.threshold:.2f}")
    if verdict.better:
        return Finding("improvement", point, rule.metric, text)
    return None


def _count(samples) -> int:
    return 0 if samples is None or (isinstance(samples, float) and math.isnan(samples)) else len(samples)


def _fmt(metric: str, value) -> str:
    if metric.endswith("_bytes"):
        return units.human_bytes(float(value))
    if metric.endswith("_s"):
        return units.ms(float(value))
    return units.sig(float(value))


def render(result: GateResult, baseline_label: str, run_label: str) -> str:
    fails, warns = result.of("fail"), result.of("warn")
    verdict = f"FAIL: {len(fails)} regression(s)" if fails else "PASS"
    lines = [f"gate {verdict} — {result.points_checked} point(s) of {run_label} checked against {baseline_label}"]
    sections = (("Regressions", fails), ("Warnings", warns),
                ("Improvements (refresh the baseline on purpose: --update-baseline)", result.of("improvement")),
                ("New points (not gated on metrics; added by --update-baseline)", result.of("new")))
    for title, findings in sections:
        if findings:
            lines += ["", f"{title}:"] + [f"  {f.kind.upper():<11} {f.point}  {f.message}" for f in findings]
    return "\n".join(lines)
