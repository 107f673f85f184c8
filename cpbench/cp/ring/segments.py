"""Masked ring tiles in flash attention's variable-length form: packed documents, padded keys and sliding windows
without a mask tensor.

A ring tile is the queries of one layout chunk against the keys of one chunk: contiguous position ranges of the same
length, either the same range (the diagonal) or disjoint (the keys before the queries, for a causal model). Inside
one document such a tile is therefore causal over identical ranges (diagonal) or full (keys before queries), and the
documents of a tile are independent sequences: exactly flash's varlen form (cu_seqlens), with a row's padded keys
cut off each document's key range. A sliding window that cuts into the tile is flash's `window_size` (bottom-right
aligned, which is top-left for equal lengths): (w - 1, 0) on the diagonal, for every document; (w - 1 - d, -1) for
keys d positions before the queries, where flash reads -1 beside a left window as max_seqlen_k (not unbounded). Off
the diagonal a segment is first cut to the band its window leaves (the queries up to the last key's window edge, the
keys from the first query's): a window shorter than the tile leaves its w-1 queries over w-1 keys at d = w-1, window
(0, -1), where the whole tile would be a dense mask. A varlen call has one window for all its sequences, so off the
diagonal a window is taken only where every segment it cuts has equal query and key lengths and the same offset d,
it leaves the others whole, and no segment has more queries than max_seqlen_k + 1 (whose first rows would lose
keys). Anything else (a padded run inside a document's keys, right-padded queries past the last key on the diagonal,
a cut band of unequal lengths, a window flash cannot say) stays a DENSE tile. Rows outside every segment see no key
in the tile: output 0, LSE -inf, as the ring's merge expects; every row inside a segment sees at least one key, so
no kernel meets an empty row (flash would give it LSE +inf, which the merge would turn into NaN).

The kernels (`ring_cuda.CudaSdpaKernel` through aten's flash op, `ring_flash.FlashAttnKernel` through flash-attn)
each supply a `VarlenOps` pair; packing, cu_seqlens and scattering back are here, once.
"""

from __future__ import annotations

import bisect
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from cpbench.cp.batch_mask import BatchMask, Runs

Run = tuple[int, int, int, int, int]  # (batch row, q start, q end, k start, k end), tile-relative


@dataclass(frozen=True)
class Segments:
    causal: bool
    runs: tuple[Run, ...]
    rows: int  # batch rows the runs name (1: the same runs for every row of the batch)
    window: tuple[int, int] = (-1, -1)  # flash's (left, right); -1 is unbounded
    # the forward's batch facts the runs come from: a tile's packed indices are kept with them (`_packed`), built once
    # a step and reused by every layer, the recompute and the backward
    source: BatchMask | None = field(default=None, compare=False, repr=False)


def segments_of(batch: BatchMask, seq_len: int, causal: bool, window: int | None, q0: int, k0: int,
                n: int) -> Segments | None:
    """The tile (queries [q0, q0 + n), keys [k0, k0 + n)) as segments, or None when it has no varlen form."""
    if causal and q0 != k0 and min(k0 + n, seq_len) > q0:
        return None  # keys after the queries: a SKIP tile, never asked for
    seg = segments_of_runs(batch, seq_len, causal, window, ((q0, q0 + n),), ((k0, k0 + n),), q0 == k0)
    return seg if seg is not None and seg.runs else None


def segments_of_runs(batch: BatchMask, seq_len: int, causal: bool, window: int | None, q_runs: Runs, k_runs: Runs,
                     diagonal: bool) -> Segments | None:
    """A tile whose queries and keys are runs of positions (a ring slot: cp/balance.py), laid out one after another
    in the tile, as segments (none: nothing in the tile is visible); None when it has no varlen form. `diagonal`: the queries
    and the keys are the same slot. Each document may hold one run of the queries and one of the keys: its queries
    see all its keys before them (keys of another slot), or causally the same ones (the diagonal)."""
    rows = batch.rows if (batch.docs or batch.pads) else 1
    kinds = {(batch.row_runs("docs", r), batch.row_runs("pads", r)) for r in range(rows)}
    rows = rows if len(kinds) > 1 else 1  # rows alike (a batch of copies): their runs once, for every row
    q_slot, k_slot = _Slot(q_runs), _Slot(k_runs)
    runs: list[Run] = []
    spans: list[Run] = []  # the same runs in global positions, for the window
    for r in range(rows):
        pads = batch.row_runs("pads", r)
        for a, b in batch.row_runs("docs", r) or ((0, seq_len),):
            q = q_slot.within(a, min(b, seq_len))
            k = k_slot.within(a, min(b, seq_len))
            if q is None or k is None:
                return None  # a document in two runs of one slot: more than one segment
            if q == () or k == ():
                continue
            (qs, qe, q_at), (ks, ke, k_at) = q, k
            keys = _unpadded(ks, ke, pads)
            if keys == ():
                continue
            if keys is None:
                return None  # padded keys inside the document's range: more than one key run
            k_at, (ks, ke) = k_at + keys[0] - ks, keys
            if causal and diagonal:
                if ke < qe:
                    return None  # queries past the last valid key see them all: not causal over identical ranges
                q_at, qs = q_at + ks - qs, ks  # queries before the first valid key see nothing here
            elif causal and ks >= qe:
                continue  # the document's keys here all come after its queries
            elif causal and ke > qs:
                return None  # keys on both sides of the queries
            if causal and window is not None and not diagonal:
                if qs - (ke - 1) >= window:
                    continue  # every key of the document lies beyond the window
                # the band the window leaves: queries up to the last key's window edge, keys from the first query's
                # (a window shorter than the tile: a band of w - 1 where the whole tile was computed)
                qe, k_from = min(qe, ke - 1 + window), max(ks, qs - window + 1)
                k_at, ks = k_at + k_from - ks, k_from
            runs.append((r, q_at, q_at + qe - qs, k_at, k_at + ke - ks))
            spans.append((r, qs, qe, ks, ke))
    if not runs:
        return Segments(causal and diagonal, (), rows)  # nothing in the tile is visible
    flash_window = _window(spans, window, causal, diagonal)
    if flash_window is None:
        return None
    return Segments(causal and diagonal, tuple(runs), rows, flash_window, source=batch)


class _Slot:
    """Runs of positions laid out one after another (sorted, disjoint), searchable by position."""

    def __init__(self, runs: Runs):
        self.runs, self.starts, self.offsets = runs, [s for s, _ in runs], [0]
        for s, e in runs:
            self.offsets.append(self.offsets[-1] + e - s)

    def within(self, a: int, b: int):
        """[a, b) in the slot: (start, end, where it starts in the slot), () when none of it is there, None when it
        is there in more than one run."""
        i = max(0, bisect.bisect_right(self.starts, a) - 1)
        j = bisect.bisect_left(self.starts, b)
        found = [k for k in range(i, j) if self.runs[k][1] > a]
        if len(found) != 1:
            return None if found else ()
        s, e = self.runs[found[0]]
        lo, hi = max(s, a), min(e, b)
        return lo, hi, self.offsets[found[0]] + lo - s


def _unpadded(ks: int, ke: int, pads: Runs) -> tuple[int, int] | tuple | None:
    """[ks, ke) less the padded runs: one (start, end) run, () when nothing is left, None when it splits."""
    pieces, start = [], ks
    for a, b in pads:
        if b <= start or a >= ke:
            continue
        if a > start:
            pieces.append((start, a))
        start = max(start, b)
    if start < ke:
        pieces.append((start, ke))
    if len(pieces) > 1:
        return None
    return pieces[0] if pieces else ()


def _window(spans: list[Run], window: int | None, causal: bool, diagonal: bool):
    """flash's (left, right) for the tile (`spans`: its segments in global positions): (-1, -1) when no window cuts
    a segment, None when one cuts and flash's single window cannot say it for every segment."""
    if window is None or not causal:
        return (-1, -1)
    cut = [span for span in spans if (span[2] - 1) - span[3] >= window]
    if not cut:
        return (-1, -1)
    if diagonal:  # causal over identical ranges: (w - 1, 0) is every segment's window, cut or not
        return (window - 1, 0)
    # Keys before the queries: a cut segment of equal lengths needs left = w - 1 - (its query start - its key start);
    # one left for all, and it must leave the uncut segments whole (left >= their key count - 1).
    lefts = {window - 1 - (qs - ks) if qe - qs == ke - ks else -1 for _, qs, qe, ks, ke in cut}
    if len(lefts) != 1:
        return None
    left = lefts.pop()
    if left < 0 or any(left < ke - ks - 1 for span in spans if span not in cut for _, _, _, ks, ke in (span,)):
        return None
    # flash has no "unbounded on the right" beside a left window: `left >= 0, right < 0` becomes right = max_k
    # (set_params_fprop, and mha_varlen_fwd maps right >= max_k to -1 first), bottom-right aligned per sequence, so
    # query i of a run sees keys up to i + (k len - q len) + max_k. The first query keeps its run's last key only
    # when q len <= max_k + 1; a run with more queries than that (an uncut document with few keys in the tile)
    # would lose keys, so such a tile stays DENSE.
    if max(qe - qs for _, qs, qe, _, _ in spans) > max(ke - ks for _, _, _, ks, ke in spans) + 1:
        return None
    return (left, -1)


# -- packing a tile for a varlen call ------------------------------------------------------------------------------


@dataclass(frozen=True)
class VarlenOps:
    """A kernel's varlen pair on packed [tokens, heads, dim] tensors (head dim a multiple of 8):
    forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, left, right, scale) -> (out, LSE fp32 [heads, q tokens]);
    backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, left, right, scale) -> (dq, dk, dv)."""

    forward: Callable
    backward: Callable


class _Packed:
    """A tile's tokens as (batch row, position) index pairs, segment after segment, and their cu_seqlens. Gathers
    and scatters index the [B, H, n, D] tiles directly: one copy of the tokens, none of the whole tile. Built on the
    host and copied to the device in two copies, whatever the number of documents (an op per document was most of a
    packed layer's host time, and of a projection's)."""

    def __init__(self, seg: Segments, batch: int, n: int, device):
        if seg.rows == 1:  # the same runs for every row of the batch
            runs = [(b, *run[1:]) for b in range(batch) for run in seg.runs]
        else:
            runs = list(seg.runs)
        q_lens = [qe - qs for _, qs, qe, _, _ in runs]
        k_lens = [ke - ks for _, _, _, ks, ke in runs]
        q_rows, q_pos = _pairs([(b, qs, qe) for b, qs, qe, _, _ in runs])
        k_rows, k_pos = _pairs([(b, ks, ke) for b, _, _, ks, ke in runs])
        pairs = torch.tensor(q_rows + q_pos + k_rows + k_pos, dtype=torch.long, device=device)
        self.q = (pairs[: len(q_rows)], pairs[len(q_rows) : 2 * len(q_rows)])
        self.k = (pairs[2 * len(q_rows) : 2 * len(q_rows) + len(k_rows)], pairs[2 * len(q_rows) + len(k_rows) :])
        cu = torch.tensor(_cumsum(q_lens) + _cumsum(k_lens), dtype=torch.int32, device=device)
        self.cu_q, self.cu_k = cu[: len(runs) + 1], cu[len(runs) + 1 :]
        self.max_q, self.max_k = max(q_lens), max(k_lens)

    @staticmethod
    def take(x: torch.Tensor, at: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """[B, H, n, D] -> the indexed tokens [T, H, D'] in `dtype`, the head dim zero-padded to a multiple of 8 (the
        only ones flash kernels take; zeros change no score)."""
        rows, positions = at
        x = x[rows, :, positions].to(dtype)
        d = x.shape[-1]
        return F.pad(x, (0, -d % 8)) if d % 8 else x


_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a forward's BatchMask -> its tiles' _Packed


def _packed(seg: Segments, batch: int, n: int, device) -> _Packed:
    """The tile's `_Packed`, built once for the forward whose batch facts `seg` comes from (every layer with the same
    segments, the recompute and the backward reuse it; it goes with those facts)."""
    if seg.source is None:
        return _Packed(seg, batch, n, device)
    kept = _PACKED.setdefault(seg.source, {})
    key = (seg, batch, n, str(device))
    if key not in kept:
        kept[key] = _Packed(seg, batch, n, device)
    return kept[key]


def _pairs(spans: list[tuple[int, int, int]]) -> tuple[list[int], list[int]]:
    """(batch rows, positions) of the tokens of [(row, start, end), ...], in that order, on the host."""
    rows: list[int] = []
    positions: list[int] = []
    for r, a, e in spans:
        rows += [r] * (e - a)
        positions += range(a, e)
    return rows, positions


def _cumsum(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def varlen_forward(ops: VarlenOps, q, k, v, seg: Segments, scale: float, acc: torch.dtype):
    b, h, n, _ = q.shape
    d_v = v.shape[-1]
    p = _packed(seg, b, n, q.device)
    q_, k_, v_ = p.take(q, p.q, q.dtype), p.take(k, p.k, q.dtype), p.take(v, p.k, q.dtype)
    out, lse = ops.forward(q_, k_, v_, p.cu_q, p.cu_k, p.max_q, p.max_k, seg.causal, *seg.window, float(scale))
    out_full = torch.zeros(b, h, n, d_v, dtype=acc, device=q.device)  # rows outside every segment: 0, LSE -inf
    lse_full = torch.full((b, h, n), float("-inf"), dtype=acc, device=q.device)
    out_full[p.q[0], :, p.q[1]] = out[..., :d_v].to(acc)
    lse_full[p.q[0], :, p.q[1]] = lse.t().to(acc)
    return out_full, lse_full


def varlen_backward(ops: VarlenOps, dout, q, k, v, out, lse, seg: Segments, scale: float, dq, dk, dv) -> None:
    """Adds the tile's gradients into the accumulators dq [B, H, n, D], dk/dv [B, Hkv, n, D] (every token of a tile
    is in one segment at most, so the indexed adds never meet)."""
    d, d_v = q.shape[-1], v.shape[-1]
    p = _packed(seg, q.shape[0], q.shape[2], q.device)
    q_, o_, do_ = (p.take(x, p.q, q.dtype) for x in (q, out, dout))
    k_, v_ = p.take(k, p.k, q.dtype), p.take(v, p.k, q.dtype)
    lse_ = lse[p.q[0], :, p.q[1]].t().float().contiguous()  # [H, T], as flash's backward wants it
    gq, gk, gv = ops.backward(do_, q_, k_, v_, o_, lse_, p.cu_q, p.cu_k, p.max_q, p.max_k, seg.causal, *seg.window,
                              float(scale))
    dq[p.q[0], :, p.q[1]] += gq[..., :d].to(dq.dtype)
    dk[p.k[0], :, p.k[1]] += gk[..., :d].to(dk.dtype)
    dv[p.k[0], :, p.k[1]] += gv[..., :d_v].to(dv.dtype)
