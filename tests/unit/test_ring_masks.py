"""Per-tile masks of ring attention, and zigzag's load balance, without a process group."""

from __future__ import annotations

import pytest
import torch

from cpbench.cp.layout import SequenceLayout
from cpbench.cp.ring.attention import RingPlan
from cpbench.cp.ring.masks import CAUSAL, DENSE, FULL, SKIP, build_ring_masks


def masks(seq=16, padded=16, **kw):
    return build_ring_masks(None, seq_len=seq, padded_len=padded, **kw)


def test_plain_causal_tiles_need_no_mask():
    m = masks()
    assert m.tile(8, 0, 8).kind == FULL
    assert m.tile(8, 8, 8).kind == CAUSAL
    assert m.tile(0, 8, 8).kind == SKIP


def test_sliding_window_skips_far_tiles_and_masks_partial_ones():
    m = masks(seq=24, padded=24, sliding_window=5)
    assert m.tile(16, 0, 8).kind == SKIP  # every query is >= 5 past every key
    tile = m.tile(8, 0, 8)
    assert tile.kind == DENSE
    q, k = 8 + torch.arange(8)[:, None], torch.arange(8)[None]
    assert torch.equal(tile.allowed[0, 0], q - k < 5)


def test_layout_padding_is_never_attended():
    m = masks(seq=13, padded=16)
    tile = m.tile(8, 8, 8)
    assert tile.kind == DENSE
    assert not tile.allowed[..., :, 5:].any()  # keys 13..15 are padding
    assert not tile.allowed[..., 5:, :].any()  # and padding queries see nothing
    assert masks(seq=8, padded=16).tile(8, 0, 8).kind == SKIP


def test_packed_documents_from_position_ids():
    pos = torch.cat([torch.arange(6), torch.arange(10)])[None]
    m = masks(position_ids=pos)
    tile = m.tile(8, 0, 8)
    assert tile.kind == DENSE
    assert not tile.allowed[0, 0, :, :6].any() and tile.allowed[0, 0, :, 6:].any()
    assert masks(position_ids=torch.arange(16)[None]).batch.doc_ids is None  # one document: no mask needed


def test_two_d_padding_mask_hides_padded_keys():
    pad = torch.ones(2, 16, dtype=torch.long)
    pad[0, :3] = 0
    m = build_ring_masks(pad, seq_len=16, padded_len=16)
    t = m.tile(8, 0, 8)
    assert t.kind == DENSE and not t.allowed[0, 0, :, :3].any() and t.allowed[1, 0].all()


def test_dense_model_mask_is_sliced_by_global_position():
    allowed = torch.rand(2, 1, 16, 16, generator=torch.Generator().manual_seed(0)) > 0.5
    m = build_ring_masks(allowed, seq_len=16, padded_len=16)
    t = m.tile(8, 0, 8)
    assert torch.equal(t.allowed, allowed[..., 8:16, 0:8])


@pytest.mark.parametrize(
    "mask,kw,match",
    [
        (object(), {}, "BlockMask"),
        (torch.zeros(1, 1, 8, 8), {}, "must end in \\(16, 16\\)"),
        (torch.zeros(1, 1, 16, 16).fill_(-0.5), {}, "ALiBi"),
        (None, {"sliding_window": 0}, "sliding_window"),
        (None, {"position_ids": torch.zeros(3, 1, 16, dtype=torch.long)}, "position_ids"),
        (torch.ones(2, 16, 1), {}, "2-D padding mask"),
    ],
)
def test_masks_the_ring_cannot_express_are_refused(mask, kw, match):
    with pytest.raises(ValueError, match=match):
        m = build_ring_masks(mask, seq_len=16, padded_len=16, **kw)
        m.tile(0, 0, 16)


def work(plan: RingPlan, step: int) -> int:
    """Query x key pairs a rank computes at a step (a tile counts whole, as a kernel computes it)."""
    return sum((r.stop - r.start) * (c.stop - c.start) for r, c, _ in plan.tiles(step))


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_gives_every_rank_the_same_causal_work_at_every_step(cp):
    seq = 16 * cp
    plans = [
        RingPlan(None, SequenceLayout(seq, cp, r, "zigzag"), masks(seq, seq), None, 1.0) for r in range(cp)
    ]
    for step in range(cp):
        assert len({work(p, step) for p in plans}) == 1, step
    contiguous = [RingPlan(None, SequenceLayout(seq, cp, r), masks(seq, seq), None, 1.0) for r in range(cp)]
    assert work(contiguous[0], 1) == 0 and work(contiguous[-1], 1) > 0  # what zigzag fixes
