"""The op trace of one projected step: every kernel and collective of the fake step, with what the time model needs.

A dispatch mode over the same fake step that `estimate` projects (measure/step.py), so the ops are the real step's:
its shapes, dtypes, kernel choices (the CP code's own flash / memory-efficient / varlen tiles), its collectives with
their groups and bytes. Each op becomes an `Op`: the stream the code puts it on, its FLOPs and the bytes it moves,
the buffers it reads and writes (so the time model can tell what waits for what), and for a collective its group.
Nothing here knows a GPU; timing.py prices the trace for one, and prices it again for another (calibrate.py).

Streams, as cpbench's code and the libraries under it schedule the work:
- `compute`: every kernel of the model, the loss, the optimizer, and transformers' activation offload copies (its
  `save_on_cpu` copies on the current stream);
- `ag`: FSDP2's all-gather copy-in (with the cast of the shards it copies in) and all-gather (its own streams,
  which wait only for the previous copy-out);
- `rs`: FSDP2's reduce-scatter (after its input, which the compute stream copies in: _fsdp_collectives.py
  foreach_reduce runs foreach_reduce_scatter_copy_in before reduce_scatter_stream.wait_stream), and the gradient
  copies to the host under parameter offload;
- `nccl`: every other collective (ring send/receive, Ulysses all-to-all, all-reduce): torch's NCCL process group
  waits for the compute stream when a collective is issued.
"""

from __future__ import annotations

from collections import Counter

import warnings

from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from cpbench.cp.recompute import under_op_policy
from cpbench.harness.measure.collectives import _OPS as COLLECTIVES, group_of
from cpbench.harness.project import flops, work


class Op(NamedTuple):
    stream: str  # compute | ag | rs | nccl | host
    # gemm | attention[_cudnn|_efficient|_sdpa]_{forward,backward} | memory | copy_out | sync | a collective | h2d
    # | d2h | checkpoint, replay (a recomputed layer's forward and its replay in backward: host work, no kernel).
    # `_sdpa`: the model called SDPA itself, which picks its kernel on the GPU (hardware.sdpa_kernel)
    kind: str
    phase: str  # step | optimizer
    flops: float
    bytes: float  # bytes moved through HBM (a kernel), sent (a collective), copied (a transfer)
    reads: tuple  # buffer keys
    writes: tuple
    group: int = 1  # a collective's group size
    crosses_nodes: bool = False
    nodes: int = 0  # the nodes a collective's group spans (0: not said)
    fewest: int = 0  # the fewest of its ranks on one of them
    name: str = ""  # the aten (or library) op, e.g. "aten.mm"
    # what a kernel's efficiency depends on (flops.py): a GEMM's (m, n, k, groups), an attention call's (queries,
    # keys, head dim, causal, batch x heads)
    shape: tuple = ()
    tensors: int = 1  # the tensors the op takes (a foreach op: its lists'): its host cost in the optimizer step
    strided: bool = False  # an element-wise op reading or writing a strided view (timing.py: memory_strided)
    backward: bool = False  # dispatched by autograd's backward pass (timing.py: where the forward ends)
    selective: bool = False  # dispatched under op recompute's selective-checkpoint modes (timing.py's host cost)


_FREE_PREFIXES = ("profiler.", "prim.", "fsdp.copy_")  # bookkeeping ops and queries: no kernel
_FREE = {"aten.detach", "aten.alias", "aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty",
         "aten.new_empty_strided", "aten.lift_fresh", "aten.set_", "aten.resize_", "aten.record_stream",
         "aten._unsafe_view", "aten.view", "aten._reshape_alias", "aten.t", "aten.sym_size", "aten.sym_stride",
         "aten.sym_numel", "aten.is_same_size", "aten.sym_storage_offset", "aten._has_compatible_shallow_copy_type"}
_SYNC = {"aten._local_scalar_dense", "aten.nonzero", "aten.item", "aten.equal", "aten.is_nonzero"}


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


class StepTrace(TorchDispatchMode):
    """While entered: the ops of this rank's step (`ops`). `ledger`: the probe's HostLedger, whose moves become
    transfers; `gpus_per_node`: whether a collective's group leaves its node."""

    def __init__(self, ledger=None, gpus_per_node: int = 8, attention_family: str | None = None):
        super().__init__()
        self.ops: list[Op] = []
        # A flash backend's point runs as sdpa on fake tensors (projection.runs_as): its attention calls, the model's
        # own and the ring's tiles, are that backend's kernel ("" FlashAttention-2, "_fa3", "_fa4"). The tiles a
        # varlen call cannot say keep their kernel (the memory-efficient one with a bias), as on the GPU.
        self.attention_family = attention_family
        self.phase = "step"
        self.gpus_per_node = gpus_per_node
        self._stream_of: dict[int, str] = {}  # buffer key -> the stream that wrote it last
        self._writer: dict[int, int] = {}  # buffer key -> the index in `ops` of the kernel that wrote it last
        # A buffer's key is its storage and the storage's generation: the address of a freed storage is reused by
        # a later allocation, which must not inherit what last wrote the freed one (a false wait in the schedule)
        self._generation: dict[int, int] = {}
        self.ledger = ledger
        self._entered = False
        # A flash backend's model calls SDPA here with a mask where its flash path would call the kernel causal, with
        # a window or per document: the call's flash view (flops.flash_as_called), which the projection sets around
        # each model call (projection.flash_view), kept for its backward by its output
        self.flash_call, self._flash_of = None, {}
        if ledger is not None:
            ledger.listeners.append(self._moved)

    def __enter__(self):
        self._entered = True
        return super().__enter__()

    def __exit__(self, *exc):
        self._entered = False
        return super().__exit__(*exc)

    def close(self) -> None:
        if self.ledger is not None and self._moved in self.ledger.listeners:
            self.ledger.listeners.remove(self._moved)
        marked = {kind: sum(o.kind == kind for o in self.ops) for kind in ("checkpoint", "replay")}
        if marked["replay"] < marked["checkpoint"] and any(o.kind.endswith("_backward") for o in self.ops):
            warnings.warn(f"{marked['checkpoint']} checkpointed layer calls, {marked['replay']} replays seen: a layer "
                          "called twice a step, or whose children are not called as modules, replays in backward "
                          "with its host time (cpu_recompute_replay_s) unpriced", stacklevel=2)

    def _moved(self, direction: str, nbytes: int, what: str) -> None:
        stream = {"params": "ag", "grads": "rs"}.get(what, "compute")
        self.ops.append(Op(stream, direction, self.phase, 0.0, float(nbytes), (), (), backward=_in_backward()))

    def optimizer_hooks(self, optimizer):
        """Marks the optimizer step's ops (its own share of the breakdown), the gradient clipping that runs as the
        step's own hook included (step.make_optimizer): torch runs the global hooks before the optimizer's own and
        after them (Optimizer.profile_hook_step). Returns the hook handles."""
        from cpbench.harness.measure.step import optimizer_phase_hooks

        return optimizer_phase_hooks(optimizer, lambda: setattr(self, "phase", "optimizer"),
                                     lambda: setattr(self, "phase", "step"))

    def checkpoint_hooks(self, model: torch.nn.Module):
        """Marks each layer activation checkpointing recomputes, once a step where the host does the work: a
        `checkpoint` op at its forward (torch.utils.checkpoint's frames, its saved-tensor hooks set up) and a `replay`
        op where backward replays it (the hooks unpacking, the replay's frames), beyond the ops each dispatches, which
        the profile's `cpu_recompute_layer_s` and `cpu_recompute_replay_s` price. The layers are transformers' own (a
        `GradientCheckpointingLayer` with `gradient_checkpointing` on checkpoints its `forward` in training, its
        hooks outside the checkpoint), so selective recompute marks only the layers it recomputes; the replay is
        seen by its children's hooks, which run inside it, in backward. The tiled MLP's and the chunked loss's own
        checkpoints are not marked. Returns the hook handles."""
        from cpbench.cp.hf_compat import recomputed_layers

        replayed: set[tuple[int, int]] = set()  # (layer, backward pass) already marked

        def mark(module, _args):
            if self._entered and module.gradient_checkpointing and module.training and torch.is_grad_enabled():
                self.ops.append(Op("compute", "checkpoint", self.phase, 0.0, 0.0, (), (), name=type(module).__name__))

        def replay(layer):
            def hook(_module, _args):
                backward = torch._C._current_graph_task_id()
                if self._entered and backward != -1 and (id(layer), backward) not in replayed:
                    replayed.add((id(layer), backward))
                    self.ops.append(Op("compute", "replay", self.phase, 0.0, 0.0, (), (), name=type(layer).__name__,
                                       backward=True))
            return hook

        layers = recomputed_layers(model)
        return [m.register_forward_pre_hook(mark) for m in layers] + \
            [child.register_forward_pre_hook(replay(m)) for m in layers for child in m.children()]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        self._allocated(args, kwargs, out)
        self._record(func, args, kwargs, out)
        return out

    def _key(self, t: torch.Tensor) -> tuple[int, int]:
        storage = _storage(t)
        return storage, self._generation.get(storage, 0)

    def _allocated(self, args, kwargs, out) -> None:
        """A new generation for each storage the op allocated (an output that shares no input's storage), priced or
        free (torch.empty): what reads it waits for what writes it from now on, never for a freed buffer's writer."""
        inputs = {_storage(t) for t in _tensors((args, kwargs))}
        for storage in {_storage(t) for t in _tensors(out)} - inputs:
            self._generation[storage] = self._generation.get(storage, 0) + 1

    def _record(self, func, args, kwargs, out) -> None:
        name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
        if name in _FREE or name.startswith(_FREE_PREFIXES) or getattr(func, "is_view", False):
            return
        if self.ledger is not None and self.ledger.moving:
            return  # the ledger's own copy of an offloaded tensor: priced as the transfer it stands for
        if name in _SYNC:
            if not (self.phase == "optimizer" and _host_scalar(args)):
                self.ops.append(Op("compute", "sync", self.phase, 0.0, 0.0, (), (), name=name))
            return
        schema = getattr(func, "_schema", None)
        collective = COLLECTIVES.get(schema.name) if schema is not None else None
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        if collective is not None:
            self._collective(schema.name, collective[0], args, kwargs, outputs)
            return
        if name.startswith("fsdp."):
            stream = "ag" if "all_gather_copy_in" in name else "compute"
        else:
            stream = "host" if self._on_host() else "compute"
        reads = tuple({self._key(t) for t in inputs})
        written = outputs + work.mutated(func, args, kwargs)
        writes = tuple({self._key(t) for t in written})
        shape = ()
        if name == "fsdp.split_with_sizes_copy":
            kind, count = "copy_out", 0.0  # FSDP2's all-gather copy-out: the next all-gather may start after it
        elif name in flops.GEMM:
            kind, (count, shape) = "gemm", flops.gemm(name, args)
        elif name in flops.ATTENTION:
            spec = flops.ATTENTION[name]
            family = spec.family
            masked = spec.family == "_sdpa" and work.schema_arg(func, args, kwargs, "attn_mask") is not None
            if self.attention_family is not None and family in ("", "_cudnn", "_sdpa"):
                family = self.attention_family
            elif masked:
                family = "_efficient"  # the model's own SDPA call with a mask: CUDA's SDPA takes this kernel
            flash = None
            if self.attention_family is not None and masked:  # the flash path's view of the call, not the mask's
                flash = self.flash_call if spec.direction == "forward" else self._flash_of.get(self._key(args[4]))
            count, shape = flops.attention(name, args, kwargs, flash)
            if flash is not None and spec.direction == "forward" and outputs:
                self._flash_of[self._key(outputs[0])] = flash
            kind = f"attention{family}_{spec.direction}"
        else:
            kind, count = "memory", 0.0
        backward = _in_backward()
        moved = work.moved_bytes(name, args, kwargs, inputs, written, backward=backward and not _recomputing())
        if name == "fsdp.all_gather_copy_in":
            self._onto_copy_in_stream(_tensors(args[0]))
        self.ops.append(Op(stream, kind, self.phase, float(count), float(moved), reads, writes, name=name,
                           shape=shape + (work.tensor_bytes(outputs[0]),) if kind == "gemm" and outputs else shape,
                           tensors=len(inputs), strided=kind == "memory" and work.strided(inputs, written),
                           backward=backward, selective=under_op_policy()))
        for key in writes:  # a reduce-scatter's input, copied in on the compute stream, is reduced on FSDP2's own
            self._stream_of[key] = "rs" if name == "fsdp.chunk_cat" else stream
            self._writer[key] = len(self.ops) - 1

    def _onto_copy_in_stream(self, inputs: list[torch.Tensor]) -> None:
        """FSDP2 computes an all-gather's inputs (the cast of each shard to the parameters' dtype, a `_foreach_copy_`
        into a fresh buffer) on its all-gather copy-in stream, as it runs the copy-in (_fsdp_collectives.py
        foreach_all_gather: `_get_param_all_gather_inputs` under `all_gather_copy_in_stream`), so that a layer's
        all-gather is prepared while the layer before it computes: the kernels of this step that wrote the copy-in's
        inputs move onto that stream. Its inputs only, not the output buffer it is handed (a fresh allocation, whose
        storage may be a freed one's); a shard that needs no cast was last written by the optimizer, not this step."""
        for key in {self._key(t) for t in inputs}:
            at = self._writer.get(key)
            op = self.ops[at] if at is not None else None
            if op is not None and op.stream == "compute" and op.phase == "step" and op.kind == "memory":
                self.ops[at] = op._replace(stream="ag")
                for k in op.writes:
                    self._stream_of[k] = "ag"

    def _on_host(self) -> bool:
        tracker = getattr(self.ledger, "tracker", None)
        return bool(getattr(tracker, "_in_host_phase", False))

    def _collective(self, op_name: str, kind: str, args, kwargs, outputs) -> None:
        size, ranks = group_of(args, kwargs)
        per_node = Counter(r // self.gpus_per_node for r in ranks)  # the group's ranks on each node it spans
        functional = op_name.startswith("_c10d_functional")
        sent_at = 0 if functional or kind in ("p2p", "all_reduce") else 1
        receive, send = op_name.startswith("c10d::recv"), op_name == "c10d::send"
        sent = [] if receive else _tensors(args[sent_at]) if sent_at < len(args) else []
        written = outputs if functional else [] if send else _tensors(args[0])
        reads = tuple({self._key(t) for t in sent})
        writers = {self._stream_of.get(k) for k in reads}
        stream = next((s for s in ("ag", "rs") if s in writers), "nccl")  # FSDP2's own streams, or NCCL's
        # A ring step sends and receives at once (full duplex): the receive carries the step's time, so what reads
        # the received block waits for it; the send is free.
        nbytes = _nbytes(written) if receive else 0 if send else _nbytes(sent)
        self.ops.append(Op(stream, kind, self.phase, 0.0, float(nbytes), reads, tuple({self._key(t) for t in written}),
                           size, len(per_node) > 1, nodes=len(per_node), fewest=min(per_node.values(), default=0),
                           backward=_in_backward()))
        for t in written:
            self._stream_of[self._key(t)] = stream


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward pass here (its graph task: the backward's own ops, a
    recomputed layer's replay, the hooks it runs)."""
    return torch._C._current_graph_task_id() != -1


def _recomputing() -> bool:
    """Whether a checkpointed forward is being replayed in backward (torch.utils.checkpoint's non-reentrant
    recomputation, which cpbench's recompute, tiled MLP and chunked loss all use, runs under its
    `_recomputation_hook`): its ops are the model's forward, not autograd's backward formulas."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and "_recomputation_hook" in getattr(hooks[0], "__qualname__", "")


def _host_scalar(args) -> bool:
    """A 0-dim tensor read back in the optimizer step: AdamW's `step` count, which torch keeps on the host unless the
    optimizer is capturable or fused (torch/optim/adam.py), so reading it waits for no GPU work."""
    return bool(args) and isinstance(args[0], torch.Tensor) and args[0].dim() == 0
