"""Probes: a missing or failing NVML leaves device_peak_bytes null and says why in the row (never silently)."""

from __future__ import annotations

import sys

from cpbench.harness.measure import env, probes
from cpbench.harness.run import rows
from cpbench.harness.suite.spec import load_suite

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


def test_of_repeats_that_tie_the_one_whose_peak_came_latest_counts():
    """A late free can lift an earlier moment to exactly the true peak: the totals tie, the breakdowns do not.
    The tracker keeps the first moment at its peak, so the inflated repeat's moment is the earlier one."""
    peaks = probes.SegmentPeaks()
    for at, what in ((10, "step 1, an earlier moment lifted"), (14, "step 2"), (14, "step 3")):
        peaks.add(300, what, repeat="step", at=at)
    assert peaks.top() == "step 2"
    peaks.add(299, "step 4, smaller", repeat="step", at=3)
    assert peaks.top() == "step 4, smaller"  # the total still comes first


def test_a_cpu_probe_keeps_the_clean_breakdown_when_a_late_free_ties_the_peak():
    """The same on the tracker itself: in one step a buffer made in forward outlives its last use until the
    backward's first op, which lifts that moment to the step's real peak (the backward's second op)."""
    import torch

    model = torch.nn.Linear(64, 64, bias=False)
    probe = probes.CpuMemoryProbe(model, torch.optim.SGD(model.parameters(), lr=0.1), budget=None)
    x, grad = torch.ones(16, 64), torch.ones(16, 64)
    extra = 16 * 64 * 4  # the same size as the peak's rise, as in the Ulysses step where this was seen
    breakdowns = []
    for late in (True, False, False):
        with probe.segment(repeat="step"):
            y = model(x)
            held = [torch.empty(extra, dtype=torch.uint8)]  # dead after forward; freed late in the first step
            if not late:
                held.pop()
            first = grad * 2  # the moment a late free lifts to the peak
            held.clear()
            second = first * 2  # the real peak: first and second live together
            del first, second, y, held
        breakdowns.append(probe.peaks.repeats["step"][-1])
    assert breakdowns[0][0] == breakdowns[1][0] and breakdowns[0][2] < breakdowns[1][2]  # tie, earlier moment
    assert probe.peaks.top() is breakdowns[1][1]


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


class _FakeNvml:
    """pynvml as a host with three GPUs sees it: GPU-aaaa cannot do MIG (NVML: not supported), GPU-bbbb is in MIG
    mode with two instances in slots 0 and 2 of 7 (the others empty: not found), GPU-cccc has MIG off. Used memory
    differs per device, so a test sees whose was read. `legacy`: MIG UUIDs in the pre-R470 "MIG-GPU-.../gi/ci" form."""

    NVML_DEVICE_MIG_ENABLE, NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_NOT_FOUND = 1, 3, 6

    class NVMLError(Exception):
        def __init__(self, value):
            super().__init__(f"NVML error {value}")
            self.value = value

    def __init__(self, legacy: bool = False):
        self.gpus = ["GPU-aaaa", "GPU-bbbb", "GPU-cccc"]
        first, second = ("MIG-GPU-bbbb/1/0", "MIG-GPU-bbbb/2/0") if legacy else ("MIG-1111", "MIG-2222")
        self.migs = {0: first, 2: second}
        self.used = {"GPU-aaaa": 1, "GPU-bbbb": 2, "GPU-cccc": 3, first: 11, second: 22}

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.gpus[i]

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid not in self.gpus:
            raise self.NVMLError(self.NVML_ERROR_NOT_FOUND)
        return uuid

    def nvmlDeviceGetMigMode(self, gpu):
        if gpu == "GPU-aaaa":
            raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return (1, 1) if gpu == "GPU-bbbb" else (0, 0)

    def nvmlDeviceGetMaxMigDeviceCount(self, gpu):
        return 7 if gpu == "GPU-bbbb" else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, gpu, j):
        if gpu != "GPU-bbbb" or j not in self.migs:
            raise self.NVMLError(self.NVML_ERROR_NOT_FOUND)
        return self.migs[j]

    def nvmlDeviceGetUUID(self, handle):
        return handle.encode()  # older nvidia-ml-py returns bytes

    def nvmlDeviceGetMemoryInfo(self, handle):
        import types

        return types.SimpleNamespace(used=self.used[handle])


def _sampler_on(monkeypatch, fake, torch_uuid: str):
    import types

    import torch

    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid=torch_uuid))
    return probes.NvmlSampler(0)


def test_nvml_reads_the_mig_instance_this_process_runs_on(monkeypatch):
    """Under CUDA_VISIBLE_DEVICES=MIG-2222 torch reports the instance's UUID, which NVML's GPU lookup does not know:
    the instance is found among the MIG devices, and its memory (not its GPU's, nor the other instance's) is read."""
    sampler = _sampler_on(monkeypatch, _FakeNvml(), "2222")
    assert sampler.error is None and sampler._read() == 22
    from cpbench.harness.measure.nvml import handle_by_uuid

    assert handle_by_uuid(_FakeNvml(), "MIG-1111") == "MIG-1111"  # as CUDA_VISIBLE_DEVICES spells it
    assert handle_by_uuid(_FakeNvml(legacy=True), "MIG-GPU-bbbb/2/0") == "MIG-GPU-bbbb/2/0"


def test_nvml_still_finds_a_whole_gpu_and_names_an_unknown_uuid(monkeypatch):
    sampler = _sampler_on(monkeypatch, _FakeNvml(), "cccc")
    assert sampler.error is None and sampler._read() == 3
    lost = _sampler_on(monkeypatch, _FakeNvml(), "9999")
    assert lost.peak is None and "NVML unavailable" in lost.error and "'9999'" in lost.error
    assert "MIG instances" in lost.error


def test_a_cpu_probe_runs_a_model_with_a_frozen_parameter():
    """MemTracker hooks every parameter's gradient, and torch refuses a hook on one that needs none (afmoe's and
    ernie4_5_moe's router bias): the step runs, and the frozen parameter is counted as a parameter."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    model[1].bias.requires_grad_(False)
    probe = probes.CpuMemoryProbe(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
                                  budget=None)
    for _ in range(2):
        with probe.segment(repeat="step"):
            model(torch.ones(4, 8)).sum().backward()
    result = probe.result()
    assert result["params_bytes"] >= 4 * sum(p.numel() for p in model.parameters()) and result["grads_bytes"] > 0
