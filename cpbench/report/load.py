"""Reading results: a run directory (its `runs.parquet`) or a Parquet file, into a DataFrame, schema checked.

Pandas and pyarrow only — this must work on a laptop that holds nothing but the Parquet file.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from .schema import COLUMNS, SCHEMA_VERSION

RUN_FILE = "runs.parquet"


def parquet_path(path: str | Path, what: str = "run") -> Path:
    """The Parquet file of `path`: the file itself, or `<path>/runs.parquet` for a run directory."""
    path = Path(path)
    if path.is_dir():
        path = path / RUN_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{what}: no results at '{path}'; pass a run directory holding {RUN_FILE} "
            f"(results/<suite>/<run>) or a .parquet file written by `python -m cpbench sweep`"
        )
    return path


def file_schema_version(path: str | Path) -> int | None:
    """The schema version a Parquet file's writer declared in its metadata (None: not declared)."""
    metadata = pq.read_schema(parquet_path(path)).metadata or {}
    raw = metadata.get(b"cpbench_schema_version")
    return int(raw) if raw is not None else None


def load_run(path: str | Path, *, allow_schema_mismatch: bool = False, what: str = "run") -> pd.DataFrame:
    """All rows of a run, in their Parquet order. Refuses a file of another schema version unless allowed."""
    file = parquet_path(path, what)
    frame = pd.read_parquet(file)
    missing = [name for name in COLUMNS if name not in frame.columns]
    if missing:
        raise ValueError(
            f"{file}: columns {missing} are missing; this file was not written with the cpbench results schema "
            f"(version {SCHEMA_VERSION}) — rerun the sweep, or read it with the cpbench version that wrote it"
        )
    if not allow_schema_mismatch:
        check_schema_version(frame, str(file))
    frame.attrs["source"] = str(file)
    return frame


def schema_versions(frame: pd.DataFrame) -> list[int]:
    return sorted({int(v) for v in frame["schema_version"].dropna()})


def check_schema_version(frame: pd.DataFrame, where: str) -> None:
    versions = schema_versions(frame)
    if versions and versions != [SCHEMA_VERSION]:
        raise ValueError(
            f"{where}: schema_version {versions} but this cpbench reads version {SCHEMA_VERSION}; "
            f"read it with the cpbench version that wrote it, or rerun the sweep"
        )


def run_label(frame: pd.DataFrame) -> str:
    """`suite/run_id` of a run (several joined with '+', should a file hold more than one)."""
    pairs = frame[["suite", "run_id"]].drop_duplicates().astype(str)
    labels = [f"{s}/{r}" for s, r in pairs.itertuples(index=False)]
    return " + ".join(labels) if labels else frame.attrs.get("source", "empty run")


def latest_run(root: str | Path) -> Path:
    """The most recently written `runs.parquet` under `root` (for notebooks: 'show me the last sweep')."""
    files = sorted(Path(root).glob(f"**/{RUN_FILE}"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"root: no {RUN_FILE} under '{root}'; run `python -m cpbench sweep` first")
    return files[-1].parent
