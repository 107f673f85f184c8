"""Matching the points of two runs on the spec fields that identify a point (KEY_COLUMNS)."""

from __future__ import annotations

import pandas as pd

from .schema import KEY_COLUMNS

_NULL = "<null>"  # key columns may be null; nulls must still match each other


def point_keys(frame: pd.DataFrame) -> pd.Series:
    """One string per row joining its KEY_COLUMNS values.

    Not the stored `point_key` column: that is a hash the harness computes (its recipe lives in harness/suite/spec.py,
    which report must not import), so report can neither check nor recompute it. Should the recipe change (or a
    run come from another writer), every point would silently stop matching and the gate would call them all
    missing. The KEY_COLUMNS it hashes are stored in every row, readable, so matching on them is the same
    identity without depending on how the harness spells it.
    """
    keys = frame[list(KEY_COLUMNS)].astype(object)
    keys = keys.where(keys.notna(), _NULL).astype(str)
    return keys.agg("|".join, axis=1) if len(frame) else pd.Series(dtype=str, index=frame.index)


def check_unique(frame: pd.DataFrame, name: str) -> None:
    """Refuses a run that holds a point more than once: which row to compare would be a silent pick."""
    keys = point_keys(frame).to_numpy()
    counts = pd.Series(keys).value_counts()
    repeated = counts[counts > 1]
    if len(repeated):
        ids = frame["point_id"].astype(str).to_numpy()
        points = [f"{ids[keys == key][0]} ({n} rows)" for key, n in repeated.items()]
        raise ValueError(f"{name}: holds the same point more than once: {', '.join(points)}; "
                         f"remove the duplicate rows (a resumed sweep must not repeat points) or rerun the sweep")


def match_points(a: pd.DataFrame, b: pd.DataFrame, suffixes: tuple[str, str]) -> pd.DataFrame:
    """An outer join of `a` and `b` on the point keys, in `a`'s row order then `b`'s new points; every column
    suffixed, `_merge` says where a row is (both, left_only, right_only). Both must hold each point once."""
    left = a.add_suffix(suffixes[0]).assign(_key=point_keys(a).to_numpy(), _order_a=range(len(a)))
    right = b.add_suffix(suffixes[1]).assign(_key=point_keys(b).to_numpy(), _order_b=range(len(b)))
    merged = left.merge(right, on="_key", how="outer", indicator=True, validate="one_to_one")
    return merged.sort_values(["_order_a", "_order_b"], na_position="last", kind="stable").reset_index(drop=True)


def side(pair: pd.Series, suffix: str) -> pd.Series:
    """One run's row out of a matched pair, with the plain column names."""
    return pd.Series({k[: -len(suffix)]: v for k, v in pair.items() if k.endswith(suffix)})
