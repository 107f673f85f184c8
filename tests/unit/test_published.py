"""The committed projections of published measurements (results/published): wherever a source compares
configurations side by side, the projections come out in the order it measured (orderings.toml); every judged row
says where it comes from and what it holds."""

from __future__ import annotations

import functools
import tomllib
from pathlib import Path

import pytest

from cpbench.report.runs import store

PUBLISHED = Path(__file__).parents[2] / "results" / "published"
ORDERINGS = tomllib.loads((PUBLISHED / "orderings.toml").read_text())


def _metric(name: str, metric: str) -> float:
    (run,) = (PUBLISHED / "runs").glob(f"*/{name}/runs.parquet")
    row = store.read_run(run).iloc[0]
    assert row["projected_step_s"] == row["projected_step_s"], (name, row["status"], row["status_detail"])
    return _table_script().metric(row, metric)  # larger is faster: table.md's "same order" column reads it too


@pytest.mark.parametrize("comparison", sorted(ORDERINGS))
def test_the_projection_orders_configurations_as_the_source_measured_them(comparison):
    spec = ORDERINGS[comparison]
    if "speedup_grows" in spec:  # each pair's faster run is faster, by more from one pair to the next
        speedups = [_metric(fast, spec["metric"]) / _metric(slow, spec["metric"])
                    for fast, slow in spec["speedup_grows"]]
        if spec["metric"] == "step_s":  # _metric negates a step: a shorter one is larger
            speedups = [1 / s for s in speedups]
        assert min(speedups) > 1 and speedups == sorted(speedups), (spec["source"], speedups)
        return
    values = [_metric(name, spec["metric"]) for name in spec["fastest_first"]]
    if not spec.get("judged", True):  # projected and shown in table.md; the configurations differ in what decides
        assert spec["differs"] and all(v == v for v in values), comparison
        return
    assert values == sorted(values, reverse=True), (spec["source"], dict(zip(spec["fastest_first"], values)))


def test_every_published_row_says_its_source_configuration_and_tokens_per_gpu():
    rows = tomllib.loads((PUBLISHED / "measurements.toml").read_text())
    judged = {name: m for name, m in rows.items() if m.get("judged", True)}
    assert len([m for m in judged.values() if m["tokens_per_gpu"] <= 65536]) >= 8  # the short regime, judged
    for name, m in rows.items():
        assert m["source"] and m["config"] and m["unit"] in ("s", "tok/s/GPU") and m["measured"] > 0, name
        if not m.get("judged", True):
            assert m.get("differs"), f"{name}: a row left out of the mean says why"


@functools.cache
def _table_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("published_table", PUBLISHED / "table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_parts_a_source_times_apart_are_projected_and_add_up_to_the_step():
    table = _table_script()
    rows = {name: m for name, m in tomllib.loads((PUBLISHED / "measurements.toml").read_text()).items()
            if "parts" in m}
    assert rows
    for name, m in rows.items():
        measured = m["parts"]
        assert set(measured) <= set(table.PARTS), name
        for whole in (("forward_backward_s", "optimizer_s"), ("attention_s", "rest_s")):
            if set(whole) <= set(measured):  # the entry agrees with the source's own step
                assert sum(measured[k] for k in whole) == pytest.approx(m["measured"], rel=1e-3), name
        (run,) = (PUBLISHED / "runs").glob(f"*/{name}/runs.parquet")
        row = store.read_run(run).iloc[0]
        parts = table.projected_parts(row)
        assert set(measured) <= set(parts), f"{name}: the run was projected before these parts were recorded"
        assert 0 < parts["forward_s"] < parts["forward_backward_s"] < row["projected_step_s"], name
        # what follows the backward holds the optimizer step's own kernels (the breakdown's part), and no more than
        # the step beyond the forward and backward
        assert parts["optimizer_s"] >= row["projected_optimizer_s"] * (1 - 1e-9) > 0, name
        # the attention kernels' share of one clock: some of the step, never all of it
        assert 0 < parts["attention_s"] < parts["rest_s"] and parts["attention_s"] + parts["rest_s"] == pytest.approx(
            row["projected_step_s"]), name
    assert len(table.parts(rows)) == 2 + sum(len(m["parts"]) for m in rows.values())  # a line for every part


def test_a_part_or_metric_the_table_does_not_know_is_refused_with_the_known_ones():
    table = _table_script()
    with pytest.raises(ValueError, match=r"metric = 'tok_s' is not one of step_s, tokens_per_s_per_gpu, tflops"):
        table.metric({}, "tok_s")
    with pytest.raises(ValueError, match=r"\[x\] parts: \['backward_s'\] is not a part.*'forward_backward_s'"):
        table.parts({"x": {"parts": {"backward_s": 0.1}}})


def test_the_committed_table_is_what_its_runs_and_measurements_give():
    # table.md is written by table.py from the runs and measurements.toml: a changed note or a re-projected row
    # without the table rewritten (bash results/published/run.sh, or its last line alone) shows here
    assert _table_script().render() == (PUBLISHED / "table.md").read_text()
    # and the record `cpbench estimate` prints from (the package's copy of the judged rows' step errors)
    table = _table_script()
    assert table.record() == table.RECORD.read_text(), "regenerate: python results/published/table.py"


def test_the_docs_copies_of_published_rows_are_the_tables():
    # docs/time.md carries rows of table.md; each one it carries (the same source and configuration, or a source
    # only one row of the table has: a copy whose configuration was changed since) is the same row
    table = [line for line in (PUBLISHED / "table.md").read_text().splitlines() if line.startswith("| ")]
    rows = {tuple(line.split(" | ")[:2]): line for line in table}
    sources = [line.split(" | ")[0] for line in table]
    rows |= {(line.split(" | ")[0],): line for line in table if sources.count(line.split(" | ")[0]) == 1}
    doc = (PUBLISHED.parents[1] / "docs" / "time.md").read_text().splitlines()
    keys = [next((k for k in (tuple(line.split(" | ")[:2]), (line.split(" | ")[0],)) if k in rows), None)
            for line in doc]
    copies = [(line, rows[key]) for line, key in zip(doc, keys) if key is not None and line.startswith("| ")]
    assert len(copies) >= 20
    stale = [line[:120] for line, row in copies if line != row]
    assert not stale, f"docs/time.md rows differ from results/published/table.md: {stale}"
