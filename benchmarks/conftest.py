"""pytest-benchmark entry to cpbench points: `pytest benchmarks/ [--cpbench-suite SUITE] --benchmark-autosave`.

Every point of the suite is collected. Those this runner cannot time are skipped with the reason, never
dropped: CUDA points (it drives CPU gloo ranks), points of more than 2 ranks (rank 0 in-process plus one
spawned peer), and whatever the sweep itself would skip (`cpbench.harness.run.skips.SkipRules`).
"""

from __future__ import annotations

import pytest

MAX_WORLD = 2


def why_not_benchmarked(point) -> str | None:
    from cpbench.harness.run.skips import SkipRules

    if point.device != "cpu":
        return f"device={point.device!r}: these benchmarks run CPU points only; use `cpbench sweep` on a GPU machine"
    if point.world_size > MAX_WORLD:
        return (f"world_size={point.world_size}: these benchmarks run at most {MAX_WORLD} ranks; "
                "use `cpbench sweep` for larger worlds")
    return SkipRules().why_skip(point)


def pytest_addoption(parser):
    parser.addoption("--cpbench-suite", default="default",
                     help="suite whose points become benchmarks (default: the embedded CPU suite)")


def pytest_generate_tests(metafunc):
    if "cpbench_point" in metafunc.fixturenames:
        from cpbench.harness.suite.suites import resolve_suite

        suite = resolve_suite(metafunc.config.getoption("--cpbench-suite"))
        params = []
        for p in suite.points():
            why = why_not_benchmarked(p)
            params.append(pytest.param(p, id=p.point_id, marks=[pytest.mark.skip(reason=why)] if why else []))
        metafunc.parametrize("cpbench_point", params)
