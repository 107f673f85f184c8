"""cp_ulysses' packed exchange, in one process: q, k and v leave in one all-to-all and each arrives head-sharded in
the sequence's global order (the zigzag reordering folded into one copy), padding dropped. The all-to-all is
emulated across the simulated ranks; model-level parity over gloo is tests/dist (every style, layout, batch)."""

from __future__ import annotations

import pytest
import torch

from cpbench.cp import ulysses
from cpbench.cp.layout import SequenceLayout


@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
@pytest.mark.parametrize("cp, seq_len", [(2, 16), (4, 13)])  # 13: padded to a multiple of the chunk count
def test_every_rank_gets_its_heads_of_q_k_v_over_the_whole_sequence(monkeypatch, kind, cp, seq_len):
    b, h, hkv, d = 2, 8, 4, 3
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(b, n, seq_len, d, generator=g) for n in (h, hkv, hkv)]  # q, k, v in global order
    layouts = [SequenceLayout(seq_len, cp, r, kind) for r in range(cp)]
    shards = [[lay.cut(x, dim=2) for x in full] for lay in layouts]  # what each rank holds

    sends, calls = {}, []

    def record_send(x, group):  # first pass: every rank's packed send buffer, as `_seq_to_heads` builds it
        sends[group] = x
        return torch.zeros_like(x)

    def fake_all_to_all(x, group):  # second pass: chunk i of dim 0 goes to rank i
        calls.append(x.shape)
        return torch.stack([sends[src][group] for src in range(cp)])

    monkeypatch.setattr(ulysses, "all_to_all", record_send)
    for src in range(cp):
        ulysses._seq_to_heads(shards[src], src, layouts[src])  # `group` stands for the rank here
    monkeypatch.setattr(ulysses, "all_to_all", fake_all_to_all)
    for rank, lay in enumerate(layouts):
        calls.clear()
        q, k, v = ulysses._seq_to_heads(shards[rank], rank, lay)
        assert len(calls) == 1  # one all-to-all for q, k and v together
        for got, x in zip((q, k, v), full):
            n = x.shape[1] // cp
            assert torch.equal(got, x[:, rank * n : (rank + 1) * n]), (kind, cp, seq_len, rank)


def test_a_different_value_head_dim_goes_separately(monkeypatch):
    lay = SequenceLayout(8, 1, 0)
    q, v = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 6)
    calls = []
    monkeypatch.setattr(ulysses, "all_to_all", lambda x, group: calls.append(x.shape) or x)
    got_q, got_v = ulysses._seq_to_heads([q, v], None, lay)
    assert len(calls) == 2 and torch.equal(got_q, q) and torch.equal(got_v, v)
