"""Is a set of step-time samples slower than another, beyond noise? Mann–Whitney U or a bootstrap CI on the
ratio of medians, combined with the rule's threshold on that ratio: a change must be both real (significant)
and large (beyond the threshold) to count."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.stats import mannwhitneyu

from .gate_rules import Rule


@dataclass(frozen=True)
class SampleVerdict:
    ratio: float          # median(new) / median(baseline)
    worse: bool
    better: bool
    evidence: str         # how it was judged, for the message
    conclusive: bool = True  # False: too few samples for the test to reach alpha (judged on the ratio alone)


def judge_samples(baseline, new, rule: Rule) -> SampleVerdict:
    base, cand = np.asarray(baseline, dtype=float), np.asarray(new, dtype=float)
    ratio = float(np.median(cand) / np.median(base))
    # the ratio expressed so that > 1 is worse, whatever the direction
    worse_ratio = ratio if rule.direction == "lower" else 1.0 / ratio
    large_worse = worse_ratio > 1.0 + rule.threshold
    large_better = rule.improvement > 0 and worse_ratio < 1.0 / (1.0 + rule.improvement)
    test = rule.test
    if test == "median":
        return SampleVerdict(ratio, large_worse, large_better, "ratio of medians only")
    if _min_p(len(base), len(cand)) >= rule.alpha:
        # an improvement that cannot be established is not reported; a slow-down is (as a warning)
        note = f"inconclusive: {len(base)} vs {len(cand)} samples cannot reach p < {rule.alpha}"
        return SampleVerdict(ratio, large_worse, False, note, conclusive=False)
    if test == "mannwhitney":
        return _mannwhitney(base, cand, rule, ratio, large_worse, large_better)
    return _bootstrap(base, cand, rule, ratio, large_worse, large_better)


def _min_p(n: int, m: int) -> float:
    """The smallest one-sided p-value an exact Mann–Whitney test can give with these sample sizes."""
    return 1.0 / math.comb(n + m, n) if n and m else 1.0


def _mannwhitney(base, cand, rule: Rule, ratio, large_worse, large_better) -> SampleVerdict:
    slower, faster = ("greater", "less") if rule.direction == "lower" else ("less", "greater")
    p_worse = float(mannwhitneyu(cand, base, alternative=slower).pvalue)
    p_better = float(mannwhitneyu(cand, base, alternative=faster).pvalue)
    worse = large_worse and p_worse < rule.alpha
    better = large_better and p_better < rule.alpha
    p = p_better if better else p_worse
    side = "better" if better else "worse"
    return SampleVerdict(ratio, worse, better, f"Mann–Whitney U one-sided ({side}) p={p:.2g}, alpha {rule.alpha}")


def _bootstrap(base, cand, rule: Rule, ratio, large_worse, large_better) -> SampleVerdict:
    rng = np.random.default_rng(0)  # a fixed seed: the same inputs always get the same verdict
    n = rule.bootstrap_resamples
    base_med = np.median(rng.choice(base, size=(n, len(base))), axis=1)
    cand_med = np.median(rng.choice(cand, size=(n, len(cand))), axis=1)
    ratios = cand_med / base_med if rule.direction == "lower" else base_med / cand_med
    low, high = np.quantile(ratios, [rule.alpha, 1.0 - rule.alpha])
    worse = large_worse and low > 1.0
    better = large_better and high < 1.0
    level = f"{(1 - 2 * rule.alpha) * 100:g}%"
    return SampleVerdict(ratio, worse, better, f"bootstrap {level} CI of the worse-way ratio [{low:.3f}, {high:.3f}]")
