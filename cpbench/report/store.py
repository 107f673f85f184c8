"""Reading and writing runs: `<run dir>/runs.parquet`, one row per point, in `schema.ARROW_SCHEMA`.

Writes are atomic: the whole table is written to a temporary file in the same folder and moved over the old
one with `os.replace`, so a killed writer leaves either the old file or the new one, never a torn one.
Appending rewrites the file (runs hold hundreds of rows, not millions).
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .schema import ADDED_SINCE, ARROW_SCHEMA, COLUMNS, SCHEMA_VERSION

RUNS_FILE = "runs.parquet"


def runs_path(run: str | os.PathLike) -> Path:
    """A run folder or a Parquet file -> the Parquet file."""
    p = Path(run)
    return p if p.suffix == ".parquet" else p / RUNS_FILE


def to_table(rows: list[dict]) -> pa.Table:
    """Rows (dicts keyed by column) -> a table in the schema. Missing columns are null; unknown ones refused."""
    for i, row in enumerate(rows):
        unknown = sorted(set(row) - set(COLUMNS))
        if unknown:
            raise ValueError(f"row {i} has columns {unknown} that the schema does not define; add them to schema.py.")
    return pa.Table.from_pylist([{c: row.get(c) for c in COLUMNS} for row in rows], schema=ARROW_SCHEMA)


def read_table(run: str | os.PathLike) -> pa.Table:
    path = runs_path(run)
    if not path.exists():
        return ARROW_SCHEMA.empty_table()
    table = pq.read_table(path)
    version = (table.schema.metadata or {}).get(b"cpbench_schema_version", b"?").decode()
    if version.isdigit() and int(version) in ADDED_SINCE:  # an older file whose successors only added columns
        for name in ADDED_SINCE[int(version)]:
            table = table.append_column(name, pa.nulls(len(table), COLUMNS[name][0]))
        table = table.select(list(COLUMNS)).cast(ARROW_SCHEMA)
        version = str(SCHEMA_VERSION)
    if version != str(SCHEMA_VERSION):
        raise ValueError(
            f"{path} was written with schema version {version}; this cpbench reads version {SCHEMA_VERSION}. "
            "Re-run the sweep or read it with the cpbench version that wrote it."
        )
    return table


def read_run(run: str | os.PathLike):
    """The run as a pandas DataFrame (empty, with every column, when nothing was written yet)."""
    return read_table(run).to_pandas()


def write_table(run: str | os.PathLike, table: pa.Table) -> Path:
    path = runs_path(run)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    pq.write_table(table.cast(ARROW_SCHEMA), tmp)
    os.replace(tmp, path)
    return path


def append_rows(run: str | os.PathLike, rows: list[dict]) -> Path:
    """Adds rows to the run (atomically). A row whose point_id is already there replaces it."""
    new = to_table(rows)
    old = read_table(run)
    if old.num_rows:
        replaced = set(new.column("point_id").to_pylist())
        keep = [i for i, pid in enumerate(old.column("point_id").to_pylist()) if pid not in replaced]
        old = old.take(keep)
        new = pa.concat_tables([old.cast(ARROW_SCHEMA), new])
    return write_table(run, new)


def finished_point_ids(run: str | os.PathLike) -> set[str]:
    """Points of the run that have a row (any status: an `error` row is a finished point too)."""
    return set(read_table(run).column("point_id").to_pylist())
