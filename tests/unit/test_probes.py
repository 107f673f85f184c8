"""Probes: a missing or failing NVML leaves device_peak_bytes null and says why in the row (never silently)."""

from __future__ import annotations

import sys

from cpbench.harness import env, probes, rows
from cpbench.harness.spec import load_suite

SUITE = 'name = "t"\nmodel = "tiny-qwen3"\nseq_lens = [64]\ncp_sizes = [2]\n'


def test_nvml_unavailable_is_recorded_with_its_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    sampler = probes.NvmlSampler(0)
    with sampler:
        pass
    assert sampler.peak is None and "NVML unavailable" in sampler.error


def test_nvml_failing_while_sampling_is_recorded():
    sampler = probes.NvmlSampler.__new__(probes.NvmlSampler)
    sampler.peak, sampler.error, sampler.interval_s = None, None, 0.0

    def broken():
        raise RuntimeError("GPU is lost")

    sampler._read = broken
    with sampler:
        sampler._thread.join(5)
    assert "GPU is lost" in sampler.error


def _record(rank: int, notes: list[str]) -> dict:
    return {"rank": rank, "status": "ok", "peak_bytes": 100 + rank, "reserved_bytes": None, "alloc_retries": None,
            "device_peak_bytes": None, "rss_peak_bytes": 1000, "params_bytes": 10, "grads_bytes": 10,
            "optimizer_bytes": 20, "activations_bytes": 60 + rank, "step_times_s": [0.1], "num_params": 5,
            "model_type": "qwen3", "parity_mode": "full", "notes": notes,
            "parity": {"parity_status": "pass", "parity_detail": None}}


def test_an_ok_row_carries_the_reason_a_measured_column_is_null():
    point = load_suite("t.toml", text=SUITE).points()[0]
    ctx = {"run_id": "r", "env": {"device_name": "cpu"}, "budget": None}
    note = "NVML unavailable, device_peak_bytes is null: NVMLError: Driver Not Loaded"
    row = rows.measured_row(point, [_record(0, [note]), _record(1, [note])], 1.0, **ctx)
    assert row["status"] == "ok" and row["device_peak_bytes"] is None
    assert "rank 0: " + note in row["status_detail"] and "rank 1: " + note in row["status_detail"]
    assert rows.measured_row(point, [_record(0, []), _record(1, [])], 1.0, **ctx)["status_detail"] is None
    over = rows.measured_row(point, [_record(0, [note]), _record(1, [])], 1.0, **{**ctx, "budget": 50})
    assert over["status"] == "oom" and "memory budget" in over["status_detail"] and note in over["status_detail"]


def test_a_failing_driver_query_warns_instead_of_hiding(monkeypatch):
    import types

    import pytest

    class NVMLError(Exception):
        pass

    def init():
        raise NVMLError("Driver Not Loaded")

    fake = types.SimpleNamespace(NVMLError=NVMLError, nvmlInit=init)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with pytest.warns(UserWarning, match="Driver Not Loaded"):
        assert env._driver_version() is None

