"""Memory and time probes for one rank.

Memory is measured in *segments* (`with probe.segment(): ...`); the point's peak is the max over segments, so
work that is not part of training (the parity capture, the reference) can run between segments uncounted. A
segment that repeats the same work (`segment(repeat="step")`, one per identical training step) counts with the
smallest of its peaks: the noise in a tracked peak only ever inflates it — gloo's worker thread drops its
references to a finished collective's buffers a moment after the waiting thread has moved on, so a descheduled
worker keeps a dead buffer counted for a while (seen: +128 KiB on one rank, a few runs in a hundred). Where such a
buffer lifts an earlier moment of the step to exactly the true peak (seen once: +32 KiB in the backward of a
Ulysses step, where the next moment's rise was also 32 KiB), the repeats tie on the total but not on the
breakdown. A tracker records the first moment that reaches its peak, so inflation can only move that moment
earlier: among tied repeats, the one whose peak came latest in its step is the clean one.

- CPU: `torch.distributed._tools.mem_tracker.MemTracker`, a dispatch-mode tracker of live tensor storages
  (it also follows `UntypedStorage.resize_`, which FSDP2 uses to (un)shard parameters). Its snapshot at the
  peak gives the breakdown into parameters, gradients, optimizer state and activations. A memory budget is
  enforced as a device would: the allocation that takes the live bytes past it raises `torch.OutOfMemoryError`.
  Its categories: tensors created in forward are activations, those created in backward that are not gradients
  are temporaries. The tracker slows every op, so timed steps run outside any segment.
- CUDA: the caching allocator's peaks (reset per segment), alloc retries, and an NVML sampler of the device's
  used memory in a background thread. The breakdown is the at-rest size of parameters, gradients and
  optimizer state; activations are the rest of the peak. A budget caps the allocator
  (`set_per_process_memory_fraction`). The NVML sampler (nvml.py) reads the GPU's, or the MIG instance's, memory.
- Both: the RSS high-water mark of the process, reset per point where Linux allows (`/proc/self/clear_refs`).
"""

from __future__ import annotations

import contextlib
import gc
import resource
import time
from pathlib import Path

import torch

from cpbench.harness.measure.host import HOST, HostLedger, new_storages
from cpbench.harness.measure.nvml import NvmlSampler, nvml_handle  # noqa: F401 - the NVML part of the probes lives there

BREAKDOWN = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "temporaries_bytes")


class _NoHook:
    """The handle of a hook never installed: removing it does nothing."""

    @staticmethod
    def remove() -> None:
        return None


_NO_HOOK = _NoHook()


def _mem_tracker_class():
    from torch.distributed._tools.mem_tracker import MemTracker

    class BudgetMemTracker(MemTracker):
        """MemTracker that keeps only the global peak, raises torch.OutOfMemoryError when the device's live bytes
        pass `budget`, and keeps host memory apart (host.py): storages moved `to_host`, and those allocated in a
        `host_phase`, are counted under the HOST key. MemTracker also updates every module's own peak after every op;
        cpbench reads none of them, and that update was 85 % of a projected Qwen3-0.6B step's time."""

        budget: int | None = None
        _in_host_phase = False
        _peak_due = None  # set while an op runs: the tracker's peak update waits until its outputs are placed
        ops = 0  # ops dispatched since the segment began; `peak_at`: the count when the peak was first reached
        peak_at = 0

        def _update_peak_stats(self, peak_state) -> None:
            if self._peak_due is not None:
                self._peak_due = True
                return
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)
                    if dev != HOST:
                        self.peak_at = self.ops

        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
            # MemTracker hooks every parameter's gradient, and torch refuses a hook on a frozen one (a router's
            # bias kept out of training: afmoe, ernie4_5_moe, laguna): a frozen parameter is marked hooked already
            # (it never has a gradient to count), so the step runs as it would untracked
            for param in module.parameters():
                if not param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                    self._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def to_host(self, tensor: torch.Tensor, storages=None) -> None:
            from torch.distributed._tools.mem_tracker import _UpdateType

            for st in storages if storages is not None else new_storages(tensor, ()):
                winfo, _ = self._WINFO.get(st, (None, None))
                if winfo is not None and winfo.device != HOST:
                    if winfo.mem_consumed > 0:
                        self._update_snap(_UpdateType.DEL, winfo)
                    winfo.device = HOST
                    if winfo.mem_consumed > 0:
                        self._update_snap(_UpdateType.ADD, winfo)

        @contextlib.contextmanager
        def host_phase(self):
            outer, self._in_host_phase = self._in_host_phase, True
            try:
                yield
            finally:
                self._in_host_phase = outer

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            self._peak_due = False
            try:
                out = super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                due, self._peak_due = self._peak_due, None
            if due:
                if self._in_host_phase:
                    self.to_host(out, new_storages(out, (args, kwargs)))
                self._update_peak_stats(None)
            if self.budget is not None:
                for dev, snap in self._curr_mem_snap.items():
                    if dev != HOST and snap["Total"] > self.budget:
                        raise torch.OutOfMemoryError(
                            f"live tensor bytes {snap['Total']} passed the memory budget of {self.budget} bytes "
                            f"(at {func})"
                        )
            return out

    return BudgetMemTracker


class SegmentPeaks:
    """The peak over segments: the max of the one-off segments' peaks and, per kind of repeated segment, the
    smallest of its repeats' peaks (see the module docstring for why the smallest; of repeats that tie, the one
    whose peak came latest in its segment, `at`) — unless the repeats grew every time (at least 3, each above the
    one before): that is memory kept step after step, not noise, so the last one counts and `notes` says by how
    much it grew."""

    def __init__(self):
        self.once: tuple[int, object] | None = None
        self.repeats: dict[str, list[tuple[int, object, int]]] = {}

    def add(self, total: int, detail, repeat: str | None = None, at: int = 0) -> None:
        if repeat is not None:
            self.repeats.setdefault(repeat, []).append((total, detail, at))
        elif self.once is None or total > self.once[0]:
            self.once = (total, detail)

    @staticmethod
    def _grew(peaks: list[tuple[int, object]]) -> bool:
        return len(peaks) >= 3 and all(b[0] > a[0] for a, b in zip(peaks, peaks[1:]))

    def _counted(self, peaks: list[tuple[int, object]]) -> tuple[int, object]:
        return peaks[-1] if self._grew(peaks) else min(peaks, key=lambda c: (c[0], -c[2]))

    def top(self):
        """The detail of the largest counted peak (None before any segment)."""
        counted = [c for c in (self.once, *map(self._counted, self.repeats.values())) if c is not None]
        return max(counted, key=lambda c: c[0])[1] if counted else None

    def notes(self) -> list[str]:
        return [f"memory grew every {kind} segment ({len(peaks)} of them, +{peaks[-1][0] - peaks[0][0]} B in all): "
                f"the last one's peak counts" for kind, peaks in self.repeats.items() if self._grew(peaks)]


class CpuMemoryProbe:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, budget: int | None):
        self.tracker = _mem_tracker_class()()
        self.tracker.budget = budget
        self.model, self.optimizer = model, optimizer
        self.track_state()
        self.peaks = SegmentPeaks()
        self.host = HostLedger(self.tracker)

    def track_state(self) -> None:
        """Counts the parameters and the optimizer state as they are now: made outside any segment (step 0 creates
        the optimizer state and FSDP's lazy init may re-create the sharded parameters), they would not be counted."""
        self.tracker.track_external(self.model, self.optimizer)

    @contextlib.contextmanager
    def segment(self, repeat: str | None = None):
        self.tracker.reset_mod_stats()  # MemTracker keeps per-module stats of one iteration only
        self.tracker.ops = self.tracker.peak_at = 0
        self.host.reset_step()
        with no_gc(), self.tracker:
            yield
        peaks = self.tracker.get_tracker_snapshot("peak")
        host = peaks.pop(HOST, None)
        if peaks:  # none only if nothing was ever tracked; a 0 would win the repeats' minimum
            snap = max(peaks.values(), key=lambda s: s["Total"])
            self.peaks.add(snap["Total"], (dict(snap), host, self.host.d2h_bytes, self.host.h2d_bytes), repeat,
                           at=self.tracker.peak_at)

    def result(self) -> dict:
        p, host, self.host.d2h_bytes, self.host.h2d_bytes = self.peaks.top() or ({"Total": 0}, None, 0, 0)
        params = p.get("Parameter", 0) + p.get("Buffer", 0)
        grads, opt, temp = p.get("Gradient", 0), p.get("Optstate", 0), p.get("Temp", 0)
        return {
            "peak_bytes": p["Total"], "reserved_bytes": None, "alloc_retries": None, "device_peak_bytes": None,
            "params_bytes": params, "grads_bytes": grads, "optimizer_bytes": opt, "temporaries_bytes": temp,
            "activations_bytes": p["Total"] - params - grads - opt - temp,
            "breakdown_source": "MemTracker snapshot at the peak",
            "notes": self.peaks.notes(), **self.host.columns(host),
        }


class CudaMemoryProbe:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, budget: int | None):
        self.model, self.optimizer = model, optimizer
        self.device = torch.cuda.current_device()
        if budget is not None:
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), self.device)
        self.reserved = 0
        self.peaks = SegmentPeaks()
        self.sampler = NvmlSampler(self.device)
        self.host = HostLedger()
        torch.cuda.reset_accumulated_memory_stats(self.device)

    @contextlib.contextmanager
    def segment(self, repeat: str | None = None):
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.host.reset_step()
        with no_gc(), self.sampler:
            yield
            torch.cuda.synchronize(self.device)
        allocated = torch.cuda.max_memory_allocated(self.device)
        self.peaks.add(allocated, allocated, repeat)
        self.reserved = max(self.reserved, torch.cuda.max_memory_reserved(self.device))

    def track_state(self) -> None:
        """The allocator counts everything it holds: nothing to register."""

    @property
    def peak(self) -> int:
        return self.peaks.top() or 0

    def result(self) -> dict:
        params = _local_bytes(self.model.parameters()) if isinstance(self.model, torch.nn.Module) else 0
        grads = params  # at rest after backward every parameter has a gradient of its own size
        state = self.optimizer.state.values() if self.optimizer is not None else ()
        opt = _local_bytes(t for s in state for t in s.values() if torch.is_tensor(t))
        return {
            "peak_bytes": self.peak, "reserved_bytes": self.reserved,
            "alloc_retries": torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0),
            "device_peak_bytes": self.sampler.peak,
            "params_bytes": params, "grads_bytes": grads, "optimizer_bytes": opt, "temporaries_bytes": None,
            "activations_bytes": max(0, self.peak - params - grads - opt),
            "breakdown_source": "at-rest sizes; activations = peak - the rest",
            "notes": ([self.sampler.error] if self.sampler.error else []) + self.peaks.notes(),
            **self.host.columns(None),
        }


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def memory_probe(device: str, model, optimizer, budget: int | None):
    """`model`: the module (or, for an attention op alone, the input tensors) held before the step; `optimizer`:
    its optimizer, or None."""
    cls = CudaMemoryProbe if device == "cuda" else CpuMemoryProbe
    return cls(model, optimizer, budget)


_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def reset_rss_peak() -> bool:
    """Resets the RSS high-water mark (Linux >= 4.0). False where the OS does not allow it."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def rss_peak_bytes() -> int:
    """VmHWM of this process (reset by `reset_rss_peak`), else getrusage's lifetime max."""
    if _STATUS.exists():
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class StepTimer:
    """Wall time of each step; CUDA work is synchronized before the clock is read."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self.times_s: list[float] = []

    @contextlib.contextmanager
    def step(self):
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
        self.times_s.append(time.perf_counter() - t0)


@contextlib.contextmanager
def no_gc():
    """Python's cycle collector off while memory is tracked (every segment): it runs at allocation-count
    thresholds, so freeing cyclic garbage mid-step could move the peak from run to run. Collected first, so the
    segment starts clean; what the step leaves in cycles is counted, every run alike."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
