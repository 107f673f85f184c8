"""The exact mask of every (query chunk, key chunk) tile of ring attention.

Ring attention never holds the whole score matrix, so it needs the mask of one tile at a time: the queries of
one layout chunk of this rank against the keys of one chunk of another rank. Both are contiguous ranges of
global (padded) positions, so a tile is named by its two start positions and its length.

The mask comes from what it is made of, not from the model's S x S mask: causal order, the layer's
`sliding_window` (key k is visible from query q when q - k < window, transformers' definition) and the batch's
`BatchMask` (packed documents, padded keys), worked out once per forward. Every tile is classified on the host
from those facts (no tensor is read in a layer); only a tile that is partly masked gets a dense mask, of the
tile's size. A 4-D mask the caller passed in (not built by the model from the batch) is sliced instead
(given_mask.py).

Rows that see no key at all: eager attention adds the dtype's minimum to every score of such a row, which
absorbs the scores, so its softmax is a uniform average over all seq_len keys while its backward still passes
the score gradient through. With `eager` semantics the ring marks such rows `uniform` (all keys, scores taken as
0 forward, the gradient kept), so that a padded query's output, and the loss transformers computes from it (the
last left-pad position predicts the first real token), match the unsharded eager run. sdpa and flash attention
give such rows output 0, as the ring does by default.

Positions >= seq_len are the layout's padding: no query attends to them and their own rows attend to nothing.
A tile is SKIP (nothing visible: not computed), FULL (everything visible: no mask needed), CAUSAL (the
diagonal tile of a plain causal mask: the kernel's own causal flag), SEGMENTS (for a kernel with flash's varlen
form, asked for with `varlen`: a masked tile as documents and a window, no mask tensor; see cp/ring/segments.py) or
DENSE (an explicit bool mask).
A mask the ring cannot express is refused with a ValueError, never dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpbench.cp.batch_mask import BatchMask, Runs
from cpbench.cp.ring.given_mask import as_allowed, check_whole, dense_tile
from cpbench.cp.ring.segments import Segments, segments_of, segments_of_runs

SKIP, FULL, CAUSAL, DENSE, SEGMENTS = "skip", "full", "causal", "dense", "segments"


@dataclass(frozen=True)
class TileMask:
    kind: str
    allowed: torch.Tensor | None = None  # bool [B or 1, H or 1, q, k], True = attend; only for DENSE
    uniform: torch.Tensor | None = None  # bool [B or 1, H or 1, q]: rows that see every key with score 0 (eager)
    segments: Segments | None = None  # only for SEGMENTS


@dataclass(frozen=True, eq=False)
class RingMasks:
    """Everything needed to build any tile's mask of one layer's call."""

    seq_len: int
    padded_len: int
    causal: bool
    device: torch.device
    window: int | None = None
    batch: BatchMask | None = None  # the batch's documents and padding (None: a caller's 4-D mask, `dense`)
    blocked: tuple[Runs, ...] = ()  # per row, query runs that see no key (only kept with eager semantics)
    uniform_rows: torch.Tensor | None = None  # bool [B or 1, 1, S]: those rows as a tensor
    dense: torch.Tensor | None = None  # a caller's whole 4-D mask [B or 1, H or 1, S, S]
    varlen: bool = False  # the kernel takes SEGMENTS tiles

    def tile(self, q_start: int, k_start: int, length: int) -> TileMask:
        if q_start >= self.seq_len or k_start >= self.seq_len:
            return TileMask(SKIP)  # an all-padding query chunk has no output to keep; padding keys are never seen
        if self.dense is not None:  # a caller's mask: read from the tensor (host syncs, as the mask is data)
            allowed = dense_tile(self.dense, q_start, k_start, length, self.seq_len)
            rows = None if self.uniform_rows is None else self.uniform_rows[..., q_start : q_start + length]
            if rows is None or not bool(rows.any()):
                return _classify(allowed)
            return self._with_uniform_rows(allowed, rows, k_start, length)
        if any(_overlaps(runs, q_start, q_start + length) for runs in self.blocked):
            rows = self.uniform_rows[..., q_start : q_start + length]
            return self._with_uniform_rows(self._allowed(q_start, k_start, length), rows, k_start, length)
        kind = self._kind(q_start, k_start, length)
        if kind != DENSE:
            return TileMask(kind)
        if self.varlen:
            seg = segments_of(self.batch, self.seq_len, self.causal, self.window, q_start, k_start, length)
            if seg is not None:
                return TileMask(SEGMENTS, segments=seg)
        return TileMask(DENSE, self._allowed(q_start, k_start, length))

    def _with_uniform_rows(self, allowed: torch.Tensor, rows: torch.Tensor, k0: int, n: int) -> TileMask:
        rows = torch.cat([rows, rows.new_zeros(*rows.shape[:2], n - rows.shape[-1])], -1)  # layout padding rows
        keys = torch.arange(k0, k0 + n, device=allowed.device) < self.seq_len
        return TileMask(DENSE, allowed | (rows[..., :, None] & keys), uniform=rows)

    # -- tiles of ring slots (runs of positions: a per-document placement, cp/balance.py) ---------------------------

    def slots(self, q_runs: Runs, k_runs: Runs, n: int, diagonal: bool) -> TileMask:
        """The tile of a query slot against a key slot, each `n` positions given as runs (laid out one after another
        in the tile); `diagonal`: the same slot. A slot of one run is `tile`'s chunk."""
        if len(q_runs) == 1 and len(k_runs) == 1 and q_runs[0][1] - q_runs[0][0] == n == k_runs[0][1] - k_runs[0][0]:
            return self.tile(q_runs[0][0], k_runs[0][0], n)
        if self.dense is not None or any(self.blocked):  # read from a tensor (the caller's mask, eager's rows)
            return self._dense_slots(q_runs, k_runs)
        seg = segments_of_runs(self.batch, self.seq_len, self.causal, self.window, q_runs, k_runs, diagonal)
        if seg is not None and not seg.runs:
            return TileMask(SKIP)
        if seg is not None and seg.rows == 1 and seg.window == (-1, -1) and seg.runs == ((0, 0, n, 0, n),):
            return TileMask(CAUSAL if seg.causal else FULL)  # one document over the whole tile
        if seg is not None and self.varlen:
            return TileMask(SEGMENTS, segments=seg)
        return self.dense_slots(q_runs, k_runs)

    def dense_slots(self, q_runs: Runs, k_runs: Runs) -> TileMask:
        """The slots' tile as a DENSE mask built from the facts (what a kernel without varlen runs when the tile's
        segments cannot be split into plain sub-tiles)."""
        return TileMask(DENSE, self._allowed_at(_positions(q_runs, self.device), _positions(k_runs, self.device)))

    def _dense_slots(self, q_runs: Runs, k_runs: Runs) -> TileMask:
        q_pos, k_pos = _positions(q_runs, self.device), _positions(k_runs, self.device)
        last = self.seq_len - 1
        if self.dense is not None:
            rows_of = self.dense.index_select(-2, q_pos.clamp(max=last))
            block = as_allowed(rows_of.index_select(-1, k_pos.clamp(max=last)))
            allowed = block & ((q_pos < self.seq_len)[:, None] & (k_pos < self.seq_len)[None, :])
        else:
            allowed = self._allowed_at(q_pos, k_pos)
        rows = None if self.uniform_rows is None else \
            self.uniform_rows.index_select(-1, q_pos.clamp(max=last)) & (q_pos < self.seq_len)
        if rows is None or not bool(rows.any()):
            return _classify(allowed) if self.dense is not None else TileMask(DENSE, allowed)
        keys = k_pos < self.seq_len
        return TileMask(DENSE, allowed | (rows[..., :, None] & keys), uniform=rows)

    # -- classification from the facts, on the host --------------------------------------------------------------

    def _kind(self, q0: int, k0: int, n: int) -> str:
        q1, k1 = min(q0 + n, self.seq_len), min(k0 + n, self.seq_len)
        if self.causal and k0 > q1 - 1:
            return SKIP
        if self.causal and self.window is not None and q0 - (k1 - 1) >= self.window:
            return SKIP
        rows = self.batch.rows if (self.batch.docs or self.batch.pads) else 1
        kinds = {self._row_kind(r, q0, q1, k0, k1, whole=(q1 - q0, k1 - k0) == (n, n)) for r in range(rows)}
        return kinds.pop() if len(kinds) == 1 else DENSE

    def _row_kind(self, row: int, q0: int, q1: int, k0: int, k1: int, whole: bool) -> str:
        docs = self.batch.row_runs("docs", row) or ((0, self.seq_len),)
        pads = self.batch.row_runs("pads", row)
        shared = [(max(q0, a), min(q1, b), max(k0, a), min(k1, b)) for a, b in docs
                  if a < q1 and q0 < b and a < k1 and k0 < b]
        if not any(self._visible(*qk, pads) for qk in shared):
            return SKIP
        if not (whole and shared == [(q0, q1, k0, k1)] and not _overlaps(pads, k0, k1)):
            return DENSE
        in_window = self.window is None or (q1 - 1) - k0 < self.window
        if in_window and (not self.causal or k1 - 1 <= q0):
            return FULL
        if in_window and self.causal and q0 == k0:
            return CAUSAL
        return DENSE

    def _visible(self, qs: int, qe: int, ks: int, ke: int, pads: Runs) -> bool:
        """Whether some valid key of [ks, ke) is visible from some query of [qs, qe) (one document)."""
        lo, hi = ks, ke - 1
        if self.causal:  # some q in [qs, qe) with 0 <= q - k < window
            hi = min(hi, qe - 1)
            if self.window is not None:
                lo = max(lo, qs - self.window + 1)
        return lo <= hi and not _covered(pads, lo, hi)

    # -- dense tiles --------------------------------------------------------------------------------------------

    def _allowed(self, q0: int, k0: int, n: int) -> torch.Tensor:
        # Positions come from a fresh arange and the facts are read through it: in a projection the facts are
        # known constants, and a tile computed from constants alone would be computed for real.
        q_pos = torch.arange(q0, q0 + n, device=self.device)
        k_pos = torch.arange(k0, k0 + n, device=self.device)
        return self._allowed_at(q_pos, k_pos)

    def _allowed_at(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        q, k = q_pos[:, None], k_pos[None, :]
        allowed = (q < self.seq_len) & (k < self.seq_len)
        if self.causal:
            allowed &= k <= q
        if self.window is not None:
            allowed &= q - k < self.window
        allowed = allowed[None, None]  # [1, 1, q, k]
        last = self.seq_len - 1
        if self.batch.doc_ids is not None:
            docs_q = self.batch.doc_ids.index_select(1, q_pos.clamp(max=last))
            docs_k = self.batch.doc_ids.index_select(1, k_pos.clamp(max=last))
            allowed = allowed & (docs_q[:, None, :, None] == docs_k[:, None, None, :])
        if self.batch.key_valid is not None:
            allowed = allowed & self.batch.key_valid.index_select(1, k_pos.clamp(max=last))[:, None, None, :]
        return allowed


def _positions(runs: Runs, device) -> torch.Tensor:
    """The positions of runs laid out one after another, from fresh aranges (see `_allowed`)."""
    return torch.cat([torch.arange(a, b, device=device) for a, b in runs])


def _overlaps(runs: Runs, a: int, b: int) -> bool:
    return any(s < b and a < e for s, e in runs)


def _covered(runs: Runs, a: int, b: int) -> bool:
    """Whether [a, b] (inclusive) lies inside one run (runs are maximal, so inside their union means inside one)."""
    return any(s <= a and b < e for s, e in runs)


def _blocked_queries(batch: BatchMask, causal: bool, window: int | None) -> tuple[Runs, ...]:
    """Per row, the query runs that see no key: a causal query whose keys back to its document's start (or to the
    window's) are all padding; for a non-causal layer, every query of an all-padding row."""
    out = []
    for row in range(batch.rows):
        pads = batch.row_runs("pads", row)
        if not causal:
            out.append(((0, batch.seq_len),) if pads == ((0, batch.seq_len),) else ())
            continue
        runs = []
        for a, b in pads:
            start = a if a == 0 else (a - 1 + window if window is not None else b)  # the valid key a - 1 is in view
            if start < b:
                runs.append((start, b))
        out.append(tuple(runs))
    return tuple(out)


def _uniform_tensor(blocked: tuple[Runs, ...], seq_len: int, device) -> torch.Tensor:
    rows = torch.zeros(len(blocked), 1, seq_len, dtype=torch.bool, device=device)
    for r, runs in enumerate(blocked):
        for a, b in runs:
            rows[r, :, a:b] = True
    return rows


def _classify(allowed: torch.Tensor) -> TileMask:
    if not bool(allowed.any()):
        return TileMask(SKIP)
    if bool(allowed.all()):
        return TileMask(FULL)
    return TileMask(DENSE, allowed)


def build_ring_masks(
    attention_mask,
    *,
    seq_len: int,
    padded_len: int,
    device: torch.device | str = "cpu",
    is_causal: bool = True,
    position_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
    batch: BatchMask | None = None,
    eager: bool = False,
    varlen: bool = False,
) -> RingMasks:
    """The `RingMasks` of one layer's call. With the forward's `batch` facts the model's own mask (built from the
    same inputs) is not read; without them they come from `attention_mask` (2-D or None) and `position_ids`, or a
    4-D `attention_mask` is sliced. `eager`: rows that see no key are uniform, as in eager attention. `varlen`: the
    kernel takes SEGMENTS tiles."""
    window = _check_window(sliding_window, is_causal)
    device = torch.device(device)
    if batch is None:
        if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
            raise ValueError(
                f"cp_ring cannot express an attention_mask of type {type(attention_mask).__name__} (e.g. flex "
                "attention's BlockMask): it needs a dense 4-D mask, a 2-D padding mask or None. Load the model with "
                "attn_implementation='sdpa' or 'eager', or use cp_ulysses."
            )
        if attention_mask is not None and attention_mask.dim() == 4:
            return _dense_masks(attention_mask, seq_len, padded_len, is_causal, device, window)
        if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape[-1] != seq_len):
            raise ValueError(
                f"cp_ring: attention_mask has shape {tuple(attention_mask.shape)}; expected a 4-D whole mask ending "
                f"in ({seq_len}, {seq_len}), a 2-D padding mask [batch, {seq_len}] or None."
            )
        batch = BatchMask.from_inputs(seq_len, attention_mask, position_ids)
    blocked = _blocked_queries(batch, is_causal, window) if eager and batch.pads else ()
    if not any(blocked):
        return RingMasks(seq_len, padded_len, is_causal, device, window, batch, varlen=varlen)
    uniform = _uniform_tensor(blocked, seq_len, device)
    return RingMasks(seq_len, padded_len, is_causal, device, window, batch, blocked, uniform, varlen=varlen)


def _dense_masks(mask: torch.Tensor, seq_len: int, padded_len: int, causal: bool, device, window) -> RingMasks:
    uniform = check_whole(mask, seq_len)
    return RingMasks(seq_len, padded_len, causal, device, window, uniform_rows=uniform, dense=mask)


def _check_window(sliding_window, is_causal: bool) -> int | None:
    if sliding_window is None:
        return None
    if not isinstance(sliding_window, int) or sliding_window <= 0:
        raise ValueError(f"cp_ring: sliding_window must be a positive int or None, got {sliding_window!r}.")
    if not is_causal:
        raise ValueError(
            f"cp_ring: sliding_window={sliding_window} on a non-causal attention module is not supported; use "
            "cp_ulysses."
        )
    return sliding_window
