"""pytest-benchmark entry to cpbench points: `pytest benchmarks/ [--cpbench-suite SUITE] --benchmark-autosave`."""

from __future__ import annotations


def pytest_addoption(parser):
    parser.addoption("--cpbench-suite", default="default",
                     help="suite whose points become benchmarks (default: the embedded CPU suite)")


def pytest_generate_tests(metafunc):
    if "cpbench_point" in metafunc.fixturenames:
        from cpbench.harness.suites import resolve_suite

        suite = resolve_suite(metafunc.config.getoption("--cpbench-suite"))
        points = [p for p in suite.points() if p.device == "cpu" and p.world_size <= 2]
        metafunc.parametrize("cpbench_point", points, ids=[p.point_id for p in points])
