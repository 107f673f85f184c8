"""benchmarks/: every suite point is collected; the ones it cannot time are skipped with a reason, not dropped."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from cpbench.harness.suite.spec import load_suite
from cpbench.harness.suite.suites import resolve_suite

ROOT = Path(__file__).parents[2]


def _conftest():
    spec = importlib.util.spec_from_file_location("bench_conftest", ROOT / "benchmarks" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_skip_reasons_follow_the_sweeps_rules():
    why = _conftest().why_not_benchmarked
    assert all(why(p) is None for p in resolve_suite(None).points())  # the default suite is all benchmarked
    gpu = resolve_suite(ROOT / "suites" / "qwen3-0.6b-long.toml").points()[0]
    assert "device='cuda'" in why(gpu)
    big = load_suite("t.toml", text='name="t"\nmodel="tiny-qwen3"\nseq_lens=[64]\ncp_sizes=[2]\nworld_size=4\n')
    assert "world_size=4" in why(big.points()[0])
    from dataclasses import replace

    unserved = replace(resolve_suite(None).points()[-1], attn_implementation="flex_attention", cp_style="cp_ring")
    assert "cp_ring serves" in why(unserved)  # the sweep's own skip rule


def test_points_that_cannot_be_benchmarked_are_reported_as_skipped(tmp_path):
    suite = tmp_path / "s.toml"
    suite.write_text('name="t"\nmodel="tiny-qwen3"\nseq_lens=[64, 128]\ncp_sizes=[1, 2]\nworld_size=4\n')
    proc = subprocess.run([sys.executable, "-m", "pytest", "benchmarks", "-q", "-rs", "-p", "no:cacheprovider",
                           "--cpbench-suite", str(suite)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "4 skipped" in proc.stdout and "world_size=4" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
