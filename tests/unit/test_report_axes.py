"""The figures' shared axes helpers (cpbench/report/axes.py) and what they are for: a run of many configurations
with long labels still gets its constrained layout in every figure (matplotlib gives up on it, with a warning,
when the tick labels or the legend leave the axes no room), long labels wrap between their parts, and a legend
keeps one entry per label."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest

from cpbench.report import page, plots
from cpbench.report.peers import peers_figure
from tests.report_fixtures import make_run

COLLAPSED = "constrained_layout not applied"  # how matplotlib says it gave up the layout, for whatever reason
# Every key column a variant sets differs between the two variants, so every one is in a configuration's label.
VARIANTS = ({"fsdp_size": 1, "loss_mode": "full", "activation_checkpointing": False, "tiled_mlp": "off",
             "offload_activations": False, "documents": "long-sft", "recompute_every_n_layers": 1},
            {"fsdp_size": 8, "loss_mode": "chunked", "activation_checkpointing": True, "tiled_mlp": "auto",
             "offload_activations": True, "documents": "lengths:0a1b2c", "recompute_every_n_layers": 2})


def many_configurations() -> pd.DataFrame:
    """30 configurations (3 backends x (cp 1 + cp 2, 4 x 2 styles) x 2 variants), each label ~150 characters,
    packed batches with per-rank attention work, one out-of-memory point per cp 1 line."""
    base = make_run(seq_lens=(1024, 4096), cp_sizes=(1, 2, 4), styles=("cp_ring_zigzag", "cp_ulysses"),
                    backends=("sdpa", "flash_attention_2", "flex_attention"), oom_cp1_at=4096)
    parts = []
    for variant in VARIANTS:
        part = base.assign(batch_kind="packed", **variant)
        ok = part["status"] == "ok"
        part["attention_pairs_per_rank"] = [
            [float(s) * (1 + 0.1 * r) for r in range(cp)] if yes and cp > 1 else None
            for s, cp, yes in zip(part["seq_len"], part["cp_size"], ok)]
        part["attention_imbalance"] = np.where(ok & (part["cp_size"] > 1), 1.1, np.nan)
        parts.append(part)
    return pd.concat(parts, ignore_index=True)


def _every_figure(frame: pd.DataFrame):
    for name, draw in page.FIGURES.items():
        yield name, draw(frame, 0.25 * 1024**3) if name == "memory" else draw(frame)
    yield "peers", peers_figure(frame)


@pytest.mark.heavy  # every page figure at 30 configurations, ~12 s: run by .ci/run, not by the README's command
def test_many_configurations_with_long_labels_collapse_no_figure():
    frame = many_configurations()
    assert len(plots.config_colors(frame)) == 30
    assert min(len(c) for c in plots.config_colors(frame)) > 120
    for name, fig in _every_figure(frame):
        assert plots.nothing_to_show(fig) is None, name
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plots.png_bytes(fig, dpi=30)  # the layout is in inches and points: the same at any dpi
        gave_up = [str(w.message) for w in caught if COLLAPSED in str(w.message)]  # "axes sizes collapsed to zero"
        assert not gave_up, (name, gave_up)


def test_a_long_label_wraps_between_its_parts_never_inside_one():
    from cpbench.report.axes import wrap

    label = ("cp 4 · flash_attention_2 · cp_ring_zigzag · fsdp_size=8 · loss_mode=chunked · "
             "activation_checkpointing=True · offload_activations=True\n16k")
    lines = wrap(label, 40).split("\n")
    assert all(len(line) <= 42 for line in lines)  # 40 and the separator that says the line goes on
    assert lines[-1] == "16k"  # a line the label had stays a line
    assert [line.removesuffix(" ·") for line in lines[:-1]] == [
        "cp 4 · flash_attention_2", "cp_ring_zigzag · fsdp_size=8", "loss_mode=chunked",
        "activation_checkpointing=True", "offload_activations=True"]
    assert wrap("cp 2 · sdpa · cp_ring") == "cp 2 · sdpa · cp_ring"  # a short label stays as it is
    one_part = "lengths:0a1b2c3d4e5f6g7h8i9j0k1l2m3n4o5p6q7r8s9t"
    assert wrap(one_part, 10) == one_part  # never cut inside a word
    assert wrap("cp 1 · sdpa: out of memory (at its peak)", 20).split("\n") == [
        "cp 1 ·", "sdpa: out of memory", "(at its peak)"]  # a part longer than a line breaks between its words


def test_the_legend_keeps_one_entry_per_label_and_grows_the_figure_beside_the_axes():
    from matplotlib.figure import Figure

    from cpbench.report.axes import legend

    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.add_subplot()
    first = ax.plot([1, 2], [1, 2], label="cp 2 · sdpa · cp_ring")[0]
    for i in range(3):  # a configuration drawn as many bars is listed once, with the first artist drawn for it
        ax.bar([i], [1], label="cp 4 · sdpa · cp_ulysses")
    ax.plot([1, 2], [2, 1], label="cp 2 · sdpa · cp_ring")
    ax.plot([1, 2], [0, 0], label="_hidden")  # matplotlib's own convention: never listed
    drawn = legend(ax)
    assert [t.get_text() for t in drawn.get_texts()] == ["cp 2 · sdpa · cp_ring", "cp 4 · sdpa · cp_ulysses"]
    assert drawn.legend_handles[0].get_color() == first.get_color()
    assert fig.get_size_inches()[0] > 6  # beside the axes: the figure grew by the legend's width
    assert legend(Figure().add_subplot()) is None  # nothing labelled, no legend


def test_balance_lists_each_configuration_once():
    from cpbench.report.balance import balance_figure, packed_points

    frame = many_configurations()
    texts = [t.get_text().replace("\n", " ") for t in balance_figure(frame).axes[0].get_legend().get_texts()]
    drawn = list(dict.fromkeys(packed_points(frame)["config"]))  # two points each: two bar groups, one entry
    assert len(packed_points(frame)) > len(drawn)
    assert texts == drawn


def test_a_figure_whose_labels_squeeze_its_axes_away_is_grown_not_written_collapsed():
    import io
    import warnings

    from matplotlib.figure import Figure

    from cpbench.report import axes

    fig = Figure(figsize=(2, 1.5), layout="constrained")
    ax = fig.add_subplot()
    ax.plot([0, 1], [0, 1])
    ax.set_ylabel("\n".join(["a long label"] * 12))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "axes sizes collapsed to zero" fails here
        axes.save(fig, io.BytesIO(), format="png", dpi=50)
    assert fig.get_size_inches()[1] > 1.5


def test_a_figure_whose_layout_collapses_only_once_rendered_is_grown_and_written_whole(tmp_path):
    # At the edge, a layout that fits without pixels (draw_without_rendering) collapses once rendered: one vertical
    # tick label a few characters from filling a 10 x 4 figure (the analysis notebook's chart of changes, found by
    # the property tests with one point id of 56 characters). The save is watched too; the target written again.
    import io

    from matplotlib.figure import Figure
    from PIL import Image

    from cpbench.report import axes

    def chart(chars: int) -> Figure:
        fig = Figure(figsize=(10, 4), layout="constrained")
        ax = fig.add_subplot()
        ax.bar([0], [1.0], label="peak memory")
        ax.set_xticks([0], ["a" * chars], rotation=90, fontsize="small")
        ax.legend()
        return fig

    edge = []
    for chars in range(48, 60, 2):
        fig = chart(chars)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fig.draw_without_rendering()
        unrendered = any(COLLAPSED in str(w.message) for w in caught)
        buffer = io.BytesIO()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a collapse warning escaping the save fails here
            axes.save(fig, buffer, format="png", dpi=50)
        width, height = fig.get_size_inches()
        assert Image.open(io.BytesIO(buffer.getvalue())).size == (round(width * 50), round(height * 50))
        if not unrendered and (width, height) != (10, 4):
            edge.append(chars)  # fitted unrendered, collapsed rendered, grown: the case this is about
    assert edge, "no label length at the edge: the sweep no longer crosses it"
    path = tmp_path / "edge.png"  # a file named by its path is written again whole as well
    axes.save(chart(edge[0]), path, dpi=50)
    assert Image.open(path).size == (750, 300)
