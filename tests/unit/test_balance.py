"""The zigzag ring's per-document placement (cpbench/cp/balance.py) and the layout that holds it, on one process.

The work model against a count of every (query, key) pair the mask keeps; the placement's invariants (every position
once, equal slots, the layout's padding last, one run of a piece per slot, whole pieces whole); its balance on random
packed rows, odd lengths, padded rows and rows unlike each other; the layout's cut/restore and Ulysses-group views;
and the imbalance on the shipped mixes at 128K tokens and cp 8 before and after, and at 1M tokens.
"""

from __future__ import annotations

import random

import pytest
import torch

from cpbench.cp import balance
from cpbench.cp.batch_mask import BatchFacts, BatchMask
from cpbench.cp.layout import SequenceLayout


def packed(*rows: list[int]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])


def keys_seen(batch: BatchMask) -> torch.Tensor:
    """[S]: the real keys each query sees, summed over the rows, counted pair by pair."""
    s = batch.seq_len
    out = torch.zeros(s)
    for r in range(batch.rows if (batch.docs or batch.pads) else 1):
        docs = batch.row_runs("docs", r) or ((0, s),)
        pads = {p for a, b in batch.row_runs("pads", r) for p in range(a, b)}
        for a, b in docs:
            for q in range(a, b):
                out[q] += sum(1 for k in range(a, q + 1) if k not in pads)
    return out


def rank_work(placement: balance.Placement, ring: int, seen: torch.Tensor) -> list[float]:
    """Each ring rank's work, summed from the pair count over the positions its two slots hold."""
    def slot(k):
        return sum(float(seen[a:b].sum()) for a, b in placement.slots[k] if a < len(seen))
    return [slot(r) + slot(2 * ring - 1 - r) for r in range(ring)]


BATCHES = {
    "packed": (None, packed([5, 9, 3, 5, 10])),
    "packed-rows-unlike": (None, packed([5, 9, 3, 5, 10], [12, 20])),
    "right-padded": (torch.tensor([[1] * 26 + [0] * 6, [1] * 32]), None),
    "left-padded": (torch.tensor([[0] * 7 + [1] * 25, [1] * 32]), None),
}


@pytest.mark.parametrize("name", sorted(BATCHES))
def test_the_work_model_counts_every_pair_the_mask_keeps(name):
    mask, positions = BATCHES[name]
    batch = BatchFacts(32, mask, positions).get()
    seen = keys_seen(batch)
    for piece in balance.pieces(batch):
        for q in range(piece.start, piece.end):
            assert piece.work(q, q + 1) == pytest.approx(float(seen[q])), (piece, q)


def check_placement(placement: balance.Placement, seq_len: int, padded_len: int, num_slots: int) -> None:
    held = sorted(p for runs in placement.slots for a, b in runs for p in range(a, b))
    assert held == list(range(padded_len))  # every position once, the layout's padding included
    assert all(sum(b - a for a, b in runs) == placement.slot_len for runs in placement.slots)
    for k, runs in enumerate(placement.slots):
        assert list(runs) == sorted(runs)
        pads = [r for r in runs if r[0] >= seq_len]
        assert not pads or (k >= num_slots // 2 and runs[-1] == pads[0]), (k, runs)  # padding ends a tail slot


def random_rows(seq_len: int, rng: random.Random, mean: int) -> list[int]:
    lengths, left = [], seq_len
    while left:
        n = min(left, max(1, int(rng.expovariate(1 / mean))))
        lengths.append(n)
        left -= n
    return lengths


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("seed", range(4))
def test_random_packed_rows_are_balanced_and_every_position_held_once(cp, seed):
    rng = random.Random(seed)
    seq_len = 4093 + seed  # odd lengths: the layout pads, documents do not divide
    lengths = random_rows(seq_len, rng, mean=700)
    batch = BatchFacts(seq_len, None, packed(lengths)).get()
    padded = -(-seq_len // (2 * cp)) * 2 * cp
    placement = balance.place(batch, padded, 2 * cp, min_chunk=8)
    check_placement(placement, seq_len, padded, 2 * cp)
    work = rank_work(placement, cp, keys_seen(batch))
    assert max(work) / (sum(work) / cp) <= 1.01, work
    assert work == pytest.approx([placement.rank_work(r) for r in range(cp)])


def test_short_documents_stay_whole_and_long_ones_are_cut_into_every_slot():
    lengths = [3000] + [40] * 25 + [96]
    batch = BatchFacts(sum(lengths), None, packed(lengths)).get()
    placement = balance.place(batch, sum(lengths), 8, min_chunk=64, tolerance=1.0)  # no promotion: see below
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    for a, b in zip(starts[1:-1], starts[2:]):  # every short document in one run of one slot
        assert sum(1 for runs in placement.slots for s, e in runs if s <= a and b <= e) == 1, (a, b)
    for runs in placement.slots:  # the long one in every slot, one run each
        assert sum(1 for s, e in runs if s < 3000) == 1
    # Left apart by more than the tolerance, the largest short pieces are split as well: balance first.
    strict = balance.place(batch, sum(lengths), 8, min_chunk=64, tolerance=0.0)
    assert sum(1 for runs in strict.slots for s, e in runs if s >= 4000) > 1
    loads = [strict.rank_work(r) for r in range(4)]
    assert max(loads) / (sum(loads) / 4) < max(placement.rank_work(r) for r in range(4)) / (sum(loads) / 4)


def test_padded_rows_and_rows_unlike_each_other_are_balanced():
    for name in ("right-padded", "left-padded", "packed-rows-unlike"):
        mask, positions = BATCHES[name]
        batch = BatchFacts(32, mask, positions).get()
        placement = balance.place(batch, 32, 4, min_chunk=1, tolerance=0.0)
        check_placement(placement, 32, 32, 4)
        work = rank_work(placement, 2, keys_seen(batch))
        assert max(work) / (sum(work) / 2) <= 1.1, (name, work)


def test_a_plain_row_keeps_the_plain_zigzag_and_the_off_switch_keeps_it_too():
    plain = SequenceLayout(64, 2, 0, "zigzag", facts=BatchFacts(64, None, torch.arange(64)[None]))
    assert plain.balanced().placement is None
    facts = BatchFacts(64, None, packed([40, 24]))
    assert SequenceLayout(64, 2, 0, "zigzag", facts=facts).balanced("sequence").placement is None
    assert SequenceLayout(64, 2, 0, "zigzag", facts=facts).balanced().placement is not None
    assert SequenceLayout(64, 2, 0, "contiguous", facts=facts).balanced().placement is None
    with pytest.raises(ValueError, match="balance mode 'spiral'"):
        plain.balanced("spiral")


@pytest.mark.parametrize("cp,u,seq_len", [(2, 1, 45), (4, 1, 64), (4, 2, 61), (8, 2, 96), (8, 4, 90)])
def test_cut_and_restore_follow_the_placement(cp, u, seq_len):
    rng = random.Random(cp * 100 + seq_len)
    facts = BatchFacts(seq_len, None, packed(random_rows(seq_len, rng, mean=9)))
    layouts = [SequenceLayout(seq_len, cp, r, "zigzag", ulysses=u, facts=facts).balanced() for r in range(cp)]
    assert layouts[0].placement is not None
    x = torch.arange(1, 2 * seq_len + 1).reshape(2, seq_len)  # the layout pads with 0
    slices = [layout.cut(x, dim=1) for layout in layouts]
    assert all(s.shape[1] == layouts[0].local_len for s in slices)
    assert torch.equal(layouts[0].restore(slices, dim=1), x)
    for layout, cut in zip(layouts, slices):  # the real tokens are a prefix of every slice
        real = (cut[0] > 0).tolist()
        assert real == [True] * layout.valid_len + [False] * (layout.local_len - layout.valid_len)
    for g in range(cp // u):  # a Ulysses group's members hold the ring's slice, in member order
        ring = layouts[g * u].ring_view()
        assert torch.cat(slices[g * u:(g + 1) * u], dim=1).equal(ring.cut(x, dim=1)), g


def mix_imbalance(mix: str, seq_len: int, cp: int, mode: str) -> float:
    from cpbench.harness.measure.flops import attention_pairs_per_rank
    from cpbench.harness.measure.step import make_batch
    from cpbench.harness.suite.presets import get_preset
    from cpbench.harness.suite.spec import load_suite

    text = (f'name = "x"\nmodel = "tiny-llama"\nmodel_overrides = {{max_position_embeddings = {seq_len}}}\n'
            f'seq_lens = [{seq_len}]\ncp_sizes = [{cp}]\ncp_styles = ["cp_ring_zigzag"]\ndocuments = {mix}\n'
            f'balance = "{mode}"\n')
    point, = load_suite("x.toml", text=text).points()
    config = get_preset(point.preset).config(point.model_overrides)
    pairs = attention_pairs_per_rank(point, config, make_batch(point, config.vocab_size, "cpu"))
    return max(pairs) / (sum(pairs) / len(pairs))


def odd_lengths(seq_len: int, seed: int) -> str:
    rng = random.Random(seed)
    lengths, left = [], seq_len
    while left > 40001:
        n = rng.randrange(1, 40000, 2)
        lengths.append(n)
        left -= n
    return str(lengths + [left])


MIXES = ["\"meta-128k\"", "\"prolong-64k\"", "\"llama3-sft\"", "\"longalign\"", "\"pile\""]


@pytest.mark.parametrize("mix", MIXES + [odd_lengths(131072, 0)])
def test_every_mix_at_128k_tokens_and_cp_8_is_balanced(mix):
    before, after = mix_imbalance(mix, 131072, 8, "sequence"), mix_imbalance(mix, 131072, 8, "documents")
    assert after <= 1.05 < before, (mix, before, after)


@pytest.mark.parametrize("mix", MIXES + [odd_lengths(1 << 20, 1)])  # host arithmetic: about a second each
def test_every_mix_at_1m_tokens_and_cp_8_is_balanced(mix):
    assert mix_imbalance(mix, 1 << 20, 8, "documents") <= 1.05
