"""Reading runs: run directories and files, refused schema versions and foreign files, derived data."""

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cpbench.report import derive
from cpbench.report.runs import store
from cpbench.report.runs.load import latest_run, load_run, parquet_path
from cpbench.report.runs.schema import ARROW_SCHEMA, SCHEMA_VERSION
from tests.report_fixtures import make_run, write_run


def test_reads_a_run_directory_and_its_file(tmp_path):
    run_dir = write_run(make_run(), tmp_path / "suite" / "run")
    assert len(load_run(run_dir)) == len(load_run(run_dir / "runs.parquet")) == 12
    assert latest_run(tmp_path) == run_dir


def test_missing_run_names_the_path_and_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no results at .*cpbench sweep"):
        load_run(tmp_path / "nope")


def test_the_run_file_is_where_the_store_writes_it(tmp_path):
    written = store.write_table(tmp_path / "run", store.to_table([]))
    assert parquet_path(tmp_path / "run") == written == store.runs_path(tmp_path / "run")
    assert parquet_path(written) == written


def _write_with_version(frame, path, version):
    schema = ARROW_SCHEMA.with_metadata({b"cpbench_schema_version": str(version).encode()})
    pq.write_table(pa.Table.from_pandas(frame, schema=schema, preserve_index=False), path)
    return path


def test_other_schema_version_is_refused_like_the_store_refuses_it_unless_allowed(tmp_path):
    path = _write_with_version(make_run(), tmp_path / "runs.parquet", SCHEMA_VERSION + 1)
    with pytest.raises(ValueError) as by_store:
        store.read_table(path)
    with pytest.raises(ValueError) as by_report:
        load_run(path)
    assert str(by_report.value) == str(by_store.value)  # one check, one message
    assert f"schema version {SCHEMA_VERSION + 1}" in str(by_report.value)
    assert len(load_run(path, allow_schema_mismatch=True)) == 12


def test_a_parquet_file_of_something_else_is_refused(tmp_path):
    pq.write_table(pa.table({"x": [1]}), tmp_path / "other.parquet")
    with pytest.raises(ValueError, match="columns .* are missing"):
        load_run(tmp_path / "other.parquet")


def test_ratios_against_cp1_and_largest_fit():
    frame = make_run()
    ratios = derive.ratios_vs_cp1(frame)
    ulysses = ratios[ratios["config"] == "cp 2 · cp_ulysses"]
    assert list(ulysses["seq_len"]) == [256, 512]  # cp=1 ran out of memory from 1024 on: nothing to divide by
    assert ulysses["activations_ratio"].tolist() == pytest.approx([0.5, 0.5])
    fits = derive.largest_fit(frame).set_index("config")
    assert fits.loc["cp 1", "largest_ok_seq_len"] == 512 and fits.loc["cp 1", "first_failed_seq_len"] == 1024
    assert fits.loc["cp 2 · cp_ring", "largest_ok_seq_len"] == 2048
    assert pd.isna(fits.loc["cp 2 · cp_ring", "first_failed_seq_len"])
