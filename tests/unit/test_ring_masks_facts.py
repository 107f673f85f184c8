"""Ring tiles from the batch's facts against the mask they stand for, built by brute force from its definition,
and without a host sync in a layer."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cpbench.cp.batch_mask import BatchMask
from cpbench.cp.ring.masks import CAUSAL, DENSE, FULL, SKIP, build_ring_masks

SYNCS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::item"}


class NoSync(TorchDispatchMode):
    """Fails on any op that reads a tensor's values back to the host."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        assert func._schema.name not in SYNCS, f"host sync in a layer: {func}"
        return func(*args, **(kwargs or {}))


def truth(seq, rows, causal, window, docs, pads, eager):
    """[B, S, S] allowed, and [B, S] uniform rows, from the definitions (transformers' masks)."""
    q, k = torch.arange(seq)[:, None], torch.arange(seq)[None]
    allowed = torch.ones(rows, seq, seq, dtype=torch.bool)
    if causal:
        allowed &= k <= q
    if window:
        allowed &= q - k < window
    if docs is not None:
        allowed &= docs[:, :, None] == docs[:, None, :]
    if pads is not None:
        allowed &= pads[:, None, :]
    uniform = ~allowed.any(-1) if eager else torch.zeros(rows, seq, dtype=torch.bool)
    return allowed, uniform


def random_case(rng: random.Random, seq: int):
    rows, causal = rng.choice([1, 2]), rng.random() < 0.85
    window = rng.choice([None, None, 3, 7, 20]) if causal else None
    position_ids = mask = None
    docs = pads = None
    kind = rng.choice(["plain", "packed", "padded"])
    if kind == "packed":
        position_ids = torch.stack([_packed_positions(rng, seq) for _ in range(rows)])
        step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1)
        docs = (step != 1).cumsum(-1)
    elif kind == "padded":
        mask = torch.ones(rows, seq, dtype=torch.long)
        for r in range(rows):
            for _ in range(rng.randint(0, 2)):
                a = rng.randrange(seq)
                mask[r, a : a + rng.randint(1, seq // 3)] = 0
            if rng.random() < 0.4:
                mask[r, : rng.randint(1, seq // 2)] = 0  # left padding
        pads = mask.bool()
    return rows, causal, window, position_ids, mask, docs, pads


def _packed_positions(rng, seq):
    cuts = sorted(rng.sample(range(1, seq), rng.randint(1, 4)))
    bounds = [0, *cuts, seq]
    return torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])


@pytest.mark.parametrize("seed", range(80))
def test_every_tile_is_the_mask_it_stands_for(seed):
    rng = random.Random(seed)
    seq, n = rng.choice([(24, 8), (21, 6), (32, 4)])  # 21 of 24: the layout pads the last chunk
    padded = -(-seq // n) * n
    rows, causal, window, position_ids, mask, docs, pads = random_case(rng, seq)
    eager = rng.random() < 0.5
    batch = BatchMask.from_inputs(seq, mask, position_ids)
    masks = build_ring_masks(None, seq_len=seq, padded_len=padded, is_causal=causal, sliding_window=window,
                             batch=batch, eager=eager)
    allowed, uniform = truth(seq, rows, causal, window, docs, pads, eager)
    full = torch.zeros(rows, padded, padded, dtype=torch.bool)
    full[:, :seq, :seq] = allowed | (uniform[:, :, None])
    rows_uniform = torch.zeros(rows, padded, dtype=torch.bool)
    rows_uniform[:, :seq] = uniform
    with NoSync():
        tiles = {(q0, k0): masks.tile(q0, k0, n) for q0 in range(0, padded, n) for k0 in range(0, padded, n)}
    for (q0, k0), tile in tiles.items():
        want = full[:, q0 : q0 + n, k0 : k0 + n]
        if tile.kind == SKIP:
            assert not want.any(), (q0, k0)
        elif tile.kind == FULL:
            assert want.all(), (q0, k0)
        elif tile.kind == CAUSAL:
            assert torch.equal(want, torch.ones(n, n, dtype=torch.bool).tril().expand_as(want)), (q0, k0)
        else:
            assert tile.kind == DENSE
            assert torch.equal(tile.allowed[:, 0].expand_as(want), want), (q0, k0)
            got = tile.uniform[:, 0] if tile.uniform is not None else torch.zeros(1, n, dtype=torch.bool)
            assert torch.equal(got.expand(rows, n), rows_uniform[:, q0 : q0 + n]), (q0, k0)


def test_plain_batches_need_no_dense_tile_and_no_uniform_rows():
    batch = BatchMask.from_inputs(64, None, torch.arange(64)[None])
    masks = build_ring_masks(None, seq_len=64, padded_len=64, batch=batch, eager=True)
    kinds = {masks.tile(q0, k0, 16).kind for q0 in range(0, 64, 16) for k0 in range(0, 64, 16)}
    assert kinds == {SKIP, FULL, CAUSAL} and masks.uniform_rows is None
