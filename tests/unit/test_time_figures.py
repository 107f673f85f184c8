"""docs/time.md shows the shipped GPU profiles and every assumed figure as gpus.toml has them (figures.py), each
assumed one with what would measure it."""

from __future__ import annotations

from pathlib import Path

from cpbench.harness.project import figures
from cpbench.harness.project.hardware import builtin

DOC = (Path(__file__).parents[2] / "docs" / "time.md").read_text()


def test_the_docs_show_the_profiles_and_every_assumed_figure_as_shipped():
    assert figures.profiles_table() in DOC, "regenerate: python -m cpbench.harness.project.figures"
    assert figures.assumed_table() in DOC, "regenerate: python -m cpbench.harness.project.figures"


def test_every_assumed_figure_says_what_would_measure_it():
    # test_efficiency.py holds every figure to a source; here, the assumed ones to a way of measuring them
    for name, hw in builtin().items():
        assert all(figures.source_of(hw, figure) for figure in hw.efficiency), name
    assumed = figures.figures()
    assert {"memory", "host_gb_s"} <= {f for _, f, _ in assumed}  # assumed today: the table is not empty by accident
    for _, figure, _ in assumed:
        assert figures.how(figure)


def test_a_figure_nobody_says_how_to_measure_is_an_error():
    import pytest

    with pytest.raises(KeyError, match="add how a GPU run would measure it"):
        figures.how("warp_speed")
