"""The peers table and plot: CP implementations side by side on the same points (`implementations = [...]`).

Rows are sequence lengths, columns implementation · style, cells the step time as a fraction of the unsharded op's
(the cp 1 point of the same length: lower is faster), the peak memory per rank (max over ranks) and the parity
verdict, so a fast but wrong implementation shows as wrong. A point that did not run says why.
"""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from . import units
from .axes import legend, seq_axis
from .derive import SEPARATOR
from .tables import NOT_RUN, PARITY_TEXT, STATUS_TEXT

UNSHARDED = "unsharded (cp 1)"


def _column(row: pd.Series) -> str:
    if row["cp_size"] == 1:
        return UNSHARDED
    return SEPARATOR.join((str(row["implementation"]), str(row["cp_style"]), f"cp {int(row['cp_size'])}"))


def with_time_ratio(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows with `column` and `time_ratio` (median step time / the cp 1 point's of the same seq_len and level)."""
    base = frame[(frame["cp_size"] == 1) & (frame["status"] == "ok")]
    base = base.drop_duplicates(["seq_len", "level"]).set_index(["seq_len", "level"])["step_time_median_s"]
    keys = list(zip(frame["seq_len"], frame["level"]))
    unsharded = pd.Series([base.get(k) for k in keys], index=frame.index, dtype=float)
    return frame.assign(column=frame.apply(_column, axis=1) if len(frame) else [],
                        time_ratio=frame["step_time_median_s"] / unsharded)


def _cell(row: pd.Series) -> str:
    if row["status"] != "ok":
        return STATUS_TEXT.get(row["status"], str(row["status"]))
    ratio = "–" if pd.isna(row["time_ratio"]) else f"{row['time_ratio']:.3f}×"
    parity = PARITY_TEXT.get(row["parity_status"], f"parity {row['parity_status']}")
    return f"{ratio}, {units.gib(row['peak_bytes'])}/rank, {parity}"


def peers_table(frame: pd.DataFrame) -> pd.DataFrame:
    rows = with_time_ratio(frame)
    cells = rows.assign(cell=rows.apply(_cell, axis=1) if len(rows) else [])
    table = cells.pivot_table(index="seq_len", columns="column", values="cell", aggfunc="first")
    order = [UNSHARDED] + sorted(c for c in table.columns if c != UNSHARDED)
    table = table.reindex(columns=[c for c in order if c in table.columns]).sort_index().fillna(NOT_RUN)
    table.columns.name = None
    return table


def has_peers(frame: pd.DataFrame) -> bool:
    return "implementation" in frame and frame["implementation"].nunique(dropna=True) > 1


def peers_figure(frame: pd.DataFrame) -> Figure:
    """Time ratio to the unsharded op against seq_len, one line per implementation · style."""
    rows = with_time_ratio(frame)
    rows = rows[(rows["status"] == "ok") & (rows["cp_size"] > 1)]
    fig = Figure(figsize=(7, 4.5), layout="constrained")  # the legend widens it
    ax = fig.add_subplot()
    for column, points in rows.sort_values("seq_len").groupby("column"):
        ax.plot(points["seq_len"], points["time_ratio"], marker="o", label=column)
    seq_axis(ax, rows["seq_len"], "tokens per sequence")
    ax.set_ylabel("step time / unsharded step time")
    ax.set_title("CP implementations side by side (lower is faster)")
    legend(ax)
    return fig
