"""The op trace of one projected step: every kernel and collective of the fake step, with what the time model needs.

A dispatch mode over the same fake step that `estimate` projects (measure/step.py), so the ops are the real step's:
its shapes, dtypes, kernel choices (the CP code's own flash / memory-efficient / varlen tiles), its collectives with
their groups and bytes. Each op becomes an `Op`: the stream the code puts it on, its FLOPs and the bytes it moves,
the buffers it reads and writes (so the time model can tell what waits for what), and for a collective its group.
Nothing here knows a GPU; timing.py prices the trace for one, and prices it again for another (calibrate.py).

Streams, as cpbench's code and the libraries under it schedule the work:
- `compute`: every kernel of the model, the loss, the optimizer, and transformers' activation offload copies (its
  `save_on_cpu` copies on the current stream);
- `ag`: FSDP2's all-gather copy-in and all-gather (its own streams, which wait only for the previous copy-out);
- `rs`: FSDP2's reduce-scatter input copy and reduce-scatter (after the gradients: they wait for compute), and the
  gradient copies to the host under parameter offload;
- `nccl`: every other collective (ring send/receive, Ulysses all-to-all, all-reduce): torch's NCCL process group
  waits for the compute stream when a collective is issued.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from cpbench.harness.measure.collectives import _OPS as COLLECTIVES


class Op(NamedTuple):
    stream: str  # compute | ag | rs | nccl | host
    # gemm | attention[_cudnn|_efficient|_sdpa]_{forward,backward} | memory | copy_out | sync | a collective | h2d
    # | d2h. `_sdpa`: the model called SDPA itself, which picks its kernel on the GPU (hardware.sdpa_kernel)
    kind: str
    phase: str  # step | optimizer
    flops: float
    bytes: float  # bytes moved through HBM (a kernel), sent (a collective), copied (a transfer)
    reads: tuple  # buffer keys
    writes: tuple
    group: int = 1  # a collective's group size
    crosses_nodes: bool = False


_FREE_PREFIXES = ("profiler.", "prim.", "fsdp.copy_")  # bookkeeping ops and queries: no kernel
_FREE = {"aten.detach", "aten.alias", "aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty",
         "aten.new_empty_strided", "aten.lift_fresh", "aten.set_", "aten.resize_", "aten.record_stream",
         "aten._unsafe_view", "aten.view", "aten._reshape_alias", "aten.t", "aten.sym_size", "aten.sym_stride",
         "aten.sym_numel", "aten.is_same_size", "aten.sym_storage_offset", "aten._has_compatible_shallow_copy_type"}
_SYNC = {"aten._local_scalar_dense", "aten.nonzero", "aten.item", "aten.equal", "aten.is_nonzero"}
_GEMM = {"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._scaled_mm"}
# attention kernel -> (direction, kernel family, index of `is_causal` among the arguments, layout of q/k: bhsd | bshd)
_ATTENTION = {
    # torch's CPU flash kernel: what a projection's fake CPU tensors dispatch where the model calls SDPA itself
    # (no CP, Ulysses); a CUDA run takes the flash kernel there (or, with a mask, the memory-efficient one)
    "aten._scaled_dot_product_flash_attention_for_cpu": ("forward", "", 4, "bhsd"),
    "aten._scaled_dot_product_flash_attention_for_cpu_backward": ("backward", "", 7, "bhsd"),
    "aten._scaled_dot_product_flash_attention": ("forward", "", 4, "bhsd"),
    "aten._scaled_dot_product_flash_attention_backward": ("backward", "", 11, "bhsd"),
    "aten._scaled_dot_product_efficient_attention": ("forward", "_efficient", 6, "bhsd"),
    "aten._scaled_dot_product_efficient_attention_backward": ("backward", "_efficient", 11, "bhsd"),
    "aten._scaled_dot_product_cudnn_attention": ("forward", "_cudnn", 6, "bhsd"),
    "aten._scaled_dot_product_cudnn_attention_backward": ("backward", "_cudnn", 9, "bhsd"),
    "aten._flash_attention_forward": ("forward", "", 8, "bshd"),
    "aten._flash_attention_backward": ("backward", "", 11, "bshd"),
    "aten._efficient_attention_forward": ("forward", "_efficient", None, "bshd"),
    "aten._efficient_attention_backward": ("backward", "_efficient", None, "bshd"),
    "flash_attn._flash_attn_forward": ("forward", "", 5, "bshd"),
    "flash_attn._flash_attn_backward": ("backward", "", 8, "bshd"),
    "flash_attn._flash_attn_varlen_forward": ("forward", "", 9, "bshd"),
    "flash_attn._flash_attn_varlen_backward": ("backward", "", 12, "bshd"),
}


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def causal_pairs(q_len: int, k_len: int) -> int:
    """Query-key pairs a causal kernel computes, queries aligned to the first key (torch's `is_causal`)."""
    if q_len <= k_len:
        return q_len * (q_len + 1) // 2
    return k_len * (k_len + 1) // 2 + (q_len - k_len) * k_len


def attention_flops(name: str, args) -> float:
    """FLOPs of one attention kernel call: forward 4 x pairs x head_dim per head (QK^T and PV), backward 2.5 x that
    (five matmuls against two: the FlashAttention papers' convention). A causal call counts the pairs it keeps; a
    varlen call counts each document's own pairs when its offsets are known."""
    direction, _, causal_at, layout = _ATTENTION[name]
    q, k = (args[1], args[2]) if direction == "backward" else (args[0], args[1])
    causal = bool(args[causal_at]) if causal_at is not None and len(args) > causal_at else False
    if layout == "bhsd":
        batch, heads, q_len, dim = q.shape
        k_len = k.shape[-2]
        pairs = batch * (causal_pairs(q_len, k_len) if causal else q_len * k_len)
    else:  # [batch, seq, heads, dim], or varlen [tokens, heads, dim] with offsets
        heads, dim = q.shape[-2], q.shape[-1]
        pairs = _varlen_pairs(name, args, q, k, causal)
    forward = 4.0 * pairs * heads * dim
    return forward * (2.5 if direction == "backward" else 1.0)


def _varlen_pairs(name: str, args, q, k, causal: bool) -> int:
    if q.dim() == 4:
        lengths = [(q.shape[1], k.shape[1])] * q.shape[0]
    else:
        at = {"aten._flash_attention_forward": 3, "aten._flash_attention_backward": 6,
              "flash_attn._flash_attn_varlen_forward": 3, "flash_attn._flash_attn_varlen_backward": 7}.get(name)
        lengths = [(q.shape[0], k.shape[0])]
        if at is not None and args[at] is not None:
            try:  # the offsets are known values in a projection when they derive from the batch's positions
                cq, ck = args[at].tolist(), args[at + 1].tolist()
                lengths = [(cq[i + 1] - cq[i], ck[i + 1] - ck[i]) for i in range(len(cq) - 1)]
            except Exception:  # noqa: BLE001 - unknown offsets: one sequence of all the tokens (an upper bound)
                pass
    return sum(causal_pairs(a, b) if causal else a * b for a, b in lengths)


def _group(args, kwargs) -> tuple[int, list[int]]:
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
            a = dist.ProcessGroup.unbox(a)  # how the dispatcher hands c10d ops their group
        if isinstance(a, dist.ProcessGroup):
            return a.size(), dist.get_process_group_ranks(a)
        if isinstance(a, str):
            try:
                from torch.distributed.distributed_c10d import _resolve_process_group

                pg = _resolve_process_group(a)
                return pg.size(), dist.get_process_group_ranks(pg)
            except Exception:  # noqa: BLE001 - not a group name
                continue
    return 1, []


class StepTrace(TorchDispatchMode):
    """While entered: the ops of this rank's step (`ops`). `ledger`: the probe's HostLedger, whose moves become
    transfers; `gpus_per_node`: whether a collective's group leaves its node."""

    def __init__(self, ledger=None, gpus_per_node: int = 8):
        super().__init__()
        self.ops: list[Op] = []
        self.phase = "step"
        self.gpus_per_node = gpus_per_node
        self._stream_of: dict[int, str] = {}  # buffer key -> the stream that wrote it last
        self.ledger = ledger
        if ledger is not None:
            ledger.listeners.append(self._moved)

    def close(self) -> None:
        if self.ledger is not None and self._moved in self.ledger.listeners:
            self.ledger.listeners.remove(self._moved)

    def _moved(self, direction: str, nbytes: int, what: str) -> None:
        stream = {"params": "ag", "grads": "rs"}.get(what, "compute")
        self.ops.append(Op(stream, direction, self.phase, 0.0, float(nbytes), (), ()))

    def optimizer_hooks(self, optimizer):
        """Marks the optimizer step's ops (its own share of the breakdown); returns the hook handles."""
        def pre(*_):
            self.phase = "optimizer"

        def post(*_):
            self.phase = "step"

        return [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        self._record(func, args, kwargs, out)
        return out

    def _record(self, func, args, kwargs, out) -> None:
        name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
        if name in _FREE or name.startswith(_FREE_PREFIXES) or getattr(func, "is_view", False):
            return
        if self.ledger is not None and self.ledger.moving:
            return  # the ledger's own copy of an offloaded tensor: priced as the transfer it stands for
        if name in _SYNC:
            self.ops.append(Op("compute", "sync", self.phase, 0.0, 0.0, (), ()))
            return
        schema = getattr(func, "_schema", None)
        collective = COLLECTIVES.get(schema.name) if schema is not None else None
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        if collective is not None:
            self._collective(schema.name, collective[0], args, kwargs, outputs)
            return
        if name.startswith("fsdp."):
            stream = "ag" if "all_gather_copy_in" in name else "rs" if "chunk_cat" in name else "compute"
        else:
            stream = "host" if self._on_host() else "compute"
        reads = tuple({_key(t) for t in inputs})
        written = outputs + _tensors((kwargs or {}).get("out"))  # an in-place op returns the tensor it wrote
        writes = tuple({_key(t) for t in written})
        if name == "fsdp.split_with_sizes_copy":
            kind, flops = "copy_out", 0.0  # FSDP2's all-gather copy-out: the next all-gather may start after it
        elif name in _GEMM:
            kind, flops = "gemm", _gemm_flops(name, args)
        elif name in _ATTENTION:
            direction, family, _, _ = _ATTENTION[name]
            if name.endswith(("_for_cpu", "_for_cpu_backward")):  # the model's own SDPA call
                # a mask: CUDA's SDPA takes the memory-efficient kernel; else the one the GPU's torch prefers
                family = "_efficient" if (kwargs or {}).get("attn_mask") is not None else "_sdpa"
            kind, flops = f"attention{family}_{direction}", attention_flops(name, args)
        else:
            kind, flops = "memory", 0.0
        moved = _nbytes(inputs) + _nbytes(outputs)  # read, then written (an in-place op: both; `out=` is an input)
        self.ops.append(Op(stream, kind, self.phase, float(flops), float(moved), reads, writes))
        for key in writes:
            self._stream_of[key] = stream

    def _on_host(self) -> bool:
        tracker = getattr(self.ledger, "tracker", None)
        return bool(getattr(tracker, "_in_host_phase", False))

    def _collective(self, op_name: str, kind: str, args, kwargs, outputs) -> None:
        size, ranks = _group(args, kwargs)
        nodes = {r // self.gpus_per_node for r in ranks}
        functional = op_name.startswith("_c10d_functional")
        sent_at = 0 if functional or kind in ("p2p", "all_reduce") else 1
        receive, send = op_name.startswith("c10d::recv"), op_name == "c10d::send"
        sent = [] if receive else _tensors(args[sent_at]) if sent_at < len(args) else []
        written = outputs if functional else [] if send else _tensors(args[0])
        reads = tuple({_key(t) for t in sent})
        writers = {self._stream_of.get(k) for k in reads}
        stream = next((s for s in ("ag", "rs") if s in writers), "nccl")  # FSDP2's own streams, or NCCL's
        # A ring step sends and receives at once (full duplex): the receive carries the step's time, so what reads
        # the received block waits for it; the send is free.
        nbytes = _nbytes(written) if receive else 0 if send else _nbytes(sent)
        self.ops.append(Op(stream, kind, self.phase, 0.0, float(nbytes), reads, tuple({_key(t) for t in written}),
                           size, len(nodes) > 1))
        for t in written:
            self._stream_of[_key(t)] = stream


def _gemm_flops(name: str, args) -> float:
    if name == "aten.addmm":
        a, b = args[1], args[2]
    elif name == "aten.baddbmm":
        a, b = args[1], args[2]
    else:
        a, b = args[0], args[1]
    batch = a.shape[0] if a.dim() == 3 else 1
    m, k = a.shape[-2], a.shape[-1]
    return 2.0 * batch * m * k * b.shape[-1]
