"""Compiled points (harness/measure/compiled.py): what a row records of dynamo's counters, how a failing compile is
told, which modules are compiled, and that a projection of a compiled point says it priced the eager step."""

from __future__ import annotations

import pytest
import torch

from cpbench.harness.measure import compiled
from cpbench.harness.run import rows
from cpbench.harness.suite.spec import load_suite
from tests.unit.test_probes import _record

SUITE = 'name = "t"\nmodel = "tiny-qwen3"\nseq_lens = [64]\ncp_sizes = [2]\ncompile = true\n'
CTX = {"run_id": "r", "env": {"device_name": "cpu"}, "budget": None}


def _compiled_record(rank: int, breaks: int, recompiles: int, compile_s: float) -> dict:
    notes = [f"{breaks} graph breaks (why)"] if breaks else []
    return {**_record(rank, notes), "graph_breaks": breaks, "recompiles": recompiles, "compile_s": compile_s}


def test_a_compiled_row_takes_the_max_over_ranks():
    point = load_suite("t.toml", text=SUITE).points()[0]
    row = rows.measured_row(point, [_compiled_record(0, 0, 1, 3.0), _compiled_record(1, 2, 0, 5.0)], 1.0, **CTX)
    assert (row["compile"], row["graph_breaks"], row["recompiles"], row["compile_s"]) == ("default", 2, 1, 5.0)
    assert "rank 1: 2 graph breaks (why)" in row["status_detail"]
    eager = load_suite("t.toml", text=SUITE.replace("compile = true", "")).points()[0]
    assert "graph_breaks" not in rows.measured_row(eager, [_record(0, []), _record(1, [])], 1.0, **CTX)


def test_a_projection_of_a_compiled_point_says_it_priced_the_eager_step():
    point = load_suite("t.toml", text=SUITE).points()[0]
    row = rows.measured_row(point, [_record(0, []), _record(1, [])], 1.0, **{**CTX, "measurement": "projected"})
    assert row["projected_pricing"] == "eager" and "priced the eager step" in row["status_detail"]


def test_a_failing_compile_says_so():
    with pytest.raises(RuntimeError, match="torch.compile \\(mode 'default'\\) failed in the first step: ValueError"):
        with compiled.first_step("default"):
            raise ValueError("boom")
    with pytest.raises(ValueError, match="boom"), compiled.first_step("off"):
        raise ValueError("boom")


def test_only_the_outer_decoder_layers_are_compiled():
    inner = torch.nn.Module()
    inner.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])  # a list named `layers` inside a layer
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([inner, torch.nn.Linear(2, 2)])
    assert compiled.decoder_layers(model) == [inner, model.model.layers[1]]
