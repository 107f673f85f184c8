"""Reading results: a run directory (its `runs.parquet` and journal) or a Parquet file, into a DataFrame, schema
checked, with what could not be read said (a damaged table recovered from its journal: `store.read`).

Pandas and pyarrow only — this must work on a laptop that holds nothing but the Parquet file.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from .match import check_unique
from .schema import COLUMNS, SCHEMA_VERSION
from .store import RUNS_FILE, has_results, journal_dir, read, runs_path


def parquet_path(path: str | Path, what: str = "run") -> Path:
    """The Parquet file of `path` (store.runs_path: the file itself, or `<path>/runs.parquet`), which must exist
    (or, for a run folder, its journal)."""
    file = runs_path(path)
    if not file.is_file() and not (journal_dir(path) is not None and has_results(path)):
        raise FileNotFoundError(
            f"{what}: no results at '{file}'; pass a run directory holding {RUNS_FILE} "
            f"(results/<suite>/<run>) or a .parquet file written by `python -m cpbench sweep`"
        )
    return file


def load_run(path: str | Path, *, allow_schema_mismatch: bool = False, what: str = "run") -> pd.DataFrame:
    """All rows of a run, in their Parquet order. Refuses a file of another schema version unless allowed, and
    a run that holds the same point more than once (which row to report or gate would be a silent pick). A damaged
    table is read from the run's journal: `frame.attrs["notes"]` says what was recovered and what was not; nothing
    readable at all is a ValueError naming the file."""
    file = parquet_path(path, what)
    result = read(path, allow_other_versions=allow_schema_mismatch)
    if result.damaged and not result.table.num_rows:
        raise ValueError(f"{what}: nothing could be read: " + "; ".join(result.notes))
    missing = [name for name in COLUMNS if name not in result.table.column_names]
    if missing:
        raise ValueError(
            f"{file}: columns {missing} are missing; this file was not written with the cpbench results schema "
            f"(version {SCHEMA_VERSION}) — rerun the sweep, or read it with the cpbench version that wrote it"
        )
    # The version check is the store's (the version the writer declared in the file's metadata), so the harness
    # and the report refuse the same files; the per-row column is only compared between runs (gate.check_comparable).
    frame = result.table.to_pandas()
    check_unique(frame, f"{what} {file}")
    frame.attrs["source"] = str(file)
    frame.attrs["notes"] = list(result.notes)
    return frame


def schema_versions(frame: pd.DataFrame) -> list[int]:
    """The schema versions of a run's rows (a DataFrame has no file metadata: this is what two runs compare)."""
    return sorted({int(v) for v in frame["schema_version"].dropna()})


def run_label(frame: pd.DataFrame) -> str:
    """`suite/run_id` of a run (several joined with '+', should a file hold more than one)."""
    pairs = frame[["suite", "run_id"]].drop_duplicates().astype(str)
    labels = [f"{s}/{r}" for s, r in pairs.itertuples(index=False)]
    return " + ".join(labels) if labels else frame.attrs.get("source", "empty run")


def latest_run(root: str | Path) -> Path:
    """The most recently written `runs.parquet` under `root` (for notebooks: 'show me the last sweep')."""
    files = sorted(Path(root).glob(f"**/{RUNS_FILE}"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"root: no {RUNS_FILE} under '{root}'; run `python -m cpbench sweep` first")
    return files[-1].parent
