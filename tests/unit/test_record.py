"""The time model's record against published measurements (record.py): what `cpbench estimate` and `plan` print of
each regime among their points."""

from __future__ import annotations

from cpbench.harness.project import record

ROWS = [{"name": "a", "tokens_per_gpu": 8192, "gpus": 8, "cp": 1, "step_error": -0.17},
        {"name": "b", "tokens_per_gpu": 65536, "gpus": 64, "cp": 1, "step_error": -0.10},
        {"name": "c", "tokens_per_gpu": 131072, "gpus": 8, "cp": 8, "step_error": -0.03},
        {"name": "d", "tokens_per_gpu": 524288, "gpus": 32, "cp": 32, "step_error": 0.036},
        {"name": "e", "tokens_per_gpu": 512, "gpus": 1, "cp": 1, "step_error": -0.0176}]


def test_the_record_tells_each_regime_of_the_points_its_own_measurements():
    lines = record.record_lines([(16384, 8), (8192, 64), (131072, 8), (2048, 1)], ROWS)
    assert lines == [
        # 64k itself is short, as table.md counts it; the rows' cp sizes say what judged the regime
        "<= 64k tokens per GPU on several GPUs: 2 published measurements (cp 1), projected steps 10 to 17 % shorter "
        "than measured (mean 14 % shorter)",
        "<= 64k tokens per GPU on one GPU: 1 published measurement (cp 1), projected steps 2 % shorter than measured "
        "(mean 2 % shorter)",
        "over 64k tokens per GPU on several GPUs: 2 published measurements (cp 8 to 32), projected steps 3 % shorter "
        "to 4 % longer than measured (mean 0.3 % longer)",  # under 1 %: a decimal, so its sign means something
    ]


def test_a_regime_no_published_row_judges_is_said_to_be_unchecked():
    assert record.record_lines([(131072, 1)], ROWS) == [
        "over 64k tokens per GPU on one GPU: no published measurement of this regime is judged; the step time is "
        "unchecked here"]


def test_the_shipped_record_loads_and_covers_both_lengths():
    rows = record.record()  # results/published/table.py writes it; test_published.py holds it to the stored runs
    assert {record.regime(r["tokens_per_gpu"], r["gpus"]) for r in rows} >= {(True, True), (False, True)}
    assert all(-1 < r["step_error"] < 1 and r["cp"] >= 1 for r in rows)
