"""The gate's rules file: the committed one parses; a wrong one is refused naming the field and the fix."""

from pathlib import Path

import pytest

from cpbench.report.gate_rules import load_rules, parse_rules

COMMITTED = Path(__file__).parents[2] / "results" / "baselines" / "gate-rules.toml"


def test_the_committed_rules_cover_memory_parity_and_time():
    rules = {r.metric: r for r in load_rules(COMMITTED)}
    assert rules["peak_bytes"].threshold == 0.0 and rules["peak_bytes"].action == "fail"
    assert rules["grad_max_rel_err"].direction == "lower"
    assert rules["step_times_s"].test == "mannwhitney"


@pytest.mark.parametrize("text, match", [
    ('[metrics.peak_byte]\ndirection = "lower"', "'peak_byte' is not a column"),
    ('[metrics.peak_bytes]\ndirection = "smaller"', "direction = 'smaller': must be one of 'lower', 'higher'"),
    ('[metrics.peak_bytes]\nthreshold = -1', "threshold = -1: must be a number >= 0"),
    ('[metrics.peak_bytes]\ntreshold = 0.1', r"unknown keys \['treshold'\]"),
    ('[metrics.step_times_s]\ndirection = "lower"', 'set test = "mannwhitney"'),
    ('[metrics.peak_bytes]\ntest = "mannwhitney"', "remove `test`"),
    ('[metric.peak_bytes]\ndirection = "lower"', r"unknown tables \['metric'\]"),
    ("", "no \\[metrics.<column>\\] tables"),
])
def test_bad_rules_name_the_field_and_the_fix(text, match):
    with pytest.raises(ValueError, match=match):
        parse_rules(text)


def test_a_missing_rules_file_says_how_to_pass_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="--rules"):
        load_rules(tmp_path / "gate-rules.toml")


def test_the_shipped_default_rules_are_the_committed_ones():
    from cpbench.report.gate_rules import DEFAULT_RULES

    assert DEFAULT_RULES.read_text() == COMMITTED.read_text()  # one set of rules, shipped inside the package too
