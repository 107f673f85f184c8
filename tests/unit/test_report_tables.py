"""The comparison table and the per-point table, from a fixture run (no process group, no torch)."""

import pandas as pd
import pytest

from cpbench.report import tables, units
from cpbench.report.runs.load import load_run
from tests.report_fixtures import make_run, write_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return load_run(write_run(make_run(), tmp_path_factory.mktemp("run")))


def test_rows_are_seq_lens_and_columns_cp_sizes_with_styles(run):
    table = tables.comparison(run)
    assert list(table.index) == [256, 512, 1024, 2048]
    assert list(table.columns) == ["cp 1", "cp 2 · cp_ring", "cp 2 · cp_ulysses"]


def test_cells_show_peak_time_and_parity_or_what_happened(run):
    table = tables.comparison(run)
    assert table.loc[1024, "cp 1"] == "out of memory"
    assert table.loc[2048, "cp 1"] == "skipped"
    ok = table.loc[512, "cp 2 · cp_ulysses"]
    peak = run.loc[(run.seq_len == 512) & (run.cp_style == "cp_ulysses"), "peak_bytes"].item()
    unit = units.byte_unit(run["peak_bytes"])  # one unit for the whole table, picked from its values
    assert ok.startswith(f"{units.in_unit(peak, unit)}, ") and " ms, parity ✓" in ok
    assert all(unit[1] in c for c in table.to_numpy().ravel() if "ms" in c)


def test_parity_failure_is_visible_in_the_cell():
    frame = make_run()
    frame.loc[5, "parity_status"] = "fail"
    assert "parity ✗ FAIL" in tables.comparison(frame).to_string()


def test_backend_becomes_part_of_the_column_when_the_sweep_varies_it():
    table = tables.comparison(make_run(backends=("eager", "sdpa")))
    assert "cp 1 · eager" in table.columns and "cp 2 · sdpa · cp_ring" in table.columns


def test_markdown_table_has_a_header_and_one_line_per_seq_len(run):
    lines = tables.comparison_markdown(run).splitlines()
    assert lines[0].startswith("| seq len | cp 1 |")
    assert len(lines) == 2 + 4 and "| 1024 | out of memory |" in lines[4]


def test_duplicate_points_are_refused_with_their_ids():
    frame = make_run()
    doubled = pd.concat([frame, frame.iloc[[0]]], ignore_index=True)
    with pytest.raises(ValueError, match="llama-tiny/s256/cp1/sdpa/none"):
        tables.comparison(doubled)


def test_points_table_keeps_per_rank_peaks_and_details(run):
    points = tables.points(run).set_index("point")
    unit = units.byte_unit(run["peak_bytes"])[1]
    assert len(points.loc["llama-tiny/s512/cp2/sdpa/cp_ring", f"peak per rank ({unit})"].split(", ")) == 2
    assert "memory budget" in points.loc["llama-tiny/s1024/cp1/sdpa/none", "detail"]


@pytest.mark.parametrize("value, text", [(0.0123, "0.0123"), (1.234, "1.23"), (45.67, "45.7"), (1234.5, "1234"), (0, "0")])
def test_significant_digits(value, text):
    assert units.sig(value) == text


def test_units_render_base_units():
    assert units.gib(3 * 1024**3) == "3.00 GiB"
    assert units.ms(0.0456) == "45.6 ms"
    assert units.human_bytes(1000) == "1000 B" and units.human_bytes(5 * 1024**2) == "5.00 MiB"
    assert units.change(100, 110) == "+10.0%"
