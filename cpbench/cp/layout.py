"""Which tokens of a sequence a cp rank holds.

A sequence of `seq_len` tokens is padded to `padded_len` (a multiple of the number of chunks) and cut into
chunks. `contiguous` gives rank r chunk r of cp; `zigzag` cuts 2*cp chunks and gives rank r chunks r and
2*cp-1-r, so that every rank does the same causal attention work. Padding positions (>= seq_len) are never
attended to and never counted in the loss.

With `ulysses` u > 1 (the hybrid `cp_usp`: Ulysses inside groups of u consecutive ranks, the ring across the
cp/u groups), zigzag is the ring's: ring rank g holds the ring chunks g and 2(cp/u)-1-g, and the u ranks of its
group hold consecutive u-th parts of those (2cp chunks in all, two per rank), so that Ulysses' all-to-all inside
the group gathers exactly the ring's zigzag slice, in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist
import torch.nn.functional as F

LAYOUT_KINDS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class SequenceLayout:
    seq_len: int
    cp_size: int
    rank: int
    kind: str = "contiguous"
    ulysses: int = 1  # the Ulysses degree of cp_usp (see above)
    pad_multiple: int = 1  # padded_len is a multiple of num_chunks * pad_multiple (cp_usp's ring view)
    # The forward's batch (documents, padding) for the attention styles that need it (`batch_mask.BatchFacts`);
    # not part of the layout's identity.
    facts: object = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.kind not in LAYOUT_KINDS:
            raise ValueError(f"Unknown sequence layout {self.kind!r}; known layouts are {list(LAYOUT_KINDS)}.")
        assert 0 <= self.rank < self.cp_size and self.seq_len > 0 and self.cp_size % self.ulysses == 0

    @property
    def num_chunks(self) -> int:
        return self.cp_size * (2 if self.kind == "zigzag" else 1)

    @property
    def padded_len(self) -> int:
        step = self.num_chunks * self.pad_multiple
        return -(-self.seq_len // step) * step

    @property
    def chunk_len(self) -> int:
        return self.padded_len // self.num_chunks

    @property
    def local_len(self) -> int:
        return self.padded_len // self.cp_size

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        if self.kind == "zigzag" and self.ulysses > 1:
            u = self.ulysses
            group, member = divmod(rank, u)
            ring = self.cp_size // u
            held = [*range(group * u, (group + 1) * u), *range((2 * ring - 1 - group) * u, (2 * ring - group) * u)]
            return tuple(held[2 * member : 2 * member + 2])
        if self.kind == "zigzag":
            return (rank, 2 * self.cp_size - 1 - rank)
        return (rank,)

    def positions_of(self, rank: int) -> list[int]:
        """Global (padded) positions held by `rank`, in the order the rank holds them."""
        return [c * self.chunk_len + i for c in self.chunks_of(rank) for i in range(self.chunk_len)]

    @cached_property
    def positions(self) -> list[int]:
        return self.positions_of(self.rank)

    def local_positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.tensor(self.positions, device=device, dtype=torch.long)

    def pad(self, x: torch.Tensor, dim: int, value: float = 0.0) -> torch.Tensor:
        """Pads `x` along `dim` from `seq_len` to `padded_len`."""
        extra = self.padded_len - x.shape[dim]
        if extra == 0:
            return x
        dim = dim % x.dim()
        pad = [0, 0] * (x.dim() - 1 - dim) + [0, extra]
        return F.pad(x, pad, value=value)

    def cut(self, x: torch.Tensor, dim: int, pad_value: float = 0.0) -> torch.Tensor:
        """This rank's tokens of a full-length `x` (padded first if needed)."""
        x = self.pad(x, dim, pad_value)
        if self.kind == "contiguous":
            return x.narrow(dim, self.rank * self.local_len, self.local_len)
        return torch.cat([x.narrow(dim, c * self.chunk_len, self.chunk_len) for c in self.chunks_of(self.rank)], dim)

    @property
    def valid_len(self) -> int:
        """How many of this rank's positions are real tokens. Padding sits at the global end and every rank
        holds its chunks in increasing order, so the real ones are always a prefix of the rank's slice."""
        return sum(p < self.seq_len for p in self.positions)

    def rank_order(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The global positions of rank 0's tokens, then rank 1's, ...: what concatenating the slices gives."""
        return torch.tensor([p for r in range(self.cp_size) for p in self.positions_of(r)], device=device)

    def inverse_rank_order(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Indices that put the rank-ordered concatenation back in global order."""
        order = self.rank_order()
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        return inverse.to(device)

    def restore(self, slices: list[torch.Tensor], dim: int) -> torch.Tensor:
        """Puts every rank's slice back in global order and drops the padding."""
        assert len(slices) == self.cp_size
        stacked = torch.cat(slices, dim)
        return stacked.index_select(dim, self.inverse_rank_order(stacked.device)).narrow(dim, 0, self.seq_len)


def gather_sequence(
    local: torch.Tensor, layout: SequenceLayout, group: dist.ProcessGroup | None, dim: int = 1
) -> torch.Tensor:
    """Rebuilds the full sequence (global order, padding dropped) from every cp rank's slice.

    `local` is this rank's slice as the model returns it: its `layout.local_len` positions, or only the real
    ones when the rank's tail is padding (the logits of the last contiguous rank). Not differentiable.
    """
    local = local.contiguous()
    valid = layout.valid_len
    if local.shape[dim] == valid and valid != layout.local_len:
        local = _pad_to(local, dim, layout.local_len)
    elif local.shape[dim] != layout.local_len:
        raise ValueError(
            f"gather_sequence: dim {dim} has {local.shape[dim]} positions, but this rank holds "
            f"{layout.local_len} ({valid} of them real) under {layout}."
        )
    slices = [torch.empty_like(local) for _ in range(layout.cp_size)]
    dist.all_gather(slices, local, group=group)
    return layout.restore(slices, dim)


def _pad_to(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = length - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim)
