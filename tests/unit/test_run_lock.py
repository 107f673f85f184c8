"""One writer per run folder (cpbench.report.runs.lock): a second is refused naming the first, or waits for it; a
writer that died (even by kill -9) holds nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from cpbench.report.runs import lock


def test_a_second_writer_is_refused_with_who_holds_the_run(tmp_path):
    with lock.writer(tmp_path, command="cpbench sweep suite.toml"):
        with pytest.raises(lock.RunLocked) as refused:
            with lock.writer(tmp_path):
                pass
    message = str(refused.value)
    assert f"process {os.getpid()}" in message and "cpbench sweep suite.toml" in message and "--wait" in message
    with lock.writer(tmp_path):  # released: the next writer gets it
        pass
    assert not (tmp_path / lock.OWNER_FILE).exists()


def test_a_waiting_writer_goes_on_when_the_first_is_done(tmp_path):
    order, said = [], []

    def first():
        with lock.writer(tmp_path):
            order.append("first in")
            time.sleep(0.5)
            order.append("first out")

    thread = threading.Thread(target=first)
    thread.start()
    while not order:
        time.sleep(0.01)
    with lock.writer(tmp_path, wait=True, on_wait=said.append):
        order.append("second in")
    thread.join()
    assert order == ["first in", "first out", "second in"] and "waiting for process" in said[0]


def test_a_writer_killed_with_sigkill_leaves_the_run_free(tmp_path):
    code = ("import sys, time; from cpbench.report.runs import lock\n"
            f"with lock.writer({str(tmp_path)!r}):\n    print('held', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    with pytest.raises(lock.RunLocked, match=f"process {proc.pid}"):
        with lock.writer(tmp_path):
            pass
    proc.kill()
    proc.wait()
    with lock.writer(tmp_path):  # the note it left behind is not believed: the lock is free
        assert (tmp_path / lock.OWNER_FILE).exists()
