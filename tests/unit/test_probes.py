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



def test_one_off_segments_count_their_max_and_repeated_ones_their_min():
    peaks = probes.SegmentPeaks()
    assert peaks.top() is None
    peaks.add(100, "parity step")
    peaks.add(80, "first optimizer step")
    assert peaks.top() == "parity step"
    for total, what in ((300, "step 1, a late free"), (250, "step 2"), (260, "step 3")):
        peaks.add(total, what, repeat="step")
    assert peaks.top() == "step 2"  # the repeats' inflation is dropped, the one-offs' max is still compared
    peaks.add(400, "a bigger one-off")
    assert peaks.top() == "a bigger one-off"


def test_steps_whose_memory_grows_every_time_count_the_last_and_say_so():
    peaks = probes.SegmentPeaks()
    for total in (100, 150, 200):  # a leak: each step keeps more than the one before
        peaks.add(total, total, repeat="step")
    assert peaks.top() == 200
    assert peaks.notes() == ["memory grew every step segment (3 of them, +100 B in all): the last one's peak counts"]
    noisy = probes.SegmentPeaks()
    for total in (100, 150, 150):  # not growing every time: noise, the smallest counts
        noisy.add(total, total, repeat="step")
    assert noisy.top() == 100 and noisy.notes() == []


def test_a_cpu_probe_counts_the_smallest_of_identical_steps():
    import torch

    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = probes.CpuMemoryProbe(model, optimizer, budget=None)
    held = []
    for extra in (4096, 0, 1024):  # three "identical" steps; two of them keep an extra buffer alive a while
        with probe.segment(repeat="step"):
            model(torch.ones(4, 8)).sum().backward()
            held.append(torch.empty(extra, dtype=torch.uint8))
            held.pop()
    quiet = probes.CpuMemoryProbe(model, optimizer, budget=None)
    with quiet.segment(repeat="step"):
        model(torch.ones(4, 8)).sum().backward()
    assert probe.result()["peak_bytes"] == quiet.result()["peak_bytes"] > 0


def test_nvml_finds_the_device_by_uuid_not_by_torch_index(monkeypatch):
    """Under CUDA_VISIBLE_DEVICES=2,3 torch's device 0 is physical GPU 2: NVML must be asked by UUID."""
    import types

    import torch

    asked = []
    physical = {"GPU-2222": "handle of physical GPU 2"}
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: asked.append(("index", i)) or f"handle of physical GPU {i}",
        nvmlDeviceGetHandleByUUID=lambda u: asked.append(("uuid", u)) or physical[u],
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=7 if h == "handle of physical GPU 2" else 0),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid="2222"))
    sampler = probes.NvmlSampler(0)
    assert sampler.error is None and asked == [("uuid", "GPU-2222")]
    assert sampler._read() == 7  # the used memory of physical GPU 2
