"""The row schema, and that what the harness writes fits it (rows built from synthetic per-rank records)."""

from __future__ import annotations

import json
from dataclasses import fields

import pyarrow as pa

from cpbench.harness.run import rows
from cpbench.harness.suite.spec import Point, load_suite
from cpbench.report.runs import schema, store

SUITE = 'name = "t"\nmodel = "tiny-qwen3"\nseq_lens = [64]\ncp_sizes = [2]\n'
ENV = {"torch_version": "2", "transformers_version": "5", "cpbench_version": "0", "cuda_version": None,
       "driver_version": None, "device_name": "cpu", "device_count": 0, "hardware_id": "cpu x 2 cpus",
       "git_commit": "abc", "git_dirty": False, "host": "h", "cpu_count": 2}


def _point() -> Point:
    return load_suite("t.toml", text=SUITE).points()[0]


def _record(rank: int, peak: int, times: list[float]) -> dict:
    rec = {"rank": rank, "status": "ok", "peak_bytes": peak, "reserved_bytes": None, "alloc_retries": None,
           "device_peak_bytes": None, "params_bytes": 10, "grads_bytes": 0, "optimizer_bytes": 20,
           "activations_bytes": peak - 30, "rss_peak_bytes": 1000 + rank, "step_times_s": times,
           "num_params": 5, "model_type": "qwen3", "parity_mode": "full"}
    if rank == 0:
        rec["parity"] = {"parity_status": "pass", "loss": 1.0, "ref_loss": 1.0}
    return rec


def test_schema_is_consistent():
    assert ARROW_NAMES() == list(schema.COLUMNS)
    assert set(schema.KEY_COLUMNS) <= set(schema.COLUMNS)
    assert set(schema.KEY_COLUMNS) <= {f.name for f in fields(Point)}
    for name, (typ, _) in schema.COLUMNS.items():
        if name.endswith("_per_rank"):
            assert pa.types.is_list(typ) and name.removesuffix("_per_rank") in schema.COLUMNS
    assert all(f"`{c}`" in schema.describe() for c in schema.COLUMNS)


def ARROW_NAMES():
    return schema.ARROW_SCHEMA.names


def test_a_measured_row_fits_and_aggregates_with_named_reducers():
    p = _point()
    recs = [_record(0, 100, [0.1, 0.4, 0.2]), _record(1, 300, [0.3, 0.1, 0.2])]
    row = rows.measured_row(p, recs, 5.0, run_id="r", env=ENV, budget=None)
    assert row["peak_bytes"] == 300 and row["peak_bytes_per_rank"] == [100, 300]  # max, never a sum
    assert row["activations_bytes"] == 270  # the breakdown of the rank with the highest peak
    assert row["step_times_s"] == [0.3, 0.4, 0.2]  # slowest rank per step
    assert row["step_time_median_s"] == 0.3 and row["tokens_per_s"] == 64 / 0.3
    assert row.get("tflops_per_s") is None and row.get("mfu") is None  # CPU: no MFU
    assert json.loads(row["spec_json"])["cp_size"] == 2
    table = store.to_table([row])
    assert table.schema == schema.ARROW_SCHEMA and table.num_rows == 1


def test_a_peak_over_the_budget_is_oom():
    row = rows.measured_row(_point(), [_record(0, 100, [0.1]), _record(1, 300, [0.1])], 1.0,
                            run_id="r", env=ENV, budget=200)
    assert row["status"] == "oom" and "budget" in row["status_detail"]


def test_outcome_rows_fit_the_schema_and_say_why():
    for status in schema.STATUSES[1:]:
        row = rows.outcome_row(_point(), status, "why", 1.0, run_id="r", env=ENV, budget=None)
        assert row["status"] == status and row["status_detail"] == "why"
        assert row["parity_status"] in schema.PARITY_STATUSES and row["parity_detail"]
        store.to_table([row])
