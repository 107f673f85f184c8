import pytest

from tests.spawn import run_ranks


@pytest.fixture
def spawn():
    """`spawn(fn, world_size, *args, timeout=...)` -> per-rank results (see tests/spawn.py)."""
    return run_ranks
