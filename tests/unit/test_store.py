"""Atomic Parquet writes: append, replace by point_id, read back, and survive a killed writer."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cpbench.report.runs import schema, store


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


def test_a_point_in_the_journal_but_not_in_the_table_is_read_and_repaired(tmp_path):
    store.append_rows(tmp_path, [_row("a"), _row("b")])
    table = store.read_table(tmp_path)
    store.append_rows(tmp_path, [_row("c")])
    store.write_table(tmp_path, table)  # as if the writer was killed after c's journal file, before the table
    got = store.read(tmp_path)
    assert got.table.column("point_id").to_pylist() == ["a", "b", "c"] and got.journal_only == 1 and not got.damaged
    assert "not in" in got.notes[0]
    assert store.repair(tmp_path)[-1].endswith("rewritten with the 3 point(s) recovered")
    assert pq.read_table(tmp_path / store.RUNS_FILE).column("point_id").to_pylist() == ["a", "b", "c"]
    assert store.repair(tmp_path) == []  # a whole run: nothing to do


def test_a_damaged_table_is_recovered_from_the_journal_and_set_aside(tmp_path):
    store.append_rows(tmp_path, [_row("a"), _row("b", "oom")])
    path = tmp_path / store.RUNS_FILE
    path.write_bytes(path.read_bytes()[:100])  # truncated: a full disk, a copy cut short
    got = store.read(tmp_path)
    assert got.damaged and sorted(got.table.column("point_id").to_pylist()) == ["a", "b"]
    assert str(path) in got.notes[0] and "2 point(s) recovered" in got.notes[1]
    notes = store.repair(tmp_path)
    (aside,) = tmp_path.glob("runs.parquet.damaged-*")
    assert f"moved to {aside}" in " ".join(notes) and aside.stat().st_size == 100
    assert sorted(store.finished_point_ids(tmp_path)) == ["a", "b"] and not store.read(tmp_path).notes


def test_a_damaged_table_without_a_journal_says_nothing_could_be_recovered(tmp_path):
    store.append_rows(tmp_path, [_row("a")])
    for f in (tmp_path / store.POINTS_DIR).iterdir():
        f.unlink()
    (tmp_path / store.RUNS_FILE).write_bytes(b"PAR1 torn")
    got = store.read(tmp_path)
    assert got.damaged and got.table.num_rows == 0 and "its points are lost" in got.notes[-1]
    from cpbench.report.runs.load import load_run

    with pytest.raises(ValueError, match="nothing could be read"):
        load_run(tmp_path)


def test_a_damaged_journal_file_is_named_and_the_rest_read(tmp_path):
    store.append_rows(tmp_path, [_row("a"), _row("b")])
    (tmp_path / store.RUNS_FILE).unlink()
    (tmp_path / store.POINTS_DIR / store.point_file("b")).write_bytes(b"torn")
    got = store.read(tmp_path)
    assert got.table.column("point_id").to_pylist() == ["a"] and store.point_file("b") in got.notes[-1]


def test_a_failed_write_leaves_the_run_as_it_was_and_no_temporary(tmp_path, monkeypatch):
    import errno

    store.append_rows(tmp_path, [_row("a")])

    def full(*_, **__):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store.pq, "write_table", full)
    with pytest.raises(OSError, match="No space"):
        store.append_rows(tmp_path, [_row("b")])
    monkeypatch.undo()
    assert store.finished_point_ids(tmp_path) == {"a"}
    assert not [p for p in tmp_path.rglob(".*tmp*")]


def test_point_files_are_unique_and_readable():
    names = {store.point_file(f"m/s{n}/cp2/sdpa/cp_ring") for n in range(100)} | {store.point_file("a b"),
                                                                                  store.point_file("a_b")}
    assert len(names) == 102 and store.point_file("m/s128/cp2").startswith("m_s128_cp2-")
