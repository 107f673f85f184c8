"""Atomic Parquet writes: append, replace by point_id, read back, and survive a killed writer."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cpbench.report import schema, store


def _row(pid: str, status: str = "ok", **kw) -> dict:
    return {"schema_version": schema.SCHEMA_VERSION, "point_id": pid, "status": status, "suite": "s", **kw}


def test_append_reads_back_and_replaces_by_point_id(tmp_path):
    assert store.read_run(tmp_path).empty and list(store.read_run(tmp_path).columns) == list(schema.COLUMNS)
    store.append_rows(tmp_path, [_row("a"), _row("b", "oom")])
    store.append_rows(tmp_path, [_row("a", "error"), _row("c", peak_bytes_per_rank=[1, 2])])
    df = store.read_run(tmp_path).set_index("point_id")
    assert list(df.index) == ["b", "a", "c"] and df.loc["a", "status"] == "error"
    assert list(df.loc["c", "peak_bytes_per_rank"]) == [1, 2]
    assert store.finished_point_ids(tmp_path) == {"a", "b", "c"}
    assert store.read_run(tmp_path / "runs.parquet").shape == df.reset_index().shape


def test_a_killed_writer_leaves_the_last_complete_file(tmp_path):
    store.append_rows(tmp_path, [_row("a")])
    (tmp_path / ".runs.parquet.tmp999").write_bytes(b"PAR1 torn")  # a writer killed mid-write
    assert store.finished_point_ids(tmp_path) == {"a"}
    store.append_rows(tmp_path, [_row("b")])
    assert store.finished_point_ids(tmp_path) == {"a", "b"}


def test_unknown_columns_and_other_schema_versions_are_refused(tmp_path):
    with pytest.raises(ValueError, match="colour"):
        store.append_rows(tmp_path, [_row("a", colour="red")])
    old = pa.table({"point_id": ["a"]}).replace_schema_metadata({b"cpbench_schema_version": b"0"})
    pq.write_table(old, tmp_path / "runs.parquet")
    with pytest.raises(ValueError, match="schema version 0"):
        store.read_run(tmp_path)
