"""The fault matrix, in one place (docs/sweeps.md lists it): for each fault, the row, the exit status and the message
a user gets, and that no finished point is lost.

| fault                                   | outcome                                                              |
|-----------------------------------------|----------------------------------------------------------------------|
| a rank raises (crash)                   | `error`, the rank's message; the sweep goes on; exit 1               |
| a rank is killed (kill -9)              | `error`, the launcher's exit and the signal; the sweep goes on       |
| a rank runs out of memory               | `oom`; the longer lengths of its configuration `skipped`             |
| a rank hangs                            | `timeout` after the point's own timeout; the sweep goes on           |
| the sweep is killed (kill -9, Ctrl-C)   | no rank left running; `--resume` runs only the rest                  |
| the disk fills up                       | exit 2 naming the point and the error; rows before it intact         |
| a damaged runs.parquet                  | report names it and reads the journal; `--resume` sets it aside      |
| two writers of one run                  | the second refused (exit 2) naming the first's process; or --wait    |
| a bad suite / a bad config.json         | exit 2 naming the field or the file; nothing launched                |
| gate: a baseline of another suite/schema | exit 2 naming what differs                                          |

Faults of a rank come from the suite's `[faults]` table, which only `--allow-faults` honours. The Ctrl-C case is opt-in
(`-m heavy`, run by .ci/run); the rest run in the default test command. No test asserts a timing.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cpbench.cli import main
from cpbench.report.runs import lock, store
from tests.report_fixtures import make_run, write_run

ROOT = Path(__file__).parents[2]
RANK_FAULTS = """
name = "faults"
model = "tiny-qwen3"
seq_lens = [64, 128, 256]
cp_sizes = [2]
attn_implementations = ["sdpa"]
cp_styles = ["cp_ulysses", "cp_ring"]
warmup_steps = 1
measured_steps = 1
parity = "off"
timeout_s = 120

[faults]
"tiny-qwen3/s64/cp2/sdpa/cp_ulysses*" = "crash"
"tiny-qwen3/s64/cp2/sdpa/cp_ring*" = "kill"
"tiny-qwen3/s128/cp2/sdpa/cp_ulysses*" = "oom"
"tiny-qwen3/s128/cp2/sdpa/cp_ring*" = { fault = "hang", timeout_s = 3 }
"""
CHEAP = """
name = "cheap"
model = "tiny-qwen3"
seq_lens = [32, 64]
cp_sizes = [1]
attn_implementations = ["sdpa"]
warmup_steps = 1
measured_steps = 1
parity = "off"
timeout_s = 120
"""


# Four points in two launches (one rank, then three points on two ranks): a signal sent once the first row is written
# lands in the second launch's seconds of start-up and three points (the second of CHEAP's two points of one launch
# can finish within the poll's 0.2 s).
TWO_LAUNCHES = CHEAP.replace("seq_lens = [32, 64]", "seq_lens = [32]").replace(
    "cp_sizes = [1]", 'cp_sizes = [1, 2]\ncp_styles = ["cp_ulysses", "cp_ring", "cp_ring_zigzag"]')


def _suite(tmp: Path, text: str, name: str = "suite.toml") -> Path:
    path = tmp / name
    path.write_text(text)
    return path


def _cli(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, capsys.readouterr().err


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    rc = main(["sweep", str(_suite(tmp, RANK_FAULTS)), "--out", str(tmp), "--run-name", "r", "--allow-faults",
               "--no-progress"])
    return rc, store.read_run(tmp / "faults" / "r").set_index("point_id"), tmp / "faults" / "r"


def _row(df, seq: int, style: str):
    return df.loc[f"tiny-qwen3/s{seq}/cp2/sdpa/{style}"]


def test_every_fault_of_a_rank_is_a_row_and_the_sweep_goes_on(faulty):
    rc, df, run_dir = faulty
    assert rc == 1 and len(df) == 6  # an error or a timeout makes the exit status 1; every point has its row
    crash = _row(df, 64, "cp_ulysses")
    assert crash["status"] == "error" and crash["status_detail"].startswith("rank 1: RuntimeError: injected crash")
    killed = _row(df, 64, "cp_ring")  # no record from the killed rank: it leads, and the launcher's log says how
    assert killed["status"] == "error" and killed["status_detail"].startswith("rank 1 died without a record")
    assert "exited with code" in killed["status_detail"] and "SIGKILL" in killed["status_detail"]
    oom = _row(df, 128, "cp_ulysses")
    assert oom["status"] == "oom" and "OutOfMemoryError" in oom["status_detail"]
    skipped = _row(df, 256, "cp_ulysses")  # a longer length of a configuration that ran out of memory
    assert skipped["status"] == "skipped" and "seq_len=128" in skipped["status_detail"]
    hang = _row(df, 128, "cp_ring")
    assert hang["status"] == "timeout" and "3s" in hang["status_detail"]  # its own timeout, not the suite's 120 s
    assert _row(df, 256, "cp_ring")["status"] == "ok"  # the last point, in a fresh launch
    assert not _orphans(run_dir)


def _orphans(run_dir: Path) -> list[int]:
    """Processes of this run still alive (a dead launch, a killed sweep, must leave none)."""
    alive = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if str(run_dir) in (entry / "cmdline").read_text():
                alive.append(int(entry.name))
        except OSError:
            continue
    return [p for p in alive if p != os.getpid()]


def _start(suite: Path, out: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "cpbench", "sweep", str(suite), "--out", str(out), "--run-name", "r", "--no-progress"]
    # Ctrl-C reaches a sweep in a terminal's foreground, where SIGINT has its default action. A test run in the
    # background (`cmd &`, nohup) inherits SIGINT ignored, and Python then keeps ignoring it: the sweep would run on.
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _first_row(out: Path, proc: subprocess.Popen, name: str = "cheap") -> Path:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and not (out / name / "r" / store.RUNS_FILE).exists():
        time.sleep(0.2)
    return out / name / "r"


@pytest.mark.parametrize("how", [signal.SIGKILL, pytest.param(signal.SIGINT, marks=pytest.mark.heavy)])
def test_a_killed_sweep_leaves_no_rank_running_and_resumes_without_losing_or_repeating_points(tmp_path, how):
    """kill -9 gives the sweep no chance to clean up: its launch dies with it (guard.py); Ctrl-C unwinds."""
    suite = _suite(tmp_path, TWO_LAUNCHES)
    proc = _start(suite, tmp_path)
    run_dir = _first_row(tmp_path, proc)
    proc.send_signal(how)
    proc.wait(timeout=60)
    before = store.read_run(run_dir).set_index("point_id")
    assert 1 <= len(before) < 4, "the sweep must be stopped mid-way"
    deadline = time.monotonic() + 30  # the launcher and its ranks get SIGKILL as their parent dies
    while _orphans(run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _orphans(run_dir)
    assert main(["sweep", str(suite), "--out", str(tmp_path), "--run-name", "r", "--resume", "--no-progress"]) == 0
    after = store.read_run(run_dir).set_index("point_id")
    assert len(after) == 4 and after.index.is_unique and set(after["status"]) == {"ok"}
    for pid, r in before.iterrows():  # finished points are kept as they were, not rerun
        assert after.loc[pid, "timestamp"] == r["timestamp"] and after.loc[pid, "wall_s"] == r["wall_s"]


def test_a_full_disk_stops_the_sweep_then_a_damaged_table_is_read_from_the_journal_and_resumed(
        tmp_path, monkeypatch, capsys):
    suite, run_dir = _suite(tmp_path, CHEAP), tmp_path / "cheap" / "r"
    writes, real = [], store._atomic

    def full_after_one_point(path, table):  # the first point's journal file and table fit; nothing after
        writes.append(path)
        if len(writes) > 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, table)

    monkeypatch.setattr(store, "_atomic", full_after_one_point)
    rc, err = _cli(capsys, "sweep", str(suite), "--out", str(tmp_path), "--run-name", "r", "--no-progress")
    assert rc == 2 and "No space left on device" in err and "1 point(s) written before are intact" in err
    assert "--resume" in err and "tiny-qwen3/s64/cp1/sdpa/none" in err  # the point it could not write, what to do
    first = store.read_run(run_dir)
    assert list(first["point_id"]) == ["tiny-qwen3/s32/cp1/sdpa/none"]
    monkeypatch.setattr(store, "_atomic", real)
    assert not list(run_dir.glob(".*.tmp*")) and not list((run_dir / "points").glob(".*.tmp*"))

    table = run_dir / store.RUNS_FILE  # then the table is torn (a copy cut short, a bad block)
    table.write_bytes(table.read_bytes()[: table.stat().st_size // 2])
    rc, err = _cli(capsys, "report", str(run_dir), "--out", str(tmp_path / "report"))
    assert rc == 0 and f"{table} is damaged" in err and "1 point(s) recovered" in err
    assert "Read with notes" in (tmp_path / "report" / "report.md").read_text()

    rc, err = _cli(capsys, "sweep", str(suite), "--out", str(tmp_path), "--run-name", "r", "--resume",
                   "--no-progress")
    assert rc == 0 and "moved to" in err
    after = store.read_run(run_dir).set_index("point_id")
    assert len(after) == 2 and set(after["status"]) == {"ok"}
    assert after.loc[first["point_id"][0], "timestamp"] == first["timestamp"][0]  # recovered, not rerun
    (aside,) = run_dir.glob("runs.parquet.damaged-*")  # set aside, never deleted
    assert aside.stat().st_size > 0


def test_a_second_writer_is_refused_naming_the_first_or_waits_for_it(tmp_path, capsys):
    suite, run_dir = _suite(tmp_path, CHEAP), tmp_path / "cheap" / "r"
    with lock.writer(run_dir, command="cpbench sweep (the first)"):
        for argv in (["sweep", str(suite)], ["sweep", str(suite), "--resume"], ["estimate", str(suite)]):
            rc, err = _cli(capsys, *argv, "--out", str(tmp_path), "--run-name", "r", *(
                ["--no-progress"] if argv[0] == "sweep" else []))
            assert rc == 2 and f"process {os.getpid()}" in err and "cpbench sweep (the first)" in err, err
            assert "--wait" in err
    assert not (run_dir / "records").exists()  # refused before anything was launched
    # --wait: queue behind the writer, then go on with what it left (here: it finished every point)
    ids = [f"tiny-qwen3/s{s}/cp1/sdpa/none" for s in (32, 64)]
    store.append_rows(run_dir, [{"point_id": i, "status": "ok", "suite": "cheap"} for i in ids])
    held = threading.Event()

    def first_writer():
        with lock.writer(run_dir):
            held.set()
            time.sleep(1.0)

    thread = threading.Thread(target=first_writer)
    thread.start()
    held.wait()
    rc, err = _cli(capsys, "sweep", str(suite), "--out", str(tmp_path), "--run-name", "r", "--resume", "--wait",
                   "--no-progress")
    thread.join()
    assert rc == 0 and "waiting for process" in err
    assert sorted(store.finished_point_ids(run_dir)) == sorted(ids) and not (run_dir / "records").exists()


@pytest.mark.parametrize("edit,needle", [
    (("tiny-qwen3", "tiny-qwen9"), "`model = 'tiny-qwen9'`"),
    (('"sdpa"', '"sdpaa"'), "attn_implementations"),
    (("cp_sizes = [1]", "cp_sizes = [1, 3]"), "cp_sizes"),
    (("parity = \"off\"", "parity = \"off\"\ncp_styles2 = 1"), "unknown suite field `cp_styles2`: Did you mean `cp_styles`?"),
])
def test_a_bad_suite_is_refused_before_any_launch(tmp_path, capsys, edit, needle):
    rc, err = _cli(capsys, "sweep", str(_suite(tmp_path, CHEAP.replace(*edit))), "--out", str(tmp_path / "out"))
    assert rc == 2 and needle in err
    assert not (tmp_path / "out").exists()


def test_a_bad_config_json_is_refused_naming_the_file(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama", "hidden_size": ')  # cut short
    text = CHEAP.replace('model = "tiny-qwen3"', f'model = "{model}"')
    rc, err = _cli(capsys, "sweep", str(_suite(tmp_path, text)), "--out", str(tmp_path / "out"))
    assert rc == 2 and f"{model / 'config.json'} is not valid JSON" in err and not (tmp_path / "out").exists()
    rc, err = _cli(capsys, "estimate", "--model", str(model), "--seq", "128", "--out", str(tmp_path / "out"))
    assert rc == 2 and "is not valid JSON" in err and not (tmp_path / "out").exists()


def test_gate_refuses_a_baseline_of_another_suite_or_schema(tmp_path, capsys):
    run = write_run(make_run(seed=1), tmp_path / "run")
    other_suite = make_run(seed=0).assign(suite="another-suite")
    base = write_run(other_suite, tmp_path / "base") / store.RUNS_FILE
    rc, err = _cli(capsys, "gate", str(run), "--baseline", str(base))
    assert rc == 2 and "suite: baseline ['another-suite']" in err and "--allow-suite-mismatch" in err
    old = ROOT / "results" / "peers-cpu" / "cpu-2core" / store.RUNS_FILE  # a version-5 file, committed
    rc, err = _cli(capsys, "gate", str(run), "--baseline", str(old))
    assert rc == 2 and "schema version 5" in err
