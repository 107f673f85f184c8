"""`python -m cpbench sweep` end to end on CPU: real torchrun launches of a tiny suite.

One module-scoped sweep covers the normal points (cp 1 and 2, two lengths, packed batches, parity against the
unsharded run) and the failure paths: a point whose last rank crashes mid-forward is `error` with that rank's message (ended by the failure, not
the timeout), a point whose
last rank hangs is `timeout`, and the points after each still run. Faults come from the suite's `[faults]` table, which
only `--allow-faults` honours (see `cpbench.harness.suite.spec.Suite.faults`). No test asserts a timing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cpbench.cli import main
from cpbench.report import schema, store

ROOT = Path(__file__).parents[2]
LONG, SHORT = 1024, 128

SUITE = f"""
name = "e2e"
model = "tiny-qwen3"
seq_lens = [{SHORT}, {LONG}]
cp_sizes = [1, 2]
attn_implementations = ["sdpa"]
cp_styles = ["cp_ulysses", "cp_ring"]
batch_kind = "packed"
warmup_steps = 1
measured_steps = 2
parity = "full"
timeout_s = 120
"""
FAULTS = f"""
[faults]
"tiny-qwen3/s{SHORT}/cp2/sdpa/cp_ulysses/*" = "crash"
"tiny-qwen3/s{SHORT}/cp2/sdpa/cp_ring/*" = {{ fault = "hang", timeout_s = 5 }}
"""


def _suite(tmp_path: Path, text: str, name: str = "suite.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _sweep(*argv: str) -> int:
    return main(["sweep", *argv, "--no-progress"])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    suite = _suite(tmp, SUITE + FAULTS)
    rc = _sweep(str(suite), "--out", str(tmp / "results"), "--allow-faults")
    (run_dir,) = (tmp / "results" / "e2e").glob("2*")
    return {"rc": rc, "df": store.read_run(run_dir).set_index("point_id"), "dir": run_dir, "tmp": tmp}


def _row(df, cp: int, seq: int, style: str):
    return df.loc[f"tiny-qwen3/s{seq}/cp{cp}/sdpa/{style}/b1packed"]


def test_every_point_has_one_row_with_a_status(run):
    df = run["df"]
    assert len(df) == 6 and df.index.is_unique
    assert run["rc"] == 1  # the injected crash is an error: the sweep says so in its exit code
    assert set(df["status"]) == {"ok", "error", "timeout"}


def test_ok_points_have_plausible_memory_time_and_parity(run):
    ok = run["df"][run["df"]["status"] == "ok"]
    assert len(ok) == 4
    for pid, r in ok.iterrows():
        assert r["parity_status"] == "pass", (pid, r["parity_detail"])
        assert r["loss_rel_err"] <= r["loss_rtol"] and r["grad_max_rel_err"] <= r["grad_rtol"]
        assert len(r["peak_bytes_per_rank"]) == r["world_size"] and r["peak_bytes"] == max(r["peak_bytes_per_rank"])
        parts = (r["params_bytes"] + r["grads_bytes"] + r["optimizer_bytes"] + r["activations_bytes"]
                 + r["temporaries_bytes"])
        assert parts == r["peak_bytes"] and r["activations_bytes"] > 0
        assert r["rss_peak_bytes"] > r["peak_bytes"]
        assert len(r["step_times_s"]) == 2 and r["step_time_p10_s"] <= r["step_time_median_s"] <= r["step_time_p90_s"]
        assert r["tokens_per_s"] > 0 and r["flops_per_step"] > 0
        assert r["torch_version"] and r["hardware_id"] and r["timestamp"] and r["schema_version"] == schema.SCHEMA_VERSION


def test_cp2_per_rank_activations_are_well_below_cp1(run):
    df = run["df"]

    def step_memory(row):  # what a step adds at its peak: forward tensors and backward temporaries
        return row["activations_bytes"] + row["temporaries_bytes"]

    cp1 = step_memory(_row(df, 1, LONG, "none"))
    for style in ("cp_ulysses", "cp_ring"):
        assert step_memory(_row(df, 2, LONG, style)) < 0.7 * cp1, style


def test_a_crashing_rank_is_an_error_with_its_message_and_the_sweep_goes_on(run):
    # Rank 1 raises inside its first forward while rank 0 waits in that layer's collectives: the point must end
    # through rank 1's exit (the launcher stops rank 0), not through the point's 120 s timeout.
    r = _row(run["df"], 2, SHORT, "cp_ulysses")
    assert r["status"] == "error"  # the watchdog would have written `timeout`
    assert r["status_detail"].startswith("rank 1: RuntimeError: injected crash"), r["status_detail"]
    assert _row(run["df"], 2, LONG, "cp_ulysses")["status"] == "ok"  # the next point, in a fresh launch


def test_a_hanging_rank_is_a_timeout_and_the_sweep_goes_on(run):
    r = _row(run["df"], 2, SHORT, "cp_ring")
    assert r["status"] == "timeout" and "5s" in r["status_detail"]  # its own timeout, not the suite's 120 s
    assert _row(run["df"], 2, LONG, "cp_ring")["status"] == "ok"


def test_over_the_memory_budget_is_oom_and_longer_lengths_are_skipped(run):
    df = run["df"]
    lo, hi = _row(df, 1, SHORT, "none")["peak_bytes"], _row(df, 1, LONG, "none")["peak_bytes"]
    text = SUITE.replace(f"seq_lens = [{SHORT}, {LONG}]", f"seq_lens = [{SHORT}, {LONG}, {2 * LONG}]")
    text = text.replace("cp_sizes = [1, 2]", "cp_sizes = [1]")
    suite = _suite(run["tmp"], text, "budget.toml")
    out = run["tmp"] / "budget"
    assert _sweep(str(suite), "--out", str(out), "--memory-budget", str((lo + hi) // 2)) == 0
    (run_dir,) = (out / "e2e").glob("2*")
    got = store.read_run(run_dir).set_index("seq_len")
    assert got.loc[SHORT, "status"] == "ok"
    assert got.loc[LONG, "status"] == "oom" and "memory budget" in got.loc[LONG, "status_detail"]
    assert got.loc[2 * LONG, "status"] == "skipped" and f"seq_len={LONG}" in got.loc[2 * LONG, "status_detail"]
    assert (got["memory_budget_bytes"] == (lo + hi) // 2).all()


def test_a_killed_sweep_resumes_without_losing_or_repeating_points(tmp_path):
    text = SUITE.replace("cp_sizes = [1, 2]", "cp_sizes = [1]").replace(
        f"seq_lens = [{SHORT}, {LONG}]", f"seq_lens = [64, {SHORT}, 256]").replace(
        'parity = "full"', 'parity = "off"')  # what is resumed is the points; parity has its own tests
    suite, out = _suite(tmp_path, text), tmp_path / "results"
    cmd = [sys.executable, "-m", "cpbench", "sweep", str(suite), "--out", str(out), "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list(out.glob("e2e/*/runs.parquet")):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)  # a user's Ctrl-C, after the first point's row is written
    proc.wait(timeout=60)
    (run_dir,) = (out / "e2e").glob("2*")
    before = store.read_run(run_dir).set_index("point_id")
    assert 1 <= len(before) < 3, "the sweep must be interrupted mid-way"
    assert _sweep(str(suite), "--out", str(out), "--resume") == 0
    after = store.read_run(run_dir).set_index("point_id")
    assert len(after) == 3 and after.index.is_unique and set(after["status"]) == {"ok"}
    assert set(after["parity_mode"]) == {"off"} and after["peak_bytes"].notna().all()
    for pid, r in before.iterrows():  # finished points are kept as they were, not rerun
        assert after.loc[pid, "timestamp"] == r["timestamp"] and after.loc[pid, "wall_s"] == r["wall_s"]
    assert not _orphans(run_dir)


def _orphans(run_dir: Path) -> list[int]:
    """Worker processes of this run still alive (a killed sweep must take its launch down)."""
    alive = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if str(run_dir) in (entry / "cmdline").read_text():
                alive.append(int(entry.name))
        except OSError:
            continue
    return [p for p in alive if p != os.getpid()]


@pytest.mark.parametrize("edit,needle", [
    (("tiny-qwen3", "tiny-qwen9"), "`model = 'tiny-qwen9'`"),
    (('"sdpa"', '"sdpaa"'), "attn_implementations"),
    (('"cp_ring"', '"cp_rng"'), "cp_styles"),
    (("cp_sizes = [1, 2]", "cp_sizes = [1, 3]"), "cp_sizes"),
    (("parity = \"full\"", "parity = \"full\"\nworld_size = 4\ncp_styles2 = 1"), "unknown suite fields"),
])
def test_a_bad_suite_is_refused_before_any_launch(tmp_path, capsys, edit, needle):
    suite = _suite(tmp_path, SUITE.replace(*edit))
    assert _sweep(str(suite), "--out", str(tmp_path / "results")) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "results").exists()


def test_one_point_under_an_external_torchrun_writes_the_same_row(run):
    pid = f"tiny-qwen3/s{SHORT}/cp2/sdpa/cp_ring/b1packed"
    suite, out = _suite(run["tmp"], SUITE, "external.toml"), run["tmp"] / "external"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "cpbench", "run", str(suite), "--point", pid, "--out", str(out), "--run-name", "ext"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = store.read_run(out / "e2e" / "ext").set_index("point_id").loc[pid]
    assert row["status"] == "ok" and row["parity_status"] == "pass" and len(row["peak_bytes_per_rank"]) == 2
    # the same point as in the sweep (where it hung on purpose): same key, so runs can be matched
    assert row["point_key"] == run["df"].loc[pid, "point_key"]


def _fake_run(monkeypatch, tmp_path: Path, statuses: list[tuple[str, str]]) -> Path:
    """`run_sweep` replaced by one that writes rows with these (status, parity_status) and returns the run."""
    import cpbench.harness.run.sweep as sweep_module

    run_dir = tmp_path / "results" / "s" / "r"
    rows = [{"point_id": f"p{i}", "status": s, "parity_status": ps} for i, (s, ps) in enumerate(statuses)]
    store.append_rows(run_dir, rows)
    monkeypatch.setattr(sweep_module, "run_sweep", lambda opts: run_dir)
    return run_dir


@pytest.mark.parametrize("statuses,rc", [
    ([("ok", "pass"), ("oom", "error"), ("skipped", "skipped")], 0),  # oom/skipped are data
    ([("ok", "pass"), ("timeout", "error")], 1),
    ([("ok", "pass"), ("error", "error")], 1),
    ([("ok", "fail"), ("ok", "pass")], 1),
])
def test_the_exit_code_says_whether_a_point_failed(monkeypatch, tmp_path, statuses, rc):
    _fake_run(monkeypatch, tmp_path, statuses)
    assert _sweep("default", "--out", str(tmp_path / "results")) == rc
    assert main(["run", "default", "--point", "p0", "--point", "p1", "--no-progress"]) == rc  # `run` here too


def test_run_names_an_existing_run_only_with_resume(tmp_path):
    from cpbench.harness.run.sweep import pick_run_dir

    store.append_rows(tmp_path / "done", [{"point_id": "p", "status": "ok"}])
    with pytest.raises(ValueError, match="--resume"):
        pick_run_dir(tmp_path, "done", resume=False)
    assert pick_run_dir(tmp_path, "done", resume=True) == tmp_path / "done"
    assert pick_run_dir(tmp_path, "new", resume=False) == tmp_path / "new"


def test_resume_takes_the_most_recently_written_run_not_the_last_name(tmp_path):
    from cpbench.harness.run.sweep import pick_run_dir

    for name, mtime in (("zz-old", 1_000_000), ("aa-new", 2_000_000), ("mm", 1_500_000)):
        path = store.append_rows(tmp_path / name, [{"point_id": "p", "status": "ok"}])
        os.utime(path, (mtime, mtime))
    assert pick_run_dir(tmp_path, None, resume=True) == tmp_path / "aa-new"


def test_a_second_sweep_under_the_same_run_name_is_refused_naming_resume(tmp_path, capsys):
    store.append_rows(tmp_path / "results" / "default-cpu" / "ci", [{"point_id": "p", "status": "ok"}])
    assert _sweep("--out", str(tmp_path / "results"), "--run-name", "ci") == 2
    assert "--resume" in capsys.readouterr().err

