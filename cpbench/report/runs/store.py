"""Reading and writing runs: `<run dir>/runs.parquet`, one row per point, in `schema.ARROW_SCHEMA`, and beside it the
run's journal, `<run dir>/points/`: each point's row in a file of its own.

A row goes to the journal first, then the whole table is rewritten. Both writes are atomic (a temporary file in the
same folder, moved over the old one with `os.replace`), so a killed writer leaves the old file or the new one, never
a torn one, and a writer killed between the two leaves the point in the journal. Should the table still be damaged
(a full disk, a copy cut short, a bad block), `read` recovers every point the journal holds and says what it could
and could not read; `repair` (what a resuming writer calls, under the run's lock) sets the damaged table aside and
writes the recovered one. Appending rewrites the table (runs hold hundreds of rows, not millions).
"""

from __future__ import annotations

import datetime
import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .schema import ADDED_SINCE, ARROW_SCHEMA, COLUMNS, DEFAULTS, SCHEMA_VERSION

RUNS_FILE = "runs.parquet"
POINTS_DIR = "points"  # the journal: one Parquet file per point, its row, written before the table
DAMAGED = (pa.ArrowException, OSError)  # what a torn or truncated Parquet file raises on reading


@dataclass
class RunRead:
    """What `read` got: the rows, and a note for each thing it could not read or had to recover."""

    table: pa.Table
    notes: list[str] = field(default_factory=list)
    damaged: bool = False  # the table itself could not be read (whatever the journal gave back)
    journal_only: int = 0  # rows the journal holds that the table does not (a writer killed between the two)


def runs_path(run: str | os.PathLike) -> Path:
    """A run folder or a Parquet file -> the Parquet file."""
    p = Path(run)
    return p if p.suffix == ".parquet" else p / RUNS_FILE


def journal_dir(run: str | os.PathLike) -> Path | None:
    """The run's journal folder; None for a Parquet file that is not a run folder's table (a baseline)."""
    path = runs_path(run)
    return path.parent / POINTS_DIR if path.name == RUNS_FILE else None


def point_file(point_id: str) -> str:
    """The journal file of a point: readable, and unique (a hash of the whole id)."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", point_id)[:80]
    return f"{readable}-{hashlib.sha1(point_id.encode()).hexdigest()[:12]}.parquet"


def to_table(rows: list[dict]) -> pa.Table:
    """Rows (dicts keyed by column) -> a table in the schema. Missing columns are null; unknown ones refused."""
    for i, row in enumerate(rows):
        unknown = sorted(set(row) - set(COLUMNS))
        if unknown:
            raise ValueError(f"row {i} has columns {unknown} that the schema does not define; add them to schema.py.")
    return pa.Table.from_pylist([{c: row.get(c) for c in COLUMNS} for row in rows], schema=ARROW_SCHEMA)


def in_schema(table: pa.Table, path: Path, *, allow_other_versions: bool = False) -> pa.Table:
    """A table read from `path`, in this version's schema: a version whose successors only added columns gets them
    null; any other version is refused (or, allowed, returned as it is)."""
    version = (table.schema.metadata or {}).get(b"cpbench_schema_version", b"?").decode()
    missing = [name for name in COLUMNS if name not in table.column_names]
    if not version.isdigit() and missing:
        raise ValueError(f"{path}: columns {missing[:8]}{' ...' if len(missing) > 8 else ''} are missing; this file "
                         f"was not written with the cpbench results schema (version {SCHEMA_VERSION}) — pass a run "
                         "written by `cpbench sweep` or `cpbench estimate`")
    if version.isdigit() and int(version) in ADDED_SINCE:  # an older file whose successors only added columns
        for name in ADDED_SINCE[int(version)]:
            if name not in table.column_names:
                filled = pa.array([DEFAULTS[name]] * len(table), COLUMNS[name][0]) if name in DEFAULTS else \
                    pa.nulls(len(table), COLUMNS[name][0])
                table = table.append_column(name, filled)
        return table.select(list(COLUMNS)).cast(ARROW_SCHEMA)
    if version != str(SCHEMA_VERSION) and not allow_other_versions:
        raise ValueError(
            f"{path} was written with schema version {version}; this cpbench reads version {SCHEMA_VERSION}. "
            "Re-run the sweep or read it with the cpbench version that wrote it."
        )
    return table


def read(run: str | os.PathLike, *, allow_other_versions: bool = False) -> RunRead:
    """The run's rows: the table, and any point the journal holds that the table lacks. A damaged table does not
    raise: the rows come from the journal and the notes say what happened. A file of another schema version does."""
    path, journal = runs_path(run), journal_dir(run)
    files = {p.name: p for p in journal.glob("*.parquet")} if journal is not None and journal.is_dir() else {}
    if not path.exists() and not files:
        return RunRead(ARROW_SCHEMA.empty_table())
    result = RunRead(ARROW_SCHEMA.empty_table())
    if path.exists():
        try:
            result.table = in_schema(pq.read_table(path), path, allow_other_versions=allow_other_versions)
        except DAMAGED as e:
            result.damaged = True
            result.notes.append(f"{path} is damaged and could not be read ({type(e).__name__}: {e})")
    known = {point_file(pid) for pid in result.table.column("point_id").to_pylist()}
    extra, unreadable = [], []
    for name in sorted(set(files) - known):
        try:
            extra.append(in_schema(pq.read_table(files[name]), files[name],
                                   allow_other_versions=allow_other_versions))
        except DAMAGED:
            unreadable.append(name)
    if extra:
        parts = extra if result.damaged else [result.table, *extra]
        result.table = pa.concat_tables([t.cast(parts[0].schema) for t in parts])
        result.journal_only = sum(len(t) for t in extra)
    if result.damaged:
        what = (f"{result.journal_only} point(s) recovered from {journal}, where each point's row is written before "
                "the table" if files else "no journal to recover from (the run was written before cpbench kept "
                "one): its points are lost; rerun them with --resume")
        result.notes.append(what)
    elif result.journal_only:
        result.notes.append(f"{result.journal_only} point(s) in {journal} are not in {path} (a writer stopped "
                            "between the two): read from the journal")
    if unreadable:
        result.notes.append(f"{len(unreadable)} file(s) of {journal} are damaged and were not read: "
                            f"{', '.join(unreadable[:5])}{', ...' if len(unreadable) > 5 else ''}")
    return result


def read_table(run: str | os.PathLike) -> pa.Table:
    return read(run).table


def read_run(run: str | os.PathLike):
    """The run as a pandas DataFrame (empty, with every column, when nothing was written yet)."""
    return read_table(run).to_pandas()


def has_results(run: str | os.PathLike) -> bool:
    """Whether anything was written to the run: its table, or a point of its journal."""
    journal = journal_dir(run)
    return runs_path(run).exists() or (journal is not None and journal.is_dir() and any(journal.glob("*.parquet")))


def _atomic(path: Path, table: pa.Table) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        pq.write_table(table.cast(ARROW_SCHEMA), tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # a write that failed (a full disk) leaves no temporary behind
    return path


def write_table(run: str | os.PathLike, table: pa.Table) -> Path:
    return _atomic(runs_path(run), table)


def append_rows(run: str | os.PathLike, rows: list[dict]) -> Path:
    """Adds rows to the run: each to the journal, then the table (each atomically). A row whose point_id is already
    there replaces it. Raises OSError when a write fails (a full disk): what was written before stays whole."""
    new = to_table(rows)
    journal = journal_dir(run)
    if journal is not None:
        for i, pid in enumerate(new.column("point_id").to_pylist()):
            _atomic(journal / point_file(str(pid)), new.slice(i, 1))
    old = read(run).table
    if old.num_rows:
        replaced = set(new.column("point_id").to_pylist())
        keep = [i for i, pid in enumerate(old.column("point_id").to_pylist()) if pid not in replaced]
        new = pa.concat_tables([old.take(pa.array(keep, pa.int64())).cast(ARROW_SCHEMA), new])
    return write_table(run, new)


def repair(run: str | os.PathLike) -> list[str]:
    """Rewrites a run's table from what `read` recovers, setting a damaged table aside (never deleted); returns what
    it found and did (nothing for a whole run). Call it under the run's lock, before writing more."""
    result = read(run)
    if not result.damaged and not result.journal_only:
        return result.notes
    path = runs_path(run)
    if result.damaged:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        aside = path.with_name(f"{path.name}.damaged-{stamp}")
        os.replace(path, aside)
        result.notes.append(f"the damaged table was moved to {aside}")
    write_table(run, result.table)
    result.notes.append(f"{path} rewritten with the {result.table.num_rows} point(s) recovered")
    return result.notes


def finished_point_ids(run: str | os.PathLike) -> set[str]:
    """Points of the run that have a row (any status: an `error` row is a finished point too)."""
    return set(read_table(run).column("point_id").to_pylist())
