import pytest
from hypothesis import HealthCheck, settings

from tests.spawn import run_ranks

# Property-based tests (tests/unit/test_report_properties.py): a few examples each in the default test command, many
# in CI (`pytest --hypothesis-profile ci`, .ci/run: 30 each. 60 took 12:24 of a .ci/run that landed at 89:52 of its
# 90 minutes). No deadline: a drawn run of a hundred points renders six figures.
_SLOW_DRAWS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]
settings.register_profile("quick", max_examples=3, deadline=None, suppress_health_check=_SLOW_DRAWS)
settings.register_profile("ci", max_examples=30, deadline=None, suppress_health_check=_SLOW_DRAWS)
settings.load_profile("quick")


@pytest.fixture
def spawn():
    """`spawn(fn, world_size, *args, timeout=...)` -> per-rank results (see tests/spawn.py)."""
    return run_ranks
