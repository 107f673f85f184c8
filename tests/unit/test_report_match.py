"""Matching points across runs: on the stored KEY_COLUMNS (not the harness's point_key hash); duplicates refused."""

import pandas as pd
import pytest

from cpbench.report.gate import GateRefusal, gate
from cpbench.report.runs.match import check_unique, match_points
from tests.report_fixtures import make_run

RING_512 = "llama-tiny/s512/cp2/sdpa/cp_ring"


def test_points_match_on_their_key_columns_whatever_point_key_holds():
    """An old run without point_key, or one hashed by another recipe, still matches point for point."""
    a = make_run(seed=0)
    b = make_run(seed=1).assign(point_key=None)
    c = make_run(seed=1).assign(point_key=lambda f: "other-recipe-" + f["point_key"])
    for other in (b, c):
        merged = match_points(a, other, ("_a", "_b"))
        assert (merged["_merge"] == "both").all() and len(merged) == len(a)
        assert (merged["point_id_a"] == merged["point_id_b"]).all()


def test_a_stale_point_key_does_not_make_two_points_one():
    run = make_run()
    run["point_key"] = "same"  # a writer bug must not merge distinct points
    check_unique(run, "run")
    assert len(match_points(run, run, ("_a", "_b"))) == len(run)


def test_a_point_twice_is_refused_naming_it():
    run = make_run()
    doubled = pd.concat([run, run[run["point_id"] == RING_512]], ignore_index=True)
    with pytest.raises(ValueError, match=rf"run: holds the same point more than once: {RING_512} \(2 rows\)"):
        check_unique(doubled, "run")
    with pytest.raises(GateRefusal, match=RING_512):
        gate(run, doubled, [])
    with pytest.raises(GateRefusal, match=rf"baseline: .*{RING_512}"):
        gate(doubled, run, [])


def test_the_same_key_under_another_point_id_is_still_a_duplicate():
    run = make_run()
    extra = run[run["point_id"] == RING_512].assign(point_id="renamed")
    with pytest.raises(ValueError, match="more than once"):
        check_unique(pd.concat([run, extra], ignore_index=True), "run")
