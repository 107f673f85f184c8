"""Point-to-point exchange around a cp group's ring: send to the next rank, receive from the previous one.

`exchange` posts the transfers of a few tensors (K and V, or dK and dV: sent as they are, so no packed copy is
made) and returns at once, so the caller computes the current block while the next one travels; `wait` hands
over the received tensors. Group ranks are mapped to global ranks, as torch.distributed
p2p needs. A `P2PCounter` passed in counts every transfer per phase (tests assert the algorithm's count).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# Distinct tags keep K/V blocks and dK/dV accumulators, which travel between the same ranks at overlapping
# times in backward, from being matched to each other's receives (tensor i of an exchange adds 2 * i).
KV_TAG, DKV_TAG = 0, 1


@dataclass
class P2PCounter:
    """Point-to-point transfers this rank posted, by phase ("forward", "backward"): one tensor sent = one send."""

    sends: Counter = field(default_factory=Counter)
    recvs: Counter = field(default_factory=Counter)
    bytes_sent: Counter = field(default_factory=Counter)


class Pending:
    def __init__(self, requests, received: tuple[torch.Tensor, ...], sent: tuple[torch.Tensor, ...]):
        self._requests = requests
        self._received = received
        self._sent = sent  # kept alive until the sends complete

    def wait(self) -> tuple[torch.Tensor, ...]:
        for r in self._requests:
            r.wait()
        # The requests reference the sent tensors too: drop both, so a sent buffer is freed now, not when this
        # object goes.
        self._requests, self._sent = (), None
        return self._received


class RingComm:
    def __init__(self, group: dist.ProcessGroup | None, counter: P2PCounter | None = None):
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.size)
        self.counter = counter

    def exchange(self, *tensors: torch.Tensor, phase: str, tag: int) -> Pending:
        """Sends each tensor to the next rank and receives one like it from the previous rank. A ring of one rank
        (cp_usp with its Ulysses degree equal to cp_size) is its own neighbour: the tensors come back as they are."""
        if self.size == 1:
            return Pending((), tensors, ())
        sent = tuple(t.contiguous() for t in tensors)
        received = tuple(torch.empty_like(t) for t in sent)
        ops = []
        for i, (s, r) in enumerate(zip(sent, received)):
            ops.append(dist.P2POp(dist.isend, s, self.next, self.group, tag + 2 * i))
            ops.append(dist.P2POp(dist.irecv, r, self.prev, self.group, tag + 2 * i))
        requests = dist.batch_isend_irecv(ops)
        if self.counter is not None:
            self.counter.sends[phase] += len(sent)
            self.counter.recvs[phase] += len(sent)
            self.counter.bytes_sent[phase] += sum(t.numel() * t.element_size() for t in sent)
        return Pending(requests, received, sent)
