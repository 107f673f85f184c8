"""How a point that some ranks failed is recorded: the first failure leads, out-of-memory wins the status.

The records are what `worker._error_record` writes when a rank raises; the e2e sweep test covers a real
mid-forward crash on one rank (tests/e2e/test_sweep.py)."""

from __future__ import annotations

import torch

from cpbench.harness.run.records import failure
from cpbench.harness.run.worker import _error_record


def _record(rank: int, exc: BaseException, t: float) -> dict:
    try:
        raise exc
    except BaseException as e:  # noqa: BLE001 - the worker records whatever a rank raises
        return {**_error_record(rank, e), "t": t}


def test_the_rank_that_failed_first_leads_even_when_a_lower_rank_also_failed():
    peer = _record(0, RuntimeError("Connection closed by peer"), t=10.5)
    cause = _record(1, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), t=10.0)
    got = failure([peer, cause])
    assert got["status"] == "oom"
    assert got["message"].startswith("rank 1: OutOfMemoryError: CUDA out of memory")
    assert "(failed first); then rank 0: RuntimeError: Connection closed by peer" in got["message"]


def test_one_failed_rank_is_an_error_with_its_message_alone():
    got = failure([_record(3, ValueError("bad shape"), t=1.0)])
    assert got == {"status": "error", "message": "rank 3: ValueError: bad shape"}


def test_an_error_record_keeps_its_traceback_and_time():
    rec = _record(0, KeyError("x"), t=2.0)
    assert rec["status"] == "error" and "KeyError" in rec["traceback"] and rec["t"] == 2.0


def test_a_rank_killed_without_a_record_leads_when_its_peers_only_lost_their_connection():
    peer = _record(0, RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"), t=5.0)
    got = failure([peer], world_size=2)
    assert got["message"].startswith("rank 1 died without a record (killed by a signal or by the OS")
    assert got["message"].endswith("then rank 0: RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error: "
                                   "Connection reset by peer")


def test_a_rank_that_raised_leads_the_peers_the_launcher_stopped():
    cause = _record(1, RuntimeError("injected crash"), t=5.0)
    got = failure([cause], world_size=4)  # ranks 0, 2, 3 were stopped by torchrun before they wrote anything
    assert got["message"].startswith("rank 1: RuntimeError: injected crash (failed first); then rank 0, 2, 3 left no "
                                     "record (stopped by the launcher)")
