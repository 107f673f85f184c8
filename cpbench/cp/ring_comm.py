"""Point-to-point exchange around a cp group's ring: send to the next rank, receive from the previous one.

`exchange` posts both transfers and returns at once, so the caller computes the current block while the next
one travels; `wait` hands over the received tensor. Group ranks are mapped to global ranks, as torch.distributed
p2p needs. A `P2PCounter` passed in counts every transfer per phase (tests assert the algorithm's count).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# Distinct tags keep K/V blocks and dK/dV accumulators, which travel between the same ranks at overlapping
# times in backward, from being matched to each other's receives.
KV_TAG, DKV_TAG = 0, 1


@dataclass
class P2PCounter:
    """Point-to-point transfers this rank posted, by phase ("forward", "backward"): one tensor sent = one send."""

    sends: Counter = field(default_factory=Counter)
    recvs: Counter = field(default_factory=Counter)
    bytes_sent: Counter = field(default_factory=Counter)


class Pending:
    def __init__(self, requests, received: torch.Tensor, sent: torch.Tensor):
        self._requests = requests
        self._received = received
        self._sent = sent  # kept alive until the send completes

    def wait(self) -> torch.Tensor:
        for r in self._requests:
            r.wait()
        self._sent = None
        return self._received


class RingComm:
    def __init__(self, group: dist.ProcessGroup | None, counter: P2PCounter | None = None):
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.size)
        self.counter = counter

    def exchange(self, send: torch.Tensor, *, phase: str, tag: int) -> Pending:
        """Sends `send` to the next rank and receives a tensor like it from the previous rank."""
        send = send.contiguous()
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ]
        requests = dist.batch_isend_irecv(ops)
        if self.counter is not None:
            self.counter.sends[phase] += 1
            self.counter.recvs[phase] += 1
            self.counter.bytes_sent[phase] += send.numel() * send.element_size()
        return Pending(requests, recv, send)
