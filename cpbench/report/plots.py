"""The report's figures (matplotlib's object API on the Agg canvas: no pyplot state, no display needed).

Each `*_figure(frame)` returns a Figure (a notebook shows it; `page.save_figures` writes PNGs, and leaves out a figure
with nothing to show, saying why: the message the figure would have shown, `nothing_to_show`). Axes are in GiB and ms (rendering only); the data stays in bytes and seconds. A configuration has
one colour in every figure of a run (`config_colors`), sequence lengths read 16k, 32k, 1M, and legends stand outside
the data. Tick labels and legends go through `axes`, which wraps long labels and grows a figure around them: each
figure is created at the size of its data alone.
"""

from __future__ import annotations

import io

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.figure import Figure

from . import axes
from .axes import MAX_INCHES, empty, legend, seq_axis, ticks
from .derive import largest_fit, measurement_note, ordered_configs, ratios_vs_cp1, with_config, with_projected_time
from .units import GIB, human_bytes, seq_label

BREAKDOWN = (("params_bytes", "parameters"), ("grads_bytes", "gradients"),
             ("optimizer_bytes", "optimizer state"), ("activations_bytes", "activations"),
             ("temporaries_bytes", "temporaries"))
PARITY = (("loss_rel_err", "loss_rtol", "loss"), ("logits_max_err", "logits_atol", "logits"),
          ("grad_max_rel_err", "grad_rtol", "gradients"))
FLOOR = 1e-6  # an error of exactly 0 is drawn here on the log axis (and said so in the legend)


HOST_BREAKDOWN = (("host_params_bytes", "parameters"), ("host_grads_bytes", "gradients"),
                  ("host_optimizer_bytes", "optimizer state"), ("host_activations_bytes", "checkpoints"))


def _ok(frame: pd.DataFrame) -> pd.DataFrame:
    labelled = with_config(frame)  # labels from the whole run: a configuration is named alike in every figure
    return labelled[labelled["status"] == "ok"].sort_values("seq_len")


def config_colors(frame: pd.DataFrame) -> dict[str, tuple]:
    """One colour per configuration of the run, the same in every figure (tab10, tab20 past ten)."""
    configs = ordered_configs(frame) if len(frame) else []
    palette = colormaps["tab10" if len(configs) <= 10 else "tab20"].colors
    return {config: palette[i % len(palette)] for i, config in enumerate(configs)}


def _width(bars: int) -> float:
    """Inches for a figure of one bar (or column of marks) per point: wider with more points, up to a page."""
    return min(max(8, 0.5 * bars + 2), MAX_INCHES)


def capacity_bytes(frame: pd.DataFrame, explicit: float | None = None) -> tuple[float, str] | None:
    """The memory line to draw: an explicit capacity (bytes, e.g. `--device-memory` through units.parse_bytes),
    else the sweep's --memory-budget (when it had one)."""
    if explicit is not None:
        return float(explicit), "device capacity (--device-memory)"
    budgets = frame["memory_budget_bytes"].dropna()
    return (float(budgets.max()), "the suite's memory budget") if len(budgets) else None


def memory_figure(frame: pd.DataFrame, capacity: float | None = None) -> Figure:
    """Peak memory per rank vs sequence length, one line (max over ranks) per configuration, every rank a dot."""
    fig = Figure(figsize=(8, 5), layout="constrained")  # the data's width: the legend widens it
    ax = fig.add_subplot()
    ok, colors = _ok(frame), config_colors(frame)
    labelled = with_config(frame)
    if ok.empty and not labelled["status"].isin(["oom", "error", "timeout"]).any():
        empty(ax, "no point finished ok")
        return fig
    for config in ordered_configs(ok) if len(ok) else []:
        points = ok[ok["config"] == config]
        ax.plot(points["seq_len"], points["peak_bytes"] / GIB, marker="o", label=config, color=colors[config])
        for seq_len, ranks in zip(points["seq_len"], points["peak_bytes_per_rank"]):
            if ranks is not None and len(ranks):
                ax.scatter([seq_len] * len(ranks), np.asarray(ranks) / GIB, s=10, color=colors[config], alpha=0.5)
    _mark_failures(ax, labelled, colors)
    line = capacity_bytes(frame, capacity)
    if line:
        ax.axhline(line[0] / GIB, color="red", linestyle="--", label=line[1])
    seq_axis(ax, labelled["seq_len"])
    ax.set_ylabel("peak memory per rank (GiB)")
    ax.set_title("Peak memory per rank (line: max over ranks, dots: each rank)" + measurement_note(frame))
    legend(ax)
    return fig


def _mark_failures(ax, frame: pd.DataFrame, colors: dict) -> None:
    """An out-of-memory point with a peak (a projection's, or a measured one over the budget) at that peak, in its
    configuration's colour; a point without one (error, timeout) on the top edge."""
    failed = frame[frame["status"].isin(["oom", "error", "timeout"])]
    at_peak = failed[(failed["status"] == "oom") & failed["peak_bytes"].notna()]
    for config, points in at_peak.groupby("config", sort=False):
        ax.scatter(points["seq_len"], points["peak_bytes"] / GIB, marker="x", s=70, color=colors.get(config, "red"),
                   label=f"{config}: out of memory (at its peak)")
    edge = failed.drop(at_peak.index)
    if len(edge):
        ax.scatter(edge["seq_len"], [0.97] * len(edge), marker="x", color="red", s=60,
                   transform=ax.get_xaxis_transform(), label="out of memory / error / timeout")


def time_figure(frame: pd.DataFrame) -> Figure:
    """Median step time (p10–p90 bars) and tokens/s vs sequence length."""
    fig = Figure(figsize=(10, 5), layout="constrained")
    step_ax, tps_ax = fig.subplots(1, 2)
    ok = _ok(with_projected_time(frame)).dropna(subset=["step_time_median_s"])
    if ok.empty:
        empty(step_ax, "no timed point (a projection has time only on a GPU profile: estimate --gpu)"
              if measurement_note(frame) else "no point finished ok")
        empty(tps_ax, "")
        return fig
    colors = config_colors(frame)
    for config in ordered_configs(ok):
        p = ok[ok["config"] == config]
        median = p["step_time_median_s"] * 1e3
        spread = [median - p["step_time_p10_s"] * 1e3, p["step_time_p90_s"] * 1e3 - median]
        step_ax.errorbar(p["seq_len"], median, yerr=np.clip(np.asarray(spread, dtype=float), 0, None),
                         marker="o", capsize=3, label=config, color=colors[config])
        tps_ax.plot(p["seq_len"], p["tokens_per_s"], marker="o", label=config, color=colors[config])
    gpus = ", ".join(sorted(ok["gpu_profile"].dropna().unique())) if "gpu_profile" in ok else ""
    for ax, label in ((step_ax, "step time, median (ms; bars p10–p90)"), (tps_ax, "tokens / s")):
        seq_axis(ax, ok["seq_len"])
        ax.set_ylabel(label)
        ax.set_title(label.split(",")[0].capitalize() + measurement_note(frame) + (f" on {gpus}" if gpus else ""))
    legend(tps_ax)
    return fig


def scaling_figure(frame: pd.DataFrame) -> Figure:
    """Speed-up and memory ratio against cp=1 of the same point, vs sequence length."""
    fig = Figure(figsize=(10, 5), layout="constrained")
    speed_ax, mem_ax = fig.subplots(1, 2)
    ratios = ratios_vs_cp1(frame).sort_values("seq_len")
    if ratios.empty:
        empty(speed_ax, "no cp > 1 point has an ok cp=1 counterpart")
        empty(mem_ax, "")
        return fig
    timed = bool(ratios["speedup"].notna().any())
    colors = config_colors(frame)
    for config in dict.fromkeys(ratios["config"]):
        r, color = ratios[ratios["config"] == config], colors.get(config)
        if timed:
            speed_ax.plot(r["seq_len"], r["speedup"], marker="o", label=config, color=color)
        mem_ax.plot(r["seq_len"], r["memory_ratio"], marker="o", label=f"{config}: peak", color=color)
        mem_ax.plot(r["seq_len"], r["activations_ratio"], marker=".", linestyle=":", color=color,
                    label=f"{config}: activations")
    for cp in sorted(ratios["cp_size"].unique()):
        mem_ax.axhline(1.0 / cp, color="grey", linestyle="--", label=f"ideal activations 1/{cp}")
    mem_ax.set_ylabel("memory vs cp=1 (ratio of per-rank peaks)")
    mem_ax.set_title("Memory against cp=1" + measurement_note(frame))
    panels = (speed_ax, mem_ax) if timed else (mem_ax,)
    if timed:
        speed_ax.axhline(1.0, color="grey", linestyle="--")
        speed_ax.set_ylabel("speed-up vs cp=1 (cp=1 step time / step time)")
    else:
        empty(speed_ax, "no speed-up: no point was timed (a projection has no time)")
    for ax in panels:
        seq_axis(ax, ratios["seq_len"])
    legend(mem_ax)
    return fig


def breakdown_figure(frame: pd.DataFrame) -> Figure:
    """The peak of the highest rank split into parameters, gradients, optimizer state and activations; where an
    offload lever put anything on the host, a second (hatched) bar beside it: that rank's host peak, split alike."""
    ok = _ok(frame)
    fig = Figure(figsize=(_width(len(ok)), 5), layout="constrained")
    ax = fig.add_subplot()
    if ok.empty:
        empty(ax, "no point finished ok")
        return fig
    ok = ok.sort_values(["config_order", "seq_len"])
    x = np.arange(len(ok))
    host = "host_peak_bytes" in ok and (ok["host_peak_bytes"].fillna(0) > 0).any()
    width = 0.4 if host else 0.8
    colors = {}
    bottom = np.zeros(len(ok))
    for column, label in BREAKDOWN:
        values = ok[column].fillna(0).to_numpy(dtype=float) / GIB
        bars = ax.bar(x - width / 2 if host else x, values, width, bottom=bottom, label=f"device: {label}" if host
                      else label)
        colors[column] = bars.patches[0].get_facecolor() if bars.patches else None
        bottom += values
    if host:
        bottom = np.zeros(len(ok))
        for column, label in HOST_BREAKDOWN:
            values = ok[column].fillna(0).to_numpy(dtype=float) / GIB
            ax.bar(x + width / 2, values, width, bottom=bottom, label=f"host: {label}", hatch="//",
                   color=colors.get(column.replace("host_", "")), edgecolor="white")
            bottom += values
    ticks(ax, "x", x, [f"{c}\n{seq_label(s)}" for c, s in zip(ok["config"], ok["seq_len"])], rotation=90)
    ax.set_ylabel("GiB (rank with the highest peak)")
    ax.set_title(("Memory breakdown at the peak: device (left) and host (right, hatched)" if host
                  else "Memory breakdown at the peak") + measurement_note(frame))
    legend(ax)
    return fig


def parity_figure(frame: pd.DataFrame) -> Figure:
    """Each point's loss, logits and gradient error as a fraction of its tolerance (log; 1 = the tolerance)."""
    labelled = with_config(frame)  # labels from the whole run, as every other figure has them
    judged = labelled[labelled["parity_status"].isin(["pass", "fail"])].sort_values(["config_order", "seq_len"])
    fig = Figure(figsize=(_width(len(judged)), 5), layout="constrained")
    ax = fig.add_subplot()
    if judged.empty:
        empty(ax, "no point has a parity verdict")
        return fig
    x = np.arange(len(judged))
    fractions = [(judged[error] / judged[tolerance]).to_numpy(dtype=float) for error, tolerance, _ in PARITY]
    finite = np.concatenate([f[np.isfinite(f)] for f in fractions])
    top = max(10.0, 2 * finite.max()) if finite.size else 10.0  # where an infinite error is drawn
    for offset, fraction, (_, _, label) in zip((-0.2, 0.0, 0.2), fractions, PARITY):
        shown = np.isfinite(fraction)  # a NaN (not measured, e.g. the logits of a chunked loss) is not drawn
        ax.scatter(x[shown] + offset, np.clip(fraction[shown], FLOOR, None), label=label)
        infinite = np.isinf(fraction)
        if infinite.any():
            ax.scatter(x[infinite] + offset, [top] * int(infinite.sum()), marker="^", color="red",
                       label=f"{label}: infinite error")
    failed = np.flatnonzero(judged["parity_status"].to_numpy() == "fail")
    if len(failed):
        ax.scatter(failed, [1.5] * len(failed), marker="x", color="red", s=80, label="parity failed")
    ax.axhline(1.0, color="red", linestyle="--", label="tolerance")
    ax.set_yscale("log")
    ax.set_ylabel(f"error / tolerance (0 drawn at {FLOOR:g})")
    ticks(ax, "x", x, [f"{c}\n{seq_label(s)}" for c, s in zip(judged["config"], judged["seq_len"])], rotation=90)
    ax.set_title("Parity against the unsharded reference")
    legend(ax)
    return fig


def fit_figure(frame: pd.DataFrame) -> Figure:
    """The largest sequence length that finished ok, per configuration."""
    fits = largest_fit(frame)
    fig = Figure(figsize=(8, min(0.5 * len(fits) + 2, MAX_INCHES)), layout="constrained")
    ax = fig.add_subplot()
    if fits.empty or fits["largest_ok_seq_len"].isna().all():
        empty(ax, "no point finished ok")
        return fig
    y = np.arange(len(fits))
    ax.barh(y, fits["largest_ok_seq_len"].fillna(0).astype(float))
    for i, (ok, failed, host) in enumerate(zip(fits["largest_ok_seq_len"], fits["first_failed_seq_len"],
                                               fits["host_node_peak_bytes"])):
        note = f"{ok:,}" if pd.notna(ok) else "none"
        note += f"  (failed at {failed:,})" if pd.notna(failed) else "  (no failure in the sweep)"
        note += f"  host/node {human_bytes(host)}" if pd.notna(host) and host > 0 else ""
        ax.text(0, i, " " + note, va="center", fontsize="small")
    ticks(ax, "y", y, fits["config"])
    ax.set_xlabel("largest sequence length that fits (tokens)")
    ax.set_title("Largest sequence length that fits" + measurement_note(frame))
    return fig


FIGURES = {"memory": memory_figure, "time": time_figure, "scaling": scaling_figure,
           "memory_breakdown": breakdown_figure, "parity": parity_figure, "largest_fit": fit_figure}


def nothing_to_show(fig: Figure) -> str | None:
    """Why a figure shows nothing (the message it carries in place of its axes), or None when it shows data."""
    if any(ax.axison for ax in fig.axes):
        return None
    return "; ".join(t.get_text() for ax in fig.axes for t in ax.texts if t.get_text()) or "nothing to show"


def png_bytes(fig: Figure, dpi: int = 100) -> bytes:
    """The figure as PNG bytes (a notebook shows them with IPython.display.Image, whatever its backend)."""
    buffer = io.BytesIO()
    axes.save(fig, buffer, format="png", dpi=dpi)
    return buffer.getvalue()
