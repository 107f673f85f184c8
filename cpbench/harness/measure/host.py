"""Host memory and host<->device transfers of the offload levers, for one rank's tracked steps.

What lives on the host: with activation offload, the recompute checkpoints (each recomputed layer's saved inputs,
packed by transformers' `save_on_cpu` around `checkpoint`); with parameter offload (FSDP2's `CPUOffloadPolicy`), the
sharded parameters, the sharded gradients (copied off the device after each reduce-scatter) and the optimizer state,
and the optimizer step's own temporaries (AdamW runs on the host). What moves: each packed checkpoint down (d2h) in
forward and up (h2d) in backward; each sharded parameter up before each all-gather, each sharded gradient down.

Two ways of keeping the ledger, by probe:
- tracked (CPU runs and projections, probes.CpuMemoryProbe): host and device are the same memory here, so the ledger
  makes the move the tracker sees. A packed checkpoint is a copy whose storage the tracker counts under `HOST`, and
  unpacking makes a new device copy, as on a GPU; FSDP2's sharded parameters, gradients and optimizer state, and what
  the optimizer step allocates, are counted under `HOST` too. The device peak is then what a GPU would hold, and the
  host peak what its node's memory would. (FSDP2 on a GPU also holds a transient device copy of one group's sharded
  parameters before its all-gather: 1/world of a layer, not modelled.)
- counted (CUDA runs, probes.CudaMemoryProbe): the moves are real; the ledger counts their bytes from the same hooks
  and the live host bytes they hold (the allocator sees only the device).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._pytree import tree_flatten

# The tracker's key for host memory. No tensor of a step lives on `meta` (a projection's fake tensors report the
# device they stand for), so this key holds only what the ledger moved.
HOST = torch.device("meta")


def _storages(tree) -> list:
    from torch.distributed._tools.common_utils import get_untyped_storages

    leaves, _ = tree_flatten(tree)
    return [st for t in leaves if isinstance(t, torch.Tensor) for st in get_untyped_storages(t)]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's own local tensor (the object that lives as long as the shard; `to_local()` may make a view)."""
    return getattr(t, "_local_tensor", t)


def _nbytes(t: torch.Tensor) -> int:
    t = local_tensor(t)
    return t.numel() * t.element_size()


class HostLedger:
    """The host side of one rank: bytes moved per step, and (counted mode) the live host bytes and their peak.
    `tracker`: the CPU probe's MemTracker (tracked mode), or None (counted mode)."""

    def __init__(self, tracker=None):
        self.tracker = tracker
        self.d2h_bytes = self.h2d_bytes = 0
        self.live = self.peak = 0  # counted mode only; tracked mode reads the tracker's HOST snapshot
        self.by_kind: dict[str, int] = {}
        self.peak_by_kind: dict[str, int] = {}
        self.listeners: list = []  # called (direction "d2h" | "h2d", bytes, what) per move (the time model's trace)
        self.moving = False  # True while the ledger makes its own copy of a moved tensor (tracked mode)

    def _moved(self, direction: str, nbytes: int, what: str) -> None:
        if direction == "d2h":
            self.d2h_bytes += nbytes
        else:
            self.h2d_bytes += nbytes
        for listener in self.listeners:
            listener(direction, nbytes, what)

    def reset_step(self) -> None:
        self.d2h_bytes = self.h2d_bytes = 0

    # --- counted mode: live host bytes, each freed when its tensor is
    def _hold(self, t: torch.Tensor, kind: str) -> None:
        n = _nbytes(t)
        self.live += n
        self.by_kind[kind] = self.by_kind.get(kind, 0) + n
        if self.live > self.peak:
            self.peak, self.peak_by_kind = self.live, dict(self.by_kind)
        # on the storage: a DTensor's local tensor may be re-made as a new view of the same shard (FSDP2 does)
        weakref.finalize(local_tensor(t).untyped_storage(), self._free, n, kind)

    def _free(self, n: int, kind: str) -> None:
        self.live -= n
        self.by_kind[kind] -= n

    def to_host(self, t: torch.Tensor, kind: str) -> None:
        """`t` now lives on the host (its storage, in tracked mode; its bytes, in counted mode)."""
        if self.tracker is not None:
            self.tracker.to_host(local_tensor(t))
        else:
            self._hold(t, kind)

    # --- activation offload: transformers' `save_on_cpu(pin_memory, device_type)`, its two hooks counted
    def save_on_cpu(self, pin_memory: bool = False, device_type: str = "cuda"):
        pin = pin_memory and torch.accelerator.is_available()

        def pack(tensor):
            if self.tracker is not None:
                with self.tracker.host_phase():  # a copy that never was device memory
                    self.moving = True
                    try:
                        packed = tensor.detach().clone()
                    finally:
                        self.moving = False
            else:
                packed = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin)
                packed.copy_(tensor)
                self._hold(packed, "activations")
            self._moved("d2h", _nbytes(tensor), "activations")
            return tensor.device, packed

        def unpack(saved):
            device, packed = saved
            self._moved("h2d", _nbytes(packed), "activations")
            if self.tracker is None:
                return packed.to(device, non_blocking=pin)
            self.moving = True
            try:
                return packed.clone()
            finally:
                self.moving = False

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    @contextlib.contextmanager
    def levers(self, point, model, optimizer):
        """The offload levers of `point` routed through this ledger while the block runs."""
        with contextlib.ExitStack() as stack:
            if point.offload_activations and point.activation_checkpointing:
                stack.enter_context(_patched(_modeling_utils(), "save_on_cpu", self.save_on_cpu))
            if point.offload_params and point.world_size > 1:
                self._params_at_rest(model, optimizer)
                stack.enter_context(self._fsdp_moves())
                if self.tracker is not None:
                    stack.enter_context(self._optimizer_on_host(optimizer))
            yield

    def _params_at_rest(self, model, optimizer) -> None:
        for p in model.parameters():
            self.to_host(p, "params")
        for state in optimizer.state.values():
            for t in state.values():
                if torch.is_tensor(t):
                    self.to_host(t, "optimizer")

    @contextlib.contextmanager
    def _fsdp_moves(self):
        """Counts each sharded parameter's copy up before its all-gather, and moves each sharded gradient down after
        its group's reduce-scatter (FSDP2's own `.to` calls, which are no-ops where the device is the host)."""
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        ledger, gather_inputs, post_backward = self, FSDPParam.all_gather_inputs, FSDPParamGroup.post_backward

        def all_gather_inputs(fsdp_param):
            if fsdp_param.offload_to_cpu:
                ledger._moved("h2d", _nbytes(fsdp_param._sharded_param_data), "params")
            return gather_inputs.fget(fsdp_param)

        def post_backward_then_offload(group, *args, **kwargs):
            out = post_backward(group, *args, **kwargs)
            for fsdp_param in group.fsdp_params:
                grad = fsdp_param.sharded_param.grad
                if fsdp_param.offload_to_cpu and grad is not None:
                    ledger._moved("d2h", _nbytes(grad), "grads")
                    ledger.to_host(grad, "grads")
            return out

        with _patched(FSDPParam, "all_gather_inputs", property(all_gather_inputs)), \
                _patched(FSDPParamGroup, "post_backward", post_backward_then_offload):
            yield

    @contextlib.contextmanager
    def _optimizer_on_host(self, optimizer):
        """Tracked mode: what the optimizer step allocates is host memory (it runs on the host's copies)."""
        from cpbench.harness.measure.step import optimizer_phase_hooks

        phase = None

        def pre():
            nonlocal phase
            phase = self.tracker.host_phase()
            phase.__enter__()

        def post():
            phase.__exit__(None, None, None)

        # the clipping of the host's gradients (step.make_optimizer's own hook) is inside the phase too
        handles = optimizer_phase_hooks(optimizer, pre, post)
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def columns(self, host_snapshot: dict | None) -> dict:
        """The record's host columns. `host_snapshot`: the tracker's HOST snapshot at its peak (tracked mode)."""
        if self.tracker is not None:
            snap = host_snapshot or {}
            parts = {"params": snap.get("Parameter", 0) + snap.get("Buffer", 0), "grads": snap.get("Gradient", 0),
                     "optimizer": snap.get("Optstate", 0)}
            parts["activations"] = snap.get("Total", 0) - sum(parts.values())  # checkpoints and the step's temps
            peak = snap.get("Total", 0)
        else:
            parts, peak = {k: self.peak_by_kind.get(k, 0) for k in ("params", "grads", "optimizer", "activations")}, \
                self.peak
        return {"host_peak_bytes": peak, "d2h_bytes": self.d2h_bytes, "h2d_bytes": self.h2d_bytes,
                **{f"host_{k}_bytes": v for k, v in parts.items()}}


def _modeling_utils():
    import transformers.modeling_utils as modeling_utils

    return modeling_utils


@contextlib.contextmanager
def _patched(owner, name: str, value):
    old = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def new_storages(out, inputs) -> list:
    """The storages of `out` that none of `inputs` holds: what an op allocated (a view allocates nothing)."""
    inputs = _storages(inputs)  # held while ids are compared: a freed object's id may be reused
    held = {id(st) for st in inputs}
    return [st for st in _storages(out) if id(st) not in held]
