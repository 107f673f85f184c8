"""The report's figures (matplotlib's object API on the Agg canvas: no pyplot state, no display needed).

Each `*_figure(frame)` returns a Figure (a notebook shows it; `page.save_figures` writes PNGs, and leaves out a figure
with nothing to show, saying why: the message the figure would have shown, `nothing_to_show`). A memory axis is in the
unit its values read best in (MiB for a tiny model, GiB for a real one) and time in ms (rendering only); the data stays
in bytes and seconds. A configuration has one colour and one marker in every figure of a run (`config_colors`), and
its points stand a little aside from the other configurations' at the same length (`axes.dodged`), so that equal
values stay visible; sequence lengths read 16k, 32k, 1M, and legends stand outside the data. Tick labels and legends go through `axes`, which wraps long labels and grows a figure around them: each
figure is created at the size of its data alone.
"""

from __future__ import annotations

import io

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.figure import Figure

from . import axes
from .axes import MARKERS, MAX_INCHES, dodged, empty, legend, line_style, reference_line, seq_axis, ticks
from .derive import largest_fit, measurement_note, ordered_configs, ratios_vs_cp1, with_config, with_projected_time
from .units import byte_unit, human_bytes, seq_label

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
    """The memory line to draw: an explicit capacity (bytes, e.g. `report --device-memory` through
    units.parse_bytes), else the run's own (a sweep's memory budget, an estimate's --device-memory or --gpu)."""
    if explicit is not None:
        return float(explicit), "device capacity (report --device-memory)"
    budgets = frame["memory_budget_bytes"].dropna()
    return (float(budgets.max()), "capacity per rank the run was checked against") if len(budgets) else None


def _marker(config: str, colors: dict) -> str:
    return MARKERS[list(colors).index(config) % len(MARKERS)] if config in colors else "x"


def _aside(lengths, config: str, colors: dict):
    """The lengths of `config`'s points, moved aside by its place among the run's configurations (axes.dodged)."""
    return dodged(lengths, list(colors).index(config) if config in colors else 0, max(len(colors), 1))


def memory_figure(frame: pd.DataFrame, capacity: float | None = None) -> Figure:
    """Peak memory per rank vs sequence length, one line (max over ranks) per configuration, every rank a dot."""
    fig = Figure(figsize=(8, 5), layout="constrained")  # the data's width: the legend widens it
    ax = fig.add_subplot()
    ok, colors = _ok(frame), config_colors(frame)
    labelled = with_config(frame)
    if ok.empty and not labelled["status"].isin(["oom", "error", "timeout"]).any():
        empty(ax, "no point finished ok")
        return fig
    line = capacity_bytes(frame, capacity)
    peaks = [*ok["peak_bytes"], *labelled.loc[labelled["status"] == "oom", "peak_bytes"].dropna()]
    size, unit = byte_unit(peaks)
    for config in ordered_configs(ok) if len(ok) else []:
        points = ok[ok["config"] == config]
        x = _aside(points["seq_len"], config, colors)
        ax.plot(x, points["peak_bytes"] / size, marker=_marker(config, colors), linestyle=line_style(x), label=config,
                color=colors[config])
        for at, ranks in zip(x, points["peak_bytes_per_rank"]):
            if ranks is not None and len(ranks):
                ax.scatter([at] * len(ranks), np.asarray(ranks) / size, s=10, color=colors[config], alpha=0.5)
    _mark_failures(ax, labelled, colors, size)
    if line:
        reference_line(ax, line[0] / size, line[1], max(peaks, default=0) / size, human_bytes(line[0]))
    seq_axis(ax, labelled["seq_len"])
    ax.set_ylim(bottom=0)
    ax.set_ylabel(f"peak memory per rank ({unit})")
    ax.set_title("Peak memory per rank (line: max over ranks, dots: each rank)" + measurement_note(frame))
    legend(ax)
    return fig


def _mark_failures(ax, frame: pd.DataFrame, colors: dict, size: float) -> None:
    """An out-of-memory point with a peak (a projection's, or a measured one over the budget) at that peak, in its
    configuration's colour; a point without one (error, timeout) on the top edge."""
    failed = frame[frame["status"].isin(["oom", "error", "timeout"])]
    at_peak = failed[(failed["status"] == "oom") & failed["peak_bytes"].notna()]
    for config, points in at_peak.groupby("config", sort=False):
        ax.scatter(_aside(points["seq_len"], config, colors), points["peak_bytes"] / size, marker="x", s=70,
                   color=colors.get(config, "red"), label=f"{config}: out of memory (at its peak)")
    edge = failed.drop(at_peak.index)
    if len(edge):
        ax.scatter(edge["seq_len"], [0.97] * len(edge), marker="x", color="red", s=60,
                   transform=ax.get_xaxis_transform(), label="out of memory / error / timeout")


def time_figure(frame: pd.DataFrame) -> Figure:
    """Median step time (p10–p90 bars where steps were measured) and tokens/s per GPU vs sequence length."""
    fig = Figure(figsize=(10, 5), layout="constrained")
    step_ax, tps_ax = fig.subplots(1, 2)
    ok = _ok(with_projected_time(frame)).dropna(subset=["step_time_median_s"])
    if ok.empty:
        empty(step_ax, "no timed point (a projection has time only on a GPU profile: estimate --gpu)"
              if measurement_note(frame) else "no point finished ok")
        empty(tps_ax, "")
        return fig
    colors = config_colors(frame)
    measured = bool((ok["measurement"] != "projected").any()) if "measurement" in ok else True
    for config in ordered_configs(ok):
        p = ok[ok["config"] == config]
        x, marker = _aside(p["seq_len"], config, colors), _marker(config, colors)
        median = p["step_time_median_s"] * 1e3
        spread = [median - p["step_time_p10_s"] * 1e3, p["step_time_p90_s"] * 1e3 - median]
        step_ax.errorbar(x, median, yerr=np.clip(np.asarray(spread, dtype=float), 0, None), marker=marker,
                         linestyle=line_style(x), capsize=3, label=config, color=colors[config])
        tps_ax.plot(x, p["tokens_per_s"] / p["world_size"].clip(lower=1), marker=marker, linestyle=line_style(x),
                    label=config, color=colors[config])
    on = _on_gpus(ok)
    for ax, title, label in ((step_ax, "Step time", "step time, median (ms" + ("; bars p10–p90)" if measured
                                                                               else ")")),
                             (tps_ax, "Tokens/s per GPU", "tokens / s per GPU (the global batch's over the ranks)")):
        seq_axis(ax, ok["seq_len"])
        ax.set_ylim(bottom=0)  # a difference of 7 % reads as 7 %
        ax.set_ylabel(label)
        ax.set_title(title + measurement_note(frame) + on)
    legend(tps_ax)
    return fig


def _on_gpus(frame: pd.DataFrame) -> str:
    """" on h100-sxm" for a figure whose times are priced on GPU profiles; "" for measured times."""
    timed = frame[frame["measurement"] == "projected"] if "measurement" in frame else frame.iloc[:0]
    names = sorted(timed["gpu_profile"].dropna().unique()) if "gpu_profile" in timed else []
    return f" on {', '.join(names)}" if names else ""


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
        r, color, marker = ratios[ratios["config"] == config], colors.get(config), _marker(config, colors)
        x = _aside(r["seq_len"], config, colors)
        if timed:
            speed_ax.plot(x, r["speedup"], marker=marker, linestyle=line_style(x), label=config, color=color)
        mem_ax.plot(x, r["memory_ratio"], marker=marker, linestyle=line_style(x), label=f"{config}: peak",
                    color=color)
        mem_ax.plot(x, r["activations_ratio"], marker=".", linestyle=":" if line_style(x) == "-" else "none",
                    color=color, label=f"{config}: activations")
    for cp in sorted(ratios["cp_size"].unique()):
        mem_ax.axhline(1.0 / cp, color="grey", linestyle="--", label=f"ideal activations 1/{cp}")
    mem_ax.set_ylabel("memory vs cp=1 (ratio of per-rank peaks)")
    mem_ax.set_title("Memory against cp=1" + measurement_note(frame))
    panels = (speed_ax, mem_ax) if timed else (mem_ax,)
    if timed:
        speed_ax.axhline(1.0, color="grey", linestyle="--")
        speed_ax.set_ylabel("speed-up vs cp=1 (cp=1 step time / step time)")
        speed_ax.set_title("Speed-up against cp=1" + measurement_note(frame) + _on_gpus(with_projected_time(frame)))
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
    size, unit = byte_unit([*ok["peak_bytes"], *(ok["host_peak_bytes"] if "host_peak_bytes" in ok else [])])
    host = "host_peak_bytes" in ok and (ok["host_peak_bytes"].fillna(0) > 0).any()
    width = 0.4 if host else 0.8
    colors = {}
    bottom = np.zeros(len(ok))
    for column, label in BREAKDOWN:
        values = ok[column].fillna(0).to_numpy(dtype=float) / size
        bars = ax.bar(x - width / 2 if host else x, values, width, bottom=bottom, label=f"device: {label}" if host
                      else label)
        colors[column] = bars.patches[0].get_facecolor() if bars.patches else None
        bottom += values
    if host:
        bottom = np.zeros(len(ok))
        for column, label in HOST_BREAKDOWN:
            values = ok[column].fillna(0).to_numpy(dtype=float) / size
            ax.bar(x + width / 2, values, width, bottom=bottom, label=f"host: {label}", hatch="//",
                   color=colors.get(column.replace("host_", "")), edgecolor="white")
            bottom += values
    ticks(ax, "x", x, [f"{c}\n{seq_label(s)}" for c, s in zip(ok["config"], ok["seq_len"])], rotation=90)
    ax.set_ylabel(f"{unit} (rank with the highest peak)")
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
    if fits["first_failed_seq_len"].isna().all() and fits["largest_ok_seq_len"].nunique() == 1:
        empty(ax, f"every configuration ran every length, the longest ({fits['largest_ok_seq_len'].iloc[0]:,} "
                  "tokens) included: nothing failed to set a limit")
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
