"""The multi-rank test spawner surfaces a child's traceback and kills hung ranks; a rank killed by a signal leaves
its Python stacks in the report and its spawn is run once more (twice is a failure)."""

import time

import pytest

from tests import spawn
from tests.spawn import RankFailure, run_ranks

SHORT_GRACE_S = 2.0  # the peers' grace in the tests that wait it out (the parent's _wait reads it)


@pytest.fixture
def short_grace(monkeypatch):
    monkeypatch.setattr(spawn, "PEER_GRACE_S", SHORT_GRACE_S)


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


def _segfaults_on_rank_1_in_a_named_function():
    import faulthandler
    import os

    if os.environ["RANK"] == "1":
        faulthandler._sigsegv()  # a real SIGSEGV, as a crashing kernel raises it
    return "fine"


def _segfaults_on_rank_1_the_first_time(marker: str):
    import faulthandler
    import os
    from pathlib import Path

    if os.environ["RANK"] == "1" and not Path(marker).exists():
        Path(marker).touch()
        faulthandler._sigsegv()
    return os.environ["RANK"]


def _rank_1_segfaults_while_rank_0_waits_for_it():
    import faulthandler
    import os

    import torch.distributed as dist

    if os.environ["RANK"] == "1":
        faulthandler._sigsegv()
    dist.init_process_group("gloo")  # waits for rank 1, which never comes
    return "unreachable"


def _rank_1_segfaults_in_a_collective(marker: str):
    """Rank 1 dies from a signal inside an all-reduce (the first time only where `marker` is given): rank 0's gloo
    raises that its peer closed the connection, as in CI's one such failure."""
    import faulthandler
    import os
    from pathlib import Path

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if os.environ["RANK"] == "1" and not (marker and Path(marker).exists()):
        if marker:
            Path(marker).touch()
        faulthandler._sigsegv()
    total = torch.ones(1)
    dist.all_reduce(total)
    return int(total.item())


def _rank_0_raises_while_rank_1_segfaults():
    import faulthandler
    import os

    if os.environ["RANK"] == "1":
        faulthandler._sigsegv()
    raise KeyError("rank 0's own failure")


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


def test_a_rank_killed_by_a_signal_every_time_reports_its_exit_code_and_python_stack_from_both_tries():
    # the first try's warning is caught here: in the run's summary it would read as a crash of the code under test
    with pytest.raises(RankFailure, match=r"(?s)rank 1 exited with code -11 and no result; its stacks when it died:"
                                          r".*Segmentation fault.*_segfaults_on_rank_1_in_a_named_function"
                                          r".*on the second try; the first said:.*rank 1 exited with code -11"), \
            pytest.warns(UserWarning, match="a rank was killed by a signal; once more"):
        run_ranks(_segfaults_on_rank_1_in_a_named_function, 2)


def test_a_rank_killed_by_a_signal_once_is_run_again_and_the_first_report_printed_and_warned(tmp_path, capsys):
    with pytest.warns(UserWarning, match=r"(?s)a rank was killed by a signal; once more.*exited with code -11"):
        assert run_ranks(_segfaults_on_rank_1_the_first_time, 2, str(tmp_path / "crashed-once")) == ["0", "1"]
    err = capsys.readouterr().err
    assert "a rank was killed by a signal; once more" in err and "_segfaults_on_rank_1_the_first_time" in err


def test_a_crash_fails_at_once_where_retries_are_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv("CPBENCH_SPAWN_RETRY", "0")
    with pytest.raises(RankFailure, match=r"rank 1 exited with code -11") as failure:
        run_ranks(_segfaults_on_rank_1_the_first_time, 2, str(tmp_path / "crashed-once"))
    assert "second try" not in str(failure.value)


def _rank_0_crashes_after_its_result_while_rank_1_works():
    import os
    import threading
    import time as clock

    if os.environ["RANK"] == "0":  # a thread left running faults as the interpreter shuts down, after the result
        threading.Thread(target=lambda: (clock.sleep(1.0), os.kill(os.getpid(), 11))).start()
        return "r0"
    clock.sleep(SHORT_GRACE_S + 3)  # longer than the peers' grace: a crash after a result must not cut it short
    return "r1"


@pytest.mark.timeout(120)
def test_a_rank_that_crashes_after_writing_its_result_does_not_stop_its_peers(short_grace):
    assert run_ranks(_rank_0_crashes_after_its_result_while_rank_1_works, 2) == ["r0", "r1"]


def test_a_rank_that_raises_is_not_run_again():
    with pytest.raises(RankFailure) as failure:
        run_ranks(_fails_on_rank_1, 2)
    assert not failure.value.signalled and "second try" not in str(failure.value)


def test_hung_rank_is_killed_and_reported():
    # One rank, so the message does not depend on how fast a second rank starts on a loaded machine (the mixed
    # case, one rank failing while its peer waits, is the next test).
    with pytest.raises(RankFailure, match=r"ranks \[0\] still running after 5s and were killed"):
        run_ranks(_hangs_on_rank_0, 1, timeout=5)


@pytest.mark.timeout(120)  # well below run_ranks' own timeout: the blocked peer must not hold the test that long
def test_a_failed_rank_stops_its_blocked_peer_without_waiting_for_the_timeout(short_grace):
    with pytest.raises(RankFailure, match=r"(?s)rank 1 raised:.*deliberate failure.*ranks \[0\] were stopped") as failure:
        run_ranks(_rank_1_fails_while_rank_0_waits_for_it, 2, timeout=600)
    # the peer we killed for blocking (SIGKILL) is no crash of its own: no second try
    assert not failure.value.signalled and "second try" not in str(failure.value)



@pytest.mark.timeout(120)
def test_a_rank_killed_by_a_signal_stops_its_blocked_peer_without_waiting_for_the_timeout(monkeypatch, short_grace):
    monkeypatch.setenv("CPBENCH_SPAWN_RETRY", "0")  # one try: the grace period is under test, not the retry
    with pytest.raises(RankFailure, match=r"(?s)ranks \[0\] were stopped.*rank 1 exited with code -11"):
        run_ranks(_rank_1_segfaults_while_rank_0_waits_for_it, 2, timeout=600)


@pytest.mark.timeout(120)
def test_a_crash_in_a_collective_is_run_again_though_its_peer_raised_that_the_connection_closed(tmp_path):
    # the peer's error is the crash's echo (gloo: "Connection closed by peer"), not an error of its own
    with pytest.warns(UserWarning, match=r"(?s)a rank was killed by a signal; once more.*rank 0 raised:.*"
                                         r"Connection (closed|reset) by peer.*exited with code -11"):
        assert run_ranks(_rank_1_segfaults_in_a_collective, 2, str(tmp_path / "crashed-once")) == [2, 2]


@pytest.mark.timeout(120)
def test_the_crash_report_comes_last_with_its_stacks_and_without_the_extension_modules_line(monkeypatch, short_grace):
    monkeypatch.setenv("CPBENCH_SPAWN_RETRY", "0")
    with pytest.raises(RankFailure) as failure:
        run_ranks(_rank_1_segfaults_in_a_collective, 2, "")
    text = str(failure.value)
    peer = max(text.find("rank 0 raised"), text.find("ranks [0] were stopped"))
    assert 0 <= peer < text.index("rank 1 exited with code -11"), text
    assert "_rank_1_segfaults_in_a_collective" in text[text.index("rank 1 exited"):], text  # its Python stack
    assert "Extension modules" not in text and failure.value.signalled, text


def test_a_crash_beside_a_ranks_own_error_is_not_run_again():
    # the crash may follow from that error: a retry would hide it
    with pytest.raises(RankFailure, match=r"(?s)rank 0 raised:.*rank 0's own failure.*rank 1 exited with code -11") \
            as failure:
        run_ranks(_rank_0_raises_while_rank_1_segfaults, 2)
    assert not failure.value.signalled and "second try" not in str(failure.value)
