"""How the attention work spreads over the cp ranks: the per-rank plot of packed points and the columns beside time.

A row holds the query-key pairs each rank's attention computes (`attention_pairs_per_rank`, one layer's forward),
their max / mean (`attention_imbalance`), each rank's step (`step_time_per_rank_s`: measured, its median; projected,
its projected step) and the slowest rank. On packed documents the zigzag ring's balance depends on where the documents
fall (cpbench/cp/balance.py places them); Ulysses is balanced by construction. The figure shows, for each packed point
of a run, every rank's work and step against the mean of its ranks, so the rank that sets the step stands out.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from .axes import empty, legend, ticks
from .derive import with_config
from .plots import config_colors

MAX_POINTS = 12  # bars groups in one figure: the longest packed points of each configuration first


def _listed(value) -> bool:
    return value is not None and not (isinstance(value, float) and np.isnan(value)) and len(value) > 0


def packed_points(frame: pd.DataFrame) -> pd.DataFrame:
    """The ok cp > 1 points of packed or padded batches with per-rank work, longest first per configuration."""
    if "attention_pairs_per_rank" not in frame or frame.empty:
        return frame.iloc[:0]
    labelled = with_config(frame)
    keep = (labelled["status"] == "ok") & (labelled["cp_size"] > 1) & (labelled["batch_kind"] != "plain")
    keep &= labelled["attention_pairs_per_rank"].map(_listed)
    picked = labelled[keep].sort_values(["config_order", "seq_len"], ascending=[True, False])
    return picked.groupby("config", sort=False).head(2).head(MAX_POINTS)


def imbalance_text(row: pd.Series) -> str:
    """`attention_imbalance` as the tables show it (×1.00: balanced), or – where the row has none."""
    value = row.get("attention_imbalance")
    return "–" if value is None or pd.isna(value) else f"×{value:.2f}"


def slowest_text(row: pd.Series) -> str:
    """The slowest rank and its step against the mean of the ranks' steps, e.g. "3 (+4.1 %)"."""
    rank, steps = row.get("slowest_rank"), row.get("step_time_per_rank_s")
    if rank is None or pd.isna(rank) or not _listed(steps):
        return "–"
    mean = float(np.mean(steps))
    return f"{int(rank)} (+{100 * (max(steps) / mean - 1):.1f} %)" if mean > 0 else str(int(rank))


def balance_figure(frame: pd.DataFrame) -> Figure:
    """Per packed point, each cp rank's attention pairs and step time over the mean of its ranks (1: balanced)."""
    points = packed_points(frame)
    fig = Figure(figsize=(max(6, 1.2 * len(points) + 2), 5), layout="constrained")  # the legend widens it
    ax = fig.subplots()
    if points.empty:
        empty(ax, "no packed point with per-rank attention work (batch_kind packed or padded, cp > 1)")
        return fig
    colors = config_colors(frame)
    x0 = 0.0
    positions, labels = [], []
    for _, row in points.iterrows():
        work = np.asarray(row["attention_pairs_per_rank"], dtype=float)
        ranks = np.arange(len(work))
        ax.bar(x0 + ranks, work / work.mean(), width=0.8, color=colors[row["config"]], alpha=0.8,
               label=row["config"])
        steps = row.get("step_time_per_rank_s")
        if _listed(steps):
            steps = np.asarray(steps, dtype=float)[: len(work)]
            ax.plot(x0 + ranks[: len(steps)], steps / steps.mean(), "k_", markersize=14, markeredgewidth=2,
                    label="step time / mean (per rank)")
        positions.append(x0 + (len(work) - 1) / 2)
        labels.append(f"{row['seq_len']:,} tok\n{row.get('documents') or 'packed'}\n{imbalance_text(row)}")
        x0 += len(work) + 1.5
    ax.axhline(1.0, color="gray", linewidth=1, linestyle="--")
    ticks(ax, "x", positions, labels)
    ax.set_ylabel("per rank / mean of the ranks (bars: attention pairs)")
    projected = "projected" in set(points.get("measurement", []))
    ax.set_title("Attention work per cp rank on packed points" + (" (steps projected)" if projected else ""))
    legend(ax)  # one entry per configuration, however many of its points are drawn
    return fig
