"""What the report's figures share about their axes: the sequence-length axis, the message an empty axes shows, tick
labels and the legend — each sized so that the figure grows around them instead of squeezing its axes.

A run of many configurations has long labels (`cp 4 · flash_attention_2 · cp_ring_zigzag · fsdp_size=8 · …`) and
many of them. Constrained layout keeps the tick labels and a legend beside the axes out of the data by shrinking the
axes; when they need more room than the figure has, the axes shrink to nothing and matplotlib gives up the layout
("axes sizes collapsed to zero"). So labels are wrapped between their parts, and the figure is made as large as its
ticks and legend need (up to `MAX_INCHES`), from their line counts and lengths in the font they are drawn in.
"""

from __future__ import annotations

import math
import textwrap

import matplotlib as mpl
import numpy as np
import pandas as pd
from matplotlib.font_manager import FontProperties
from matplotlib.ticker import FuncFormatter, NullFormatter

from .derive import SEPARATOR
from .units import seq_label

WRAP = 40  # characters per line of a wrapped label: a column of legend that still leaves the data most of a page
MAX_INCHES = 40.0  # a figure grows to hold its labels up to this (4000 pixels at the page's 100 dpi), no further
TALL = 9.0  # a legend taller than its figure makes the figure up to this tall before it takes more columns
CHAR_EM = 0.62  # a character's advance in DejaVu Sans (matplotlib's default), a little over its average: never short
LINE_EM = 1.3  # a line of a multi-line text, as matplotlib lays it out (1.2 times the height of "lp")
GAP_EM = 0.5  # between two tick labels
DATA_INCHES = 4.0  # what the data keeps across the axis whose tick labels grow
MARGIN_INCHES = 1.2  # a title, an axis label and the other axis's tick labels


def seq_axis(ax, lengths, label: str = "sequence length (tokens)") -> None:
    """A log-2 axis of sequence lengths read 16k, 32k, 1M, spanning `lengths` (the points the figure is about, drawn
    or not: a figure whose values are all NaN still has an axis to stand on)."""
    ax.set_xscale("log", base=2)
    lengths = [float(v) for v in lengths if pd.notna(v) and v > 0]
    if lengths:
        ax.set_xlim(min(lengths) / 1.5, max(lengths) * 1.5)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: seq_label(x)))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(label)
    ax.grid(True, alpha=0.3)


def empty(ax, message: str) -> None:
    """The axes off and `message` in their place (plots.nothing_to_show reads it back as the reason)."""
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


def wrap(label: str, width: int = WRAP) -> str:
    """`label` in lines of at most `width` characters, broken between the parts a label is joined from (each broken
    line ends in the separator, so it reads as continued); a part longer than a line is broken between its words,
    never inside one. Lines the label already has stay lines."""
    lines = []
    for line in str(label).split("\n"):
        parts = line.split(SEPARATOR)
        current = parts[0]
        for part in parts[1:]:
            if len(current) + len(SEPARATOR) + len(part) <= width:
                current += SEPARATOR + part
            else:
                lines.append(current + SEPARATOR.rstrip())
                current = part
        lines.append(current)
    return "\n".join(piece for line in lines for piece in (
        textwrap.wrap(line, width, break_long_words=False, break_on_hyphens=False) if len(line) > width else [line]))


def _em(fontsize) -> float:
    """Inches of one em of `fontsize` ("small", 8, ...), as rcParams make it."""
    return FontProperties(size=fontsize).get_size_in_points() / 72


def _extent(labels: list[str]) -> tuple[int, int]:
    """(lines of the tallest label, characters of the longest line)."""
    lines = [label.split("\n") for label in labels] or [[""]]
    return max(map(len, lines)), max(len(line) for label in lines for line in label)


def grow(fig, width: float = 0.0, height: float = 0.0) -> None:
    """Make `fig` at least `width` x `height` inches (never more than MAX_INCHES either way); it never shrinks."""
    w, h = fig.get_size_inches()
    fig.set_size_inches(min(max(w, width), MAX_INCHES), min(max(h, height), MAX_INCHES))


def save(fig, target, **kwargs) -> None:
    """`fig.savefig(target, ...)`, grown (1.5 times a try, up to MAX_INCHES) while the constrained layout finds its
    axes squeezed to nothing by their labels and legends, as matplotlib warns; past that, saved without the layout
    and cropped to what it draws, so no figure is written collapsed. The save itself is watched (a layout tried
    without pixels can fit where the rendered one collapses, at the edge), and a file-like target is rewound before
    it is written again."""
    import warnings

    for _ in range(4):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fig.savefig(target, **kwargs)
        if not _collapsed(caught):
            for w in caught:  # what else the save said, said again outside the catch
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            return
        if hasattr(target, "seek"):
            target.seek(0)
            target.truncate()
        w, h = fig.get_size_inches()
        if w >= MAX_INCHES and h >= MAX_INCHES:
            break
        grow(fig, w * 1.5, h * 1.5)
    fig.set_layout_engine("none")
    fig.savefig(target, bbox_inches="tight", **kwargs)


def _collapsed(caught) -> bool:
    return any("collapsed to zero" in str(w.message) for w in caught)


def _tick_layout(labels: list[str], along_lines: bool) -> tuple[str, list[str], float, float]:
    """(font size, wrapped labels, inches each tick needs along the axis, inches the labels need across it): the
    largest font and narrowest wrap whose ticks fit side by side within MAX_INCHES, else the smallest and widest."""
    for fontsize in ("small", "x-small"):
        em = _em(fontsize)
        for width in (WRAP, 2 * WRAP, 3 * WRAP):
            shown = [wrap(label, width) for label in labels]
            lines, chars = _extent(shown)
            tall, long = lines * LINE_EM * em, chars * CHAR_EM * em
            along, across = (tall, long) if along_lines else (long, tall)
            layout = fontsize, shown, along + GAP_EM * em, across
            if (len(shown) + 1) * layout[2] <= MAX_INCHES - MARGIN_INCHES:  # +1: the axis's margins at its ends
                return layout
    return layout


def ticks(ax, axis: str, positions, labels, *, rotation: int = 0) -> None:
    """Tick labels on `axis` ("x" or "y"), wrapped between their parts (`_tick_layout`), and a figure that holds
    them: along the axis, each tick the height of its lines (a label read across the axis, e.g. rotated on x) or its
    characters (a label read along it); across it, the other, beside DATA_INCHES for the data."""
    along_lines = (axis == "x") == (rotation % 180 != 0)
    fontsize, shown, along, across = _tick_layout([str(label) for label in labels], along_lines)
    span, depth = (len(shown) + 1) * along + MARGIN_INCHES, DATA_INCHES + across + MARGIN_INCHES
    if axis == "x":
        ax.set_xticks(positions, shown, rotation=rotation, fontsize=fontsize)
        grow(ax.figure, width=span, height=depth)
    else:
        ax.set_yticks(positions, shown, rotation=rotation, fontsize=fontsize)
        grow(ax.figure, width=depth, height=span)


def _legend_layout(shown: list[str], em: float, fig_width: float, fig_height: float) -> tuple[float, int, float]:
    """(figure height, columns, legend width in inches) for legend labels `shown`: one column as tall as TALL allows,
    then more columns; taller still where the columns would leave the data less than DATA_INCHES of MAX_INCHES."""
    rc = mpl.rcParams
    heights = np.array([(s.count("\n") + 1) * LINE_EM + rc["legend.labelspacing"] for s in shown]) * em
    pad = 2 * (rc["legend.borderpad"] + 0.5) * em  # the frame's padding, top and bottom
    for tallest in (TALL, 2 * TALL, MAX_INCHES):
        height = max(fig_height, min(heights.sum() + pad + MARGIN_INCHES, tallest))
        ncols = next((n for n in range(1, len(shown) + 1)  # matplotlib fills columns as np.array_split splits entries
                      if max(c.sum() for c in np.array_split(heights, n)) + pad <= height - MARGIN_INCHES), len(shown))
        chars = [max(len(line) for s in column for line in s.split("\n"))
                 for column in np.array_split(np.array(shown, dtype=object), ncols)]
        width = (sum(chars) * CHAR_EM + ncols * (rc["legend.handlelength"] + rc["legend.handletextpad"])
                 + (ncols - 1) * rc["legend.columnspacing"] + 2 * rc["legend.borderpad"] + 1) * em  # +1: off the axes
        if fig_width + width <= MAX_INCHES - DATA_INCHES:
            break
    return height, ncols, math.ceil(width * 10) / 10


def legend(ax):
    """The axes' legend beside them, never over the data; one entry per label (the first artist drawn with it: a
    configuration drawn as many bars or lines is listed once), labels wrapped between their parts, in as many columns
    as the figure's height needs. The figure grows by the legend's width (and, for a long legend, in height first),
    so the axes keep theirs. None when nothing on the axes has a label."""
    entries = {}
    for handle, label in zip(*ax.get_legend_handles_labels()):
        entries.setdefault(label, handle)
    if not entries:
        return None
    fontsize = "small" if len(entries) <= 20 else "x-small"
    shown = [wrap(label) for label in entries]
    width, height = ax.figure.get_size_inches()
    height, ncols, extra = _legend_layout(shown, _em(fontsize), width, height)
    grow(ax.figure, width=width + extra, height=height)
    return ax.legend(list(entries.values()), shown, fontsize=fontsize, ncols=ncols, loc="upper left",
                     bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


OFF_SCALE = 8.0  # a reference line over this many times the data's largest value is named, not drawn (flattens them)


def reference_line(ax, y: float, label: str, largest: float, value: str) -> None:
    """A horizontal reference (a memory capacity) at `y`, labelled; one over OFF_SCALE times the `largest` value drawn
    is only named in the legend (`value`: as a reader reads it), so the data keep the axis."""
    if largest > 0 and y > OFF_SCALE * largest:
        ax.plot([], [], color="red", linestyle="--", label=f"{label}: {value}, off the scale above")
        return
    ax.axhline(y, color="red", linestyle="--", label=label)


# Markers cycled per configuration, so that series drawn on top of one another still show as several.
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
DODGE = 0.035  # log2 units between neighbouring configurations at one length (about 2.5 % of the length)


def dodged(lengths, index: int, count: int):
    """`lengths` moved sideways for configuration `index` of `count` on a log-2 length axis: points of several
    configurations at one length (equal values included) stand side by side instead of on top of each other."""
    return np.asarray(lengths, dtype=float) * 2.0 ** ((index - (count - 1) / 2) * DODGE)


def line_style(lengths) -> str:
    """A line joins a configuration's lengths; a run of one length draws its points alone."""
    return "-" if len(set(lengths)) > 1 else "none"
