"""What a batch's attention mask is made of, worked out once per forward from the batch's own O(batch x seq)
inputs: the documents of packed rows (position_ids restarting) and the padded keys of a 2-D `attention_mask`.

transformers builds the model's mask from the same inputs (causality and each layer's sliding window come from
the model itself). With these facts on the host, ring attention classifies every (query chunk, key chunk) tile
without reading a tensor in a layer (no device sync per layer or per tile), never needs the model's S x S mask,
and builds a tile's dense mask only where the tile is partly masked. The rule for packed rows is transformers'
(`find_packed_sequence_indices`): a new document wherever positions do not step by exactly one, looked at only
when no 2-D mask is given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Runs = tuple[tuple[int, int], ...]  # sorted, disjoint [start, end) intervals


@dataclass(frozen=True, eq=False)
class BatchMask:
    seq_len: int
    rows: int
    docs: tuple[Runs, ...] | None = None  # per row, its documents as [start, end) runs; None: one document a row
    pads: tuple[Runs, ...] | None = None  # per row, its padded key runs; None: no padding
    doc_ids: torch.Tensor | None = None  # long [B, S]: document index per token (for dense tiles)
    key_valid: torch.Tensor | None = None  # bool [B, S]: False for padded keys (for dense tiles)

    @classmethod
    def from_inputs(cls, seq_len: int, attention_mask=None, position_ids=None) -> BatchMask | None:
        """None when the caller passed a mask that is not a 2-D padding mask (e.g. a 4-D one): only that mask
        itself says what it masks."""
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
                return None
            return _padded(seq_len, attention_mask)
        if position_ids is not None:
            return _packed(seq_len, position_ids)
        return cls(seq_len, 1)

    def row_runs(self, kind: str, row: int) -> Runs:
        runs = getattr(self, kind)
        return runs[row if len(runs) > 1 else 0] if runs is not None else ()


class BatchFacts:
    """A forward's inputs, and their `BatchMask` worked out on first use (only ring attention needs it: a plan of
    Ulysses layers reads nothing from the host)."""

    def __init__(self, seq_len: int, attention_mask=None, position_ids=None):
        self.seq_len, self._mask, self._positions = seq_len, attention_mask, position_ids
        self._batch: BatchMask | None = None
        self._done = False

    def get(self) -> BatchMask | None:
        if not self._done:
            self._batch = BatchMask.from_inputs(self.seq_len, self._mask, self._positions)
            self._mask = self._positions = None
            self._done = True
        return self._batch


def _runs(flags: torch.Tensor) -> tuple[Runs, ...]:
    """Per row, the [start, end) runs where `flags` [B, S] is True, read from the host in one transfer."""
    edges = torch.diff(flags.to(torch.int8), dim=-1, prepend=flags.new_zeros(flags.shape[0], 1, dtype=torch.int8),
                       append=flags.new_zeros(flags.shape[0], 1, dtype=torch.int8))
    rows, cols = torch.nonzero(edges).unbind(-1)
    out: list[list[int]] = [[] for _ in range(flags.shape[0])]
    for r, c in zip(rows.tolist(), cols.tolist(), strict=True):
        out[r].append(c)
    return tuple(tuple(zip(cuts[::2], cuts[1::2], strict=True)) for cuts in out)


def _padded(seq_len: int, attention_mask: torch.Tensor) -> BatchMask:
    if attention_mask.shape[-1] != seq_len:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}; a 2-D padding mask must be [batch, {seq_len}]."
        )
    valid = attention_mask.bool()
    pads = _runs(~valid)
    if not any(pads):
        return BatchMask(seq_len, valid.shape[0])
    return BatchMask(seq_len, valid.shape[0], pads=pads, key_valid=valid)


def _packed(seq_len: int, position_ids: torch.Tensor) -> BatchMask:
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    if position_ids.dim() != 2 or position_ids.shape[-1] != seq_len:
        raise ValueError(
            f"position_ids has shape {tuple(position_ids.shape)}; expected [batch or 1, {seq_len}] (multi-axis "
            "rotary positions need a dense attention mask: use cp_ulysses)."
        )
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    starts = step != 1
    doc_ids = starts.cumsum(-1)
    # Documents are the runs between starts: the flags' runs of "same document as the previous token".
    cuts = [[0, *row, seq_len] for row in _starts(starts)]
    docs = tuple(tuple(zip(c[:-1], c[1:], strict=True)) for c in cuts)
    if all(len(d) == 1 for d in docs):
        return BatchMask(seq_len, position_ids.shape[0])
    return BatchMask(seq_len, position_ids.shape[0], docs=docs, doc_ids=doc_ids)


def _starts(starts: torch.Tensor) -> list[list[int]]:
    rows, cols = torch.nonzero(starts[:, 1:]).unbind(-1)
    out: list[list[int]] = [[] for _ in range(starts.shape[0])]
    for r, c in zip(rows.tolist(), cols.tolist(), strict=True):
        out[r].append(c + 1)
    return out
