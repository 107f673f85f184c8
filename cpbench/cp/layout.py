"""Which tokens of a sequence a cp rank holds.

A sequence of `seq_len` tokens is padded to `padded_len` (a multiple of the number of chunks) and cut into
chunks. `contiguous` gives rank r chunk r of cp; `zigzag` cuts 2*cp chunks and gives rank r chunks r and
2*cp-1-r, so that every rank does the same causal attention work. Padding positions (>= seq_len) are never
attended to and never counted in the loss.

On packed documents the zigzag's balance is lost (each document restarts the work), so a zigzag layout made for a
forward's batch (`balanced`) holds a `Placement` (cp/balance.py): each of the 2*ring chunks becomes a *slot* of
runs of positions (a chunk of every long document, whole short documents) with the same number of tokens, and rank
r holds slots r and 2*ring-1-r. Everything below reads a rank's tokens from its runs (`runs_of`), so cutting,
restoring, the logits, the loss and `gather_sequence` follow either layout.

With `ulysses` u > 1 (the hybrid `cp_usp`: Ulysses inside groups of u consecutive ranks, the ring across the
cp/u groups), zigzag is the ring's: ring rank g holds the ring chunks (slots) g and 2(cp/u)-1-g, and the u ranks of
its group hold consecutive u-th parts of those, so that Ulysses' all-to-all inside the group gathers exactly the
ring's zigzag slice, in order (`ring_view` is that ring's layout).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpbench.cp.balance import BALANCE_MODES, Placement, place

LAYOUT_KINDS = ("contiguous", "zigzag")
INDEXED_RUNS = 4  # a slice of more runs than this is cut with one index_select rather than a narrow per run

Runs = tuple[tuple[int, int], ...]


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
    # The per-document placement of the ring's slots (`balanced`); None: the plain chunks.
    placement: Placement | None = field(default=None, repr=False)
    _index: dict = field(default_factory=dict, compare=False, repr=False, hash=False)  # device -> positions tensor

    def __post_init__(self):
        if self.kind not in LAYOUT_KINDS:
            raise ValueError(f"Unknown sequence layout {self.kind!r}; known layouts are {list(LAYOUT_KINDS)}.")
        assert 0 <= self.rank < self.cp_size and self.seq_len > 0 and self.cp_size % self.ulysses == 0

    def balanced(self, mode: str = "documents") -> SequenceLayout:
        """This layout with its slots placed by the forward's documents (`mode` "documents"), or as it is ("sequence",
        a contiguous layout, no batch facts, or a batch the plain zigzag already balances)."""
        if mode not in BALANCE_MODES:
            raise ValueError(f"balance mode {mode!r}: use one of {list(BALANCE_MODES)} (\"sequence\" turns the "
                             "per-document balance off).")
        if mode == "sequence" or self.kind != "zigzag" or self.facts is None or self.placement is not None:
            return self
        batch = self.facts.get()
        placement = place(batch, self.padded_len, self.ring_slots) if batch is not None else None
        return replace(self, placement=placement, _index={}) if placement is not None else self

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

    @property
    def ring_slots(self) -> int:
        """The slots of the ring this layout belongs to: 2 per ring rank (zigzag), 1 (contiguous)."""
        return self.num_chunks // self.ulysses

    def ring_view(self) -> SequenceLayout:
        """The layout of the ring across the Ulysses groups (cp_usp): ring rank `rank // ulysses`, the same padding
        and placement; the group's members hold its slice in member order."""
        if self.ulysses == 1:
            return self
        return SequenceLayout(self.seq_len, self.cp_size // self.ulysses, self.rank // self.ulysses, self.kind,
                              pad_multiple=self.ulysses * self.pad_multiple, facts=self.facts,
                              placement=self.placement)

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

    def slot_runs(self, chunk: int) -> Runs:
        """The global positions of one chunk (ring slot) of a layout without Ulysses groups, as runs."""
        assert self.ulysses == 1
        if self.placement is not None:
            return self.placement.slots[chunk]
        n = self.chunk_len
        return ((chunk * n, (chunk + 1) * n),)

    def runs_of(self, rank: int) -> Runs:
        """The global (padded) positions `rank` holds, as runs in the order the rank holds them."""
        if self.placement is None:
            n = self.chunk_len
            return _joined((c * n, (c + 1) * n) for c in self.chunks_of(rank))
        if self.ulysses == 1:
            return _joined(r for c in self.chunks_of(rank) for r in self.placement.slots[c])
        group, member = divmod(rank, self.ulysses)
        return _part(self.ring_view().runs_of(group), member * self.local_len, self.local_len)

    def positions_of(self, rank: int) -> list[int]:
        """Global (padded) positions held by `rank`, in the order the rank holds them."""
        return [p for a, b in self.runs_of(rank) for p in range(a, b)]

    @cached_property
    def positions(self) -> list[int]:
        return self.positions_of(self.rank)

    def local_positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        key = str(device)
        if key not in self._index:
            runs = self.runs_of(self.rank)
            self._index[key] = torch.cat([torch.arange(a, b) for a, b in runs]).to(device)
        return self._index[key]

    def pad(self, x: torch.Tensor, dim: int, value: float = 0.0) -> torch.Tensor:
        """Pads `x` along `dim` from `seq_len` to `padded_len`."""
        extra = self.padded_len - x.shape[dim]
        if extra == 0:
            return x
        dim = dim % x.dim()
        pad = [0, 0] * (x.dim() - 1 - dim) + [0, extra]
        return F.pad(x, pad, value=value)

    def cut(self, x: torch.Tensor, dim: int, pad_value: float = 0.0) -> torch.Tensor:
        """This rank's tokens of a full-length `x` (padded first if needed). A contiguous layout's slice is a view of
        `x`; a zigzag one is its own tensor, even where its runs join into one (zigzag rank cp-1 of an unplaced layout):
        a view would keep the whole of `x` alive for as long as the slice is saved."""
        x = self.pad(x, dim, pad_value)
        runs = self.runs_of(self.rank)
        if len(runs) == 1 and self.kind == "contiguous":
            return x.narrow(dim, runs[0][0], runs[0][1] - runs[0][0])
        if len(runs) <= INDEXED_RUNS:
            return torch.cat([x.narrow(dim, a, b - a) for a, b in runs], dim)
        return x.index_select(dim, self.local_positions(x.device))

    @property
    def valid_len(self) -> int:
        """How many of this rank's positions are real tokens. Padding sits at the global end and every rank's slice
        ends with it (the chunks in increasing order; a placement's padding ends the tail slots), so the real ones
        are always a prefix of the rank's slice."""
        return sum(max(0, min(b, self.seq_len) - a) for a, b in self.runs_of(self.rank))

    def rank_order(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The global positions of rank 0's tokens, then rank 1's, ...: what concatenating the slices gives."""
        runs = [r for rank in range(self.cp_size) for r in self.runs_of(rank)]
        return torch.cat([torch.arange(a, b) for a, b in runs]).to(device)

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


def _joined(runs) -> Runs:
    """Runs in order, adjacent ones joined."""
    out: list[list[int]] = []
    for a, b in runs:
        if out and out[-1][1] == a:
            out[-1][1] = b
        elif b > a:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def _part(runs: Runs, offset: int, length: int) -> Runs:
    """The runs of positions [offset, offset + length) of the concatenation of `runs`."""
    out, seen = [], 0
    for a, b in runs:
        lo, hi = max(a, a + offset - seen), min(b, a + offset + length - seen)
        if hi > lo:
            out.append((lo, hi))
        seen += b - a
    return tuple(out)


def gather_sequence(
    local: torch.Tensor, layout: SequenceLayout, group: dist.ProcessGroup | None, dim: int = 1
) -> torch.Tensor:
    """Rebuilds the full sequence (global order, padding dropped) from every cp rank's slice.

    `local` is this rank's slice as the model returns it: its `layout.local_len` positions, or only the real
    ones when the rank's tail is padding (the logits of the last contiguous rank). Not differentiable. `layout` is
    the forward's: `model.cp_layout(seq_len)` after the forward (a zigzag layout follows the batch's documents).
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
