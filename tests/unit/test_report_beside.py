"""`cpbench report RUN --projected PROJ`: each point's measured and projected step and peak, and the error."""

from __future__ import annotations

from pathlib import Path

from cpbench.cli import main
from cpbench.report.runs import store
from cpbench.report.compare import beside_projected
from cpbench.report.runs.load import load_run

BASELINE = Path(__file__).parents[2] / "results" / "baselines" / "smoke.parquet"


def _projection_of(measured):
    """A made-up projection of the measured run's points: 20 % slower steps, peaks 1 % higher, one point dropped."""
    projected = measured.copy().iloc[1:]
    projected["measurement"], projected["gpu_profile"] = "projected", "h100-sxm"
    projected["projected_step_s"] = projected["step_time_median_s"] * 1.2
    projected["peak_bytes"] = (projected["peak_bytes"] * 1.01).round().astype("int64")
    return projected


def test_a_point_both_runs_hold_shows_its_measured_and_projected_step_and_peak_with_the_errors():
    measured = load_run(BASELINE)
    ok = measured[measured["status"] == "ok"]
    table = beside_projected(measured, _projection_of(measured))
    assert set(table["point"]) == set(ok["point_id"]) - {measured["point_id"].iloc[0]}  # the dropped one is not
    assert set(table["step error"]) == {"+20 %"} and set(table["peak error"]) == {"+1.0 %"}
    assert table["projected step"].str.endswith("(h100-sxm)").all()


def test_report_with_a_projection_writes_the_section(tmp_path, capsys):
    measured = load_run(BASELINE)
    proj_dir = tmp_path / "proj"
    store.write_table(proj_dir, store.to_table(_projection_of(measured).astype(object).where(
        _projection_of(measured).notna(), None).to_dict("records")))
    assert main(["report", str(BASELINE), "--out", str(tmp_path / "report"), "--projected", str(proj_dir)]) == 0
    page = (tmp_path / "report" / "report.md").read_text()
    assert "## Projected beside measured" in page and "+20 %" in page
