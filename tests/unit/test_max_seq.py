"""The --max-seq search as a chain of lengths, against a known threshold (no projection involved)."""

from __future__ import annotations

import pytest

from cpbench.harness.project.estimate import search
from cpbench.harness.suite.spec import load_suite

TEMPLATE = load_suite("t.toml", text='model = "tiny-qwen3"\nseq_lens = [1000]\n').points()[0]


def run(threshold: int, g: int, limit: int, status_above: str = "oom") -> tuple[int | None, list[int]]:
    chain, tried, row = search(TEMPLATE, g, limit), [], None
    try:
        while True:
            point = chain.send(row) if row is not None else next(chain)
            tried.append(point.seq_len)
            row = {"status": "ok" if point.seq_len <= threshold else status_above}
    except StopIteration as stop:
        return stop.value, tried


@pytest.mark.parametrize("threshold", [1024, 5000, 8191, 8192, 70000, 131071])
def test_the_largest_multiple_of_the_granularity_under_the_threshold(threshold):
    largest, tried = run(threshold, g=1024, limit=131072)
    assert largest == min(threshold, 131072) // 1024 * 1024
    assert tried[0] == 1024  # the suite's 1000 rounded up to the granularity
    assert len(tried) == len(set(tried)) <= 2 * 8 + 1  # doubling, then bisection: logarithmic


def test_nothing_fits_and_the_limit_caps_the_search():
    assert run(threshold=100, g=1024, limit=131072) == (None, [1024])
    largest, tried = run(threshold=10**9, g=1024, limit=40960)
    assert largest == 40960 and tried[-1] == 40960


def test_a_skipped_or_failed_projection_ends_the_search():
    assert run(threshold=3000, g=1024, limit=131072, status_above="error")[0] == 2048
