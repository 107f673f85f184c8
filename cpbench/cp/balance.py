"""Per-document load balance of the zigzag ring: which tokens each ring slot holds, from the batch's own documents.

The zigzag layout cuts the sequence into 2R chunks (R ring ranks) and gives ring rank r chunks r and 2R-1-r. On one
causal sequence that balances the attention work, because a query's work (the keys it sees) grows linearly along
the sequence and the two chunks of a rank sum to the same. On a packed row the work restarts with every document, so
the slowest rank does 1.6-2.6x the mean with real document mixes (docs/training-loop.md, "Packed documents").

A `Placement` restores the balance from the facts the batch carries (`batch_mask.BatchMask`: documents from
`position_ids` restarts, padded keys from a 2-D mask), as TransformerEngine's THD partitioning and WLB-LLM's
per-document sharding do, without their padding of every document to a multiple of 2R:
- the row is cut into *pieces* wherever any row's document starts or its padding begins or ends: inside a piece the
  work of query q is affine in q (c + m * q, summed over the rows), so zigzag inside a piece is exact;
- a long piece is cut into 2R chunks, chunk k to slot k (ring rank r holds slots r and 2R-1-r): every rank gets the
  same work of it, at every ring step (each rank sees the same key chunks of it), with chunk sizes that differ by a
  token at most (no padding);
- a short piece (its chunks under `min_chunk` tokens, which a flash kernel computes as if they were full 128-row
  tiles) is kept whole and placed by its work, longest first, on the rank with the least work that has room
  (LPT), so many short documents balance each other; a piece that fits no slot whole is cut across slots;
- when short pieces still leave the ranks apart by more than `tolerance`, the largest of them are split as well
  (balance beats kernel efficiency).
Every slot holds the same number of tokens (the non-attention layers stay token-balanced), its runs in increasing
position order, at most one run of each piece, so a ring tile (a query slot against a key slot) is one varlen call
over its documents. The layout's padding (positions >= seq_len) ends the tail slots, so every rank's real tokens
stay a prefix of its slice.

Plain rows (one document, no padding) keep the plain zigzag: it is already balanced. The work model counts the keys
the mask lets a query see (its document's real keys up to itself), a padded query included (kernels compute it);
sliding windows are not modelled (windowed layers see at most `window` keys, which already flattens the work).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from cpbench.cp.batch_mask import BatchMask, Runs

BALANCE_MODES = ("documents", "sequence")  # per-document placement (the default), or the plain zigzag
MIN_CHUNK = 128  # tokens: a piece whose chunks would be shorter is kept whole (a flash tile is 128 query rows)
TOLERANCE = 0.005  # max / mean rank work above 1 + this splits the largest whole pieces too


@dataclass(frozen=True)
class Piece:
    """A stretch [start, end) of the row where the work of query q is `c + m * q` (summed over the batch's rows)."""

    start: int
    end: int
    c: float
    m: float

    def work(self, a: int, b: int) -> float:
        """The work of queries [a, b) (inside the piece)."""
        return (b - a) * self.c + self.m * (b - a) * (a + b - 1) / 2

    @property
    def total(self) -> float:
        return self.work(self.start, self.end)


@dataclass(frozen=True)
class Placement:
    """The runs of global positions each ring slot holds (slot k of 2R; ring rank r holds slots r and 2R-1-r), all
    `slot_len` tokens long. `slot_work`: the attention work (query-key pairs) of each slot's queries."""

    slots: tuple[Runs, ...]
    slot_len: int
    slot_work: tuple[float, ...] = field(default=(), compare=False)
    # host-side tile classifications of ring attention, shared by the layers of the forward (ring/masks.py)
    tiles: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    def rank_work(self, ring_rank: int) -> float:
        return self.slot_work[ring_rank] + self.slot_work[len(self.slots) - 1 - ring_rank]


def use_balance(model, mode: str = "documents"):
    """Turns the per-document placement of a CP model's zigzag ring (`cp_ring_zigzag`, `cp_usp`) on ("documents", the
    default) or off ("sequence": the plain zigzag, whatever the batch holds). Returns the model."""
    if mode not in BALANCE_MODES:
        raise ValueError(f"use_balance(model, {mode!r}): use one of {list(BALANCE_MODES)} (\"sequence\" turns the "
                         "per-document balance off).")
    state = getattr(model, "cp_state", None)
    if state is None or getattr(model, "cp_group", None) is None:
        raise ValueError("use_balance: the model is not context-parallel; load it with cpbench's DistributedConfig "
                         "(cp_size > 1) or call cpbench.parallelize first.")
    state.balance = mode
    return model


def pieces(batch: BatchMask) -> list[Piece]:
    """The row cut where any row's document or padding starts or ends, each piece with its affine work."""
    seq_len = batch.seq_len
    rows = batch.rows if (batch.docs or batch.pads) else 1
    kinds = {}  # identical rows (a batch of copies) are counted once, with their multiplicity
    for r in range(rows):
        key = (batch.row_runs("docs", r) or ((0, seq_len),), batch.row_runs("pads", r))
        kinds[key] = kinds.get(key, 0) + 1
    cuts = {0, seq_len}
    for docs, pads in kinds:
        cuts.update(a for a, _ in docs)
        cuts.update(x for run in pads for x in run)
    cuts = sorted(c for c in cuts if 0 <= c <= seq_len)
    out = [[a, b, 0.0, 0.0] for a, b in zip(cuts, cuts[1:])]
    for (docs, pads), count in kinds.items():
        _add_row(out, docs, pads, count)
    return [Piece(a, b, c, m) for a, b, c, m in out]


def _add_row(out: list[list], docs: Runs, pads: Runs, count: int) -> None:
    """Adds one row's work to every piece: a real query q of document [s, e) sees the real keys of [s, q]; a padded
    query (right padding) sees the real keys before it."""
    starts = [a for a, _ in docs]
    pad_starts = [a for a, _ in pads]
    pad_before = [0]  # padded tokens in pads[:i]
    for a, b in pads:
        pad_before.append(pad_before[-1] + b - a)

    def pads_below(x: int) -> int:
        i = bisect.bisect_right(pad_starts, x) - 1
        return pad_before[i + 1] - max(0, pads[i][1] - x) if i >= 0 else 0

    for piece in out:
        a = piece[0]
        s = docs[bisect.bisect_right(starts, a) - 1][0]
        hidden = pads_below(a) - pads_below(s)  # padded keys of the document before the piece
        i = bisect.bisect_right(pad_starts, a) - 1
        if i >= 0 and pads[i][1] > a:  # a padded piece: constant work
            piece[2] += count * (a - s - hidden)
        else:
            piece[2] += count * (1 - s - hidden)
            piece[3] += count


def place(batch: BatchMask, padded_len: int, num_slots: int, *, min_chunk: int | None = None,
          tolerance: float | None = None) -> Placement | None:
    """The balanced placement of `batch` over `num_slots` (2R) slots of `padded_len / num_slots` tokens, or None where
    the plain zigzag serves as well (one unpadded document a row) or cannot be improved on (too short a row).
    `min_chunk`, `tolerance`: MIN_CHUNK and TOLERANCE (read when called)."""
    min_chunk = MIN_CHUNK if min_chunk is None else min_chunk
    tolerance = TOLERANCE if tolerance is None else tolerance
    seq_len, ring = batch.seq_len, num_slots // 2
    if not (batch.docs or batch.pads) or padded_len % num_slots or num_slots < 2:
        return None
    n = padded_len // num_slots
    pad_quota = _pad_quota(padded_len - seq_len, num_slots, n)
    if pad_quota is None:
        return None
    parts = pieces(batch)
    split = {i for i, p in enumerate(parts) if p.end - p.start >= num_slots * min_chunk}
    whole = sorted((i for i in range(len(parts)) if i not in split), key=lambda i: (-parts[i].total, i))
    promote = 1
    while True:
        slots, work = _fill(parts, split, whole, num_slots, n, pad_quota)
        loads = [work[r] + work[num_slots - 1 - r] for r in range(ring)]
        mean = sum(loads) / ring
        if not whole or mean == 0 or max(loads) <= mean * (1 + tolerance):
            break
        split |= set(whole[:promote])  # the largest whole pieces are split too: balance beats kernel efficiency
        whole, promote = whole[promote:], 2 * promote
    runs = tuple(_merged(sorted(s)) for s in slots)
    for k, extra in enumerate(pad_quota):  # the layout's padding ends its slot: every rank's real tokens first
        if extra:
            start = seq_len + sum(pad_quota[k + 1:])
            runs = runs[:k] + (_merged([*runs[k], (start, start + extra)]),) + runs[k + 1:]
    return Placement(runs, n, tuple(work))


def _pad_quota(pad: int, num_slots: int, n: int) -> list[int] | None:
    """The layout's padding per slot: the tail slots from the last one down (slot 2R-1 ends ring rank 0's slice, as
    in the plain zigzag); None when the tail slots cannot hold it (a row shorter than the slots)."""
    quota = [0] * num_slots
    for k in range(num_slots - 1, num_slots // 2 - 1, -1):
        quota[k] = min(n, pad)
        pad -= quota[k]
    return None if pad else quota


def _fill(parts: list[Piece], split: set, whole: list, num_slots: int, n: int, pad_quota: list[int]):
    """Every slot's runs and work: whole pieces first (LPT into their share of each slot), then the split pieces'
    chunks fill what is left, each piece's chunk sizes proportional to what each slot still needs."""
    ring = num_slots // 2
    need = [n - q for q in pad_quota]
    whole_tokens = sum(parts[i].end - parts[i].start for i in whole)
    budget = _apportion(whole_tokens, need)
    # A whole piece may take up to a quarter of a slot's share of the split pieces (their chunks there shrink a little)
    # before it is cut across slots.
    slack = [(need[k] - budget[k]) // 4 for k in range(num_slots)]
    slots: list[list] = [[] for _ in range(num_slots)]
    work = [0.0] * num_slots
    load = [0.0] * ring
    for i in whole:
        _place_whole(parts[i], budget, slack, slots, work, load)
    left = [need[k] - sum(b - a for a, b in slots[k]) for k in range(num_slots)]
    for i in sorted(split):
        p = parts[i]
        sizes = _apportion(p.end - p.start, left)
        a = p.start
        for k in range(num_slots):  # chunk k to slot k: zigzag inside the piece
            b = a + sizes[k]
            if b > a:
                slots[k].append((a, b))
                work[k] += p.work(a, b)
            left[k] -= sizes[k]
            a = b
    assert not any(left), left
    return slots, work


def _place_whole(p: Piece, budget: list[int], slack: list[int], slots: list, work: list, load: list) -> None:
    """A whole piece on the least-loaded ring rank with a slot it fits in (within its budget, else within its slack;
    the roomier of the rank's two slots); a piece that fits no slot is cut across the least-loaded ranks' slots."""
    num_slots = len(slots)
    ring = num_slots // 2
    length = p.end - p.start

    def pair(r):
        return (r, num_slots - 1 - r)

    for room in (budget, [b + s for b, s in zip(budget, slack)]):
        fits = [r for r in range(ring) if max(room[k] for k in pair(r)) >= length]
        if fits:
            r = min(fits, key=lambda x: (load[x], x))
            k = max(pair(r), key=lambda x: (room[x] >= length, room[x]))
            over = max(0, length - budget[k])
            slack[k] -= over
            _put(p, p.start, p.end, k, r, budget, slots, work, load)
            return
    a = p.start
    while a < p.end:
        r = min((x for x in range(ring) if max(budget[k] for k in pair(x)) > 0), key=lambda x: (load[x], x))
        k = max(pair(r), key=lambda x: budget[x])
        b = min(p.end, a + budget[k])
        _put(p, a, b, k, r, budget, slots, work, load)
        a = b


def _put(p: Piece, a: int, b: int, k: int, r: int, budget: list, slots: list, work: list, load: list) -> None:
    slots[k].append((a, b))
    w = p.work(a, b)
    work[k] += w
    load[r] += w
    budget[k] -= b - a


def _apportion(total: int, weights: list[int]) -> list[int]:
    """`total` split in proportion to `weights` (integers, largest remainder first), never above a weight."""
    whole = sum(weights)
    if total == 0 or whole == 0:
        return [0] * len(weights)
    assert total <= whole, (total, whole)
    exact = [total * w / whole for w in weights]
    out = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda k: (-(exact[k] - out[k]), k))
    for k in order[: total - sum(out)]:
        out[k] += 1
    return out


def _merged(runs: list) -> Runs:
    out: list[list[int]] = []
    for a, b in runs:
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)
