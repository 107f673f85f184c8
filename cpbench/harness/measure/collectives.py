"""Counting the collectives of a step, by kind, as the process group's ops are dispatched.

torch.distributed calls its process group through dispatcher ops (`torch.ops.c10d.*`, and the functional
`_c10d_functional.*`), so a dispatch mode sees every collective of a rank whatever the backend: gloo or NCCL in
a measured run, the fake process group in a projection (where the count is exact: the same code posts the same
ops). Bytes are what this rank hands to the collective: its shard for an all-gather, its whole input for a
reduce-scatter, all-to-all or all-reduce, the sent tensors for point-to-point (each send has a matching receive
on the peer, so receives are not counted again).
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

KINDS = ("all_gather", "reduce_scatter", "all_to_all", "p2p", "all_reduce")

# op name (without overload) -> (kind, index of the argument holding what this rank sends, or None: count only)
_OPS = {
    "c10d::_allgather_base_": ("all_gather", 1),
    "c10d::allgather_": ("all_gather", 1),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", 1),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", 0),
    "_c10d_functional::all_gather_into_tensor_out": ("all_gather", 0),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", 0),
    "c10d::alltoall_base_": ("all_to_all", 1),
    "c10d::alltoall_": ("all_to_all", 1),
    "_c10d_functional::all_to_all_single": ("all_to_all", 0),
    "c10d::send": ("p2p", 0),
    "c10d::recv_": ("p2p", None),
    "c10d::recv_any_source_": ("p2p", None),
    "c10d::allreduce_": ("all_reduce", 0),
    "c10d::allreduce_coalesced_": ("all_reduce", 0),
    "_c10d_functional::all_reduce": ("all_reduce", 0),
    "_c10d_functional::all_reduce_": ("all_reduce", 0),
}


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class CollectiveCounter(TorchDispatchMode):
    """While entered: how many collectives of each kind this rank posted, and the bytes it handed to them.
    A point-to-point receive counts as a transfer (`p2p_count`) without bytes."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self.bytes: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor desugar into the local ops (and collectives) it runs
        op = _OPS.get(func._schema.name) if hasattr(func, "_schema") else None
        if op is not None:
            kind, sent = op
            self.counts[kind] += 1
            if sent is not None:
                self.bytes[kind] += _nbytes(args[sent])
        return func(*args, **(kwargs or {}))

    def columns(self) -> dict:
        """The schema's `comm_<kind>_count` / `comm_<kind>_bytes` columns."""
        out = {}
        for kind in KINDS:
            out[f"comm_{kind}_count"] = self.counts[kind]
            out[f"comm_{kind}_bytes"] = self.bytes[kind]
        return out


def group_of(args, kwargs) -> tuple[int, list[int]]:
    """The size and ranks of the process group a collective op runs on (1, [] where it names none)."""
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
