"""The multi-rank test spawner surfaces a child's traceback and kills hung ranks."""

import time

import pytest

from tests.spawn import RankFailure, run_ranks


def _rank_id():
    import os

    return int(os.environ["RANK"]) * 10 + int(os.environ["WORLD_SIZE"])


def _fails_on_rank_1():
    import os

    if os.environ["RANK"] == "1":
        raise KeyError("deliberate failure on rank 1")
    return "fine"


def _rank_1_fails_while_rank_0_waits_for_it():
    import os

    import torch.distributed as dist

    if os.environ["RANK"] == "1":
        raise KeyError("deliberate failure on rank 1")
    dist.init_process_group("gloo")  # waits for rank 1, which never comes
    return "unreachable"


def _hangs_on_rank_0():
    import os

    if os.environ["RANK"] == "0":
        time.sleep(600)
    return "done"


def test_results_come_back_in_rank_order():
    assert run_ranks(_rank_id, 2) == [2, 12]


def test_child_traceback_is_raised():
    with pytest.raises(RankFailure, match=r"(?s)rank 1 raised:.*KeyError: 'deliberate failure on rank 1'"):
        run_ranks(_fails_on_rank_1, 2)


def test_hung_rank_is_killed_and_reported():
    # One rank, so the message does not depend on how fast a second rank starts on a loaded machine (the mixed
    # case, one rank failing while its peer waits, is the next test).
    with pytest.raises(RankFailure, match=r"ranks \[0\] still running after 5s and were killed"):
        run_ranks(_hangs_on_rank_0, 1, timeout=5)


@pytest.mark.timeout(120)  # well below run_ranks' own timeout: the blocked peer must not hold the test that long
def test_a_failed_rank_stops_its_blocked_peer_without_waiting_for_the_timeout():
    with pytest.raises(RankFailure, match=r"(?s)rank 1 raised:.*deliberate failure.*ranks \[0\] were stopped"):
        run_ranks(_rank_1_fails_while_rank_0_waits_for_it, 2, timeout=600)

