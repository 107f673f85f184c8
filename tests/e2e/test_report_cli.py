"""`python -m cpbench report | compare | gate` on fixture runs: files written, changes printed, exit codes."""

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from cpbench.cli import main
from cpbench.report import page
from tests.report_fixtures import make_run, row_of, write_run

ROOT = Path(__file__).parents[2]
RULES = ROOT / "results" / "baselines" / "gate-rules.toml"
RING_512 = "llama-tiny/s512/cp2/sdpa/cp_ring"


@pytest.fixture
def runs(tmp_path):
    """A baseline (with the committed rules beside it) and a run of the same points, other noise."""
    base_dir = tmp_path / "baselines"
    base_dir.mkdir()
    (base_dir / "gate-rules.toml").write_text(RULES.read_text())
    baseline = base_dir / "smoke.parquet"
    baseline.write_bytes((write_run(make_run(seed=0), tmp_path / "results" / "test-suite" / "run-a") / "runs.parquet").read_bytes())
    run = write_run(make_run(seed=1, run_id="run-b"), tmp_path / "results" / "test-suite" / "run-b")
    return {"baseline": baseline, "run": run, "tmp": tmp_path, "base_dir": base_dir}


def test_report_writes_the_page_table_and_plots_next_to_the_parquet(runs, capsys):
    assert main(["report", str(runs["run"])]) == 0
    out = capsys.readouterr().out
    assert "| seq len | cp 1 | cp 2 · cp_ring | cp 2 · cp_ulysses |" in out and "out of memory" in out
    for name in ("report.html", "report.md", "table.md", "plots/memory.png", "plots/parity.png"):
        assert (runs["run"] / name).stat().st_size > 0, name


def test_report_on_a_missing_run_exits_2_with_the_fix(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "cpbench sweep" in capsys.readouterr().err


def test_compare_prints_the_change_per_metric(runs, capsys):
    frame = make_run(seed=1, run_id="run-b")
    frame.loc[row_of(frame, RING_512), "peak_bytes"] *= 1.5
    write_run(frame, runs["run"])
    assert main(["compare", str(runs["baseline"]), str(runs["run"]), "--out", str(runs["tmp"] / "cmp.md")]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith(f"| {RING_512} |"))
    assert "→" in line and "(+50.0%)" in line
    assert (runs["tmp"] / "cmp.md").read_text() == out.rstrip("\n") + "\n"


def test_gate_passes_the_same_points_with_other_noise(runs, capsys):
    assert main(["gate", "--baseline", str(runs["baseline"]), str(runs["run"])]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"rules: {runs['base_dir'] / 'gate-rules.toml'}\ngate PASS")


def test_gate_without_rules_beside_the_baseline_uses_the_shipped_rules(runs, capsys):
    (runs["base_dir"] / "gate-rules.toml").unlink()
    assert main(["gate", "--baseline", str(runs["baseline"]), str(runs["run"])]) == 0
    out = capsys.readouterr().out
    assert "default-gate-rules.toml" in out.splitlines()[0] and "gate PASS" in out


def test_gate_fails_a_regression_with_exit_1_and_the_list(runs, capsys):
    frame = make_run(seed=1, run_id="run-b")
    frame.loc[row_of(frame, RING_512), "status"] = "oom"
    write_run(frame, runs["run"])
    assert main(["gate", "--baseline", str(runs["baseline"]), str(runs["run"])]) == 1
    out = capsys.readouterr().out
    assert "gate FAIL: 1 regression(s)" in out and f"{RING_512}  status ok → oom" in out


def test_gate_refuses_other_hardware_with_exit_2_unless_allowed(runs, capsys):
    write_run(make_run(seed=1).assign(hardware_id="NVIDIA H200 x 1"), runs["run"])
    args = ["gate", "--baseline", str(runs["baseline"]), str(runs["run"])]
    assert main(args) == 2
    assert "gate refused: hardware_id" in capsys.readouterr().err
    assert main(args + ["--allow-hardware-mismatch"]) == 0
    assert "different hardware" in capsys.readouterr().out


def test_update_baseline_creates_then_replaces_it(runs, capsys):
    target = runs["base_dir"] / "new.parquet"
    assert main(["gate", "--baseline", str(target), str(runs["run"])]) == 2  # no baseline yet
    assert "--update-baseline" in capsys.readouterr().err
    assert main(["gate", "--baseline", str(target), str(runs["run"]), "--update-baseline"]) == 0
    assert target.read_bytes() == (runs["run"] / "runs.parquet").read_bytes()
    assert main(["gate", "--baseline", str(target), str(runs["run"])]) == 0


def test_the_module_entry_point_returns_the_gate_exit_code(runs):
    """The CI step: a real process, its exit code and its message."""
    frame = make_run(seed=1)
    frame.loc[row_of(frame, RING_512), "parity_status"] = "fail"
    write_run(frame, runs["run"])
    done = subprocess.run([sys.executable, "-m", "cpbench", "gate", "--baseline", str(runs["baseline"]), str(runs["run"])],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1, done.stderr
    assert f"{RING_512}  parity failed" in done.stdout


@pytest.mark.parametrize("command", ["report", "compare", "gate"])
def test_a_run_holding_a_point_twice_exits_2_naming_it(runs, capsys, command):
    frame = make_run(seed=1, run_id="run-b")
    write_run(pd.concat([frame, frame[frame["point_id"] == RING_512]], ignore_index=True), runs["run"])
    args = {"report": ["report", str(runs["run"])],
            "compare": ["compare", str(runs["baseline"]), str(runs["run"])],
            "gate": ["gate", "--baseline", str(runs["baseline"]), str(runs["run"])]}[command]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "holds the same point more than once" in err and f"{RING_512} (2 rows)" in err


def test_report_device_memory_reaches_the_memory_plot_in_bytes(runs, monkeypatch):
    seen = []
    draw = page.FIGURES["memory"]  # the figures the report draws (plots' and the balance figure)
    monkeypatch.setitem(page.FIGURES, "memory", lambda frame, capacity=None: seen.append(capacity) or draw(frame, capacity))
    assert main(["report", str(runs["run"]), "--device-memory", "80GB"]) == 0
    assert seen == [80 * 10**9]


def test_report_refuses_a_device_memory_it_cannot_read(runs, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["report", str(runs["run"]), "--device-memory", "80 gigs"])
    assert exit_.value.code == 2 and "write a size like 80GiB" in capsys.readouterr().err
