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


ROWS = [{"name": "a", "tokens_per_gpu": 8192, "gpus": 8, "step_error": -0.17},
        {"name": "b", "tokens_per_gpu": 65536, "gpus": 64, "step_error": -0.10},
        {"name": "c", "tokens_per_gpu": 131072, "gpus": 8, "step_error": -0.05},
        {"name": "d", "tokens_per_gpu": 524288, "gpus": 32, "step_error": 0.03}]


def test_the_record_tells_each_regime_of_the_points_its_own_measurements():
    lines = figures.record_lines([(16384, 8), (8192, 64), (131072, 8), (2048, 1)], ROWS)
    assert lines == [
        "<= 64k tokens per GPU on several GPUs: 2 published measurements, projected steps 10 to 17 % shorter than "
        "measured (mean 14 % shorter)",  # 64k itself is short, as table.md counts it
        "<= 64k tokens per GPU on one GPU: no published measurement of this regime is judged; the step time is "
        "unchecked here",
        "over 64k tokens per GPU on several GPUs: 2 published measurements, projected steps 5 % shorter to 3 % longer "
        "than measured (mean 1 % shorter)",
    ]


def test_the_shipped_record_loads_and_covers_both_lengths():
    rows = figures.record()  # results/published/table.py writes it; test_published.py holds it to the stored runs
    assert {figures.regime(r["tokens_per_gpu"], r["gpus"]) for r in rows} >= {(True, True), (False, True)}
    assert all(-1 < r["step_error"] < 1 for r in rows)
