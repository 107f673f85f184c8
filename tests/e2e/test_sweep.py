"""`python -m cpbench sweep` end to end on CPU: real torchrun launches of a tiny suite.

One module-scoped sweep covers the normal points (cp 1 and 2, two lengths, packed batches, parity against the
unsharded run). What happens when something fails (a rank crashes, is killed, runs out of memory or hangs; the sweep
is killed; the disk fills; two writers; a damaged table; bad input) is the fault matrix, tests/e2e/test_faults.py.
No test asserts a timing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cpbench.cli import main
from cpbench.report.runs import schema, store

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


def _suite(tmp_path: Path, text: str, name: str = "suite.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _sweep(*argv: str) -> int:
    return main(["sweep", *argv, "--no-progress"])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    suite = _suite(tmp, SUITE)
    rc = _sweep(str(suite), "--out", str(tmp / "results"))
    (run_dir,) = (tmp / "results" / "e2e").glob("2*")
    return {"rc": rc, "df": store.read_run(run_dir).set_index("point_id"), "dir": run_dir, "tmp": tmp}


def _row(df, cp: int, seq: int, style: str):
    return df.loc[f"tiny-qwen3/s{seq}/cp{cp}/sdpa/{style}/b1packed"]


def test_every_point_has_one_row_with_a_status(run):
    df = run["df"]
    assert len(df) == 6 and df.index.is_unique
    assert run["rc"] == 0 and set(df["status"]) == {"ok"}


def test_ok_points_have_plausible_memory_time_and_parity(run):
    ok = run["df"][run["df"]["status"] == "ok"]
    assert len(ok) == 6
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
    # the same point as in the sweep: same key, so runs can be matched
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

