"""The chunked cross-entropy against the full one: the same sum and gradients, without the full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpbench.cp.loss.chunked import check_loss, chunked_cross_entropy_sum


def full_sum(hidden, weight, targets, softcap=None):
    logits = F.linear(hidden, weight).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
                           reduction="sum")


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("chunk_bytes", [1, 4 * 96 * 7, 1 << 30])  # one row a chunk, 7 rows (uneven), all rows
def test_the_sum_and_the_gradients_equal_the_full_loss(softcap, chunk_bytes):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 25, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(96, 16, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 96, (2, 25), generator=g)
    targets[0, 3:9] = -100
    want = full_sum(hidden, weight, targets, softcap)
    got = chunked_cross_entropy_sum(hidden, weight, targets, softcap, chunk_bytes=chunk_bytes)
    # fp64 in, and the logits in fp32 on both sides: the sums differ only by their order (fp32 rounding)
    assert torch.allclose(got.double(), want.double(), rtol=1e-6)
    grads = torch.autograd.grad(got, (hidden, weight))
    want_grads = torch.autograd.grad(want, (hidden, weight))
    for g_, w_ in zip(grads, want_grads):
        assert torch.allclose(g_, w_, rtol=1e-5, atol=1e-6)


def test_it_never_holds_the_full_logits():
    from torch.distributed._tools.mem_tracker import MemTracker

    hidden = torch.randn(2048, 64, requires_grad=True)
    weight = torch.randn(8192, 64, requires_grad=True)
    targets = torch.randint(0, 8192, (2048,))
    peaks = {}
    for name, fn in (("full", full_sum), ("chunked", lambda h, w, t: chunked_cross_entropy_sum(h, w, t,
                                                                                                chunk_bytes=1 << 20))):
        tracker = MemTracker()
        tracker.track_external(hidden, weight)
        with tracker:
            fn(hidden, weight, targets).backward()
        peaks[name] = max(tracker._peak_mem.values())
        hidden.grad = weight.grad = None
    logits_fp32 = 2048 * 8192 * 4  # 64 MiB
    assert peaks["full"] > 2 * logits_fp32
    assert peaks["chunked"] < logits_fp32 / 4, peaks


def test_an_unknown_loss_names_the_choices():
    with pytest.raises(ValueError, match="'full'.*'chunked'"):
        check_loss("fused")


def test_at_most_max_chunks_chunks(monkeypatch):
    """One row a chunk asked for, 1000 rows: the chunks grow so that there are at most MAX_CHUNKS of them."""
    from cpbench.cp.loss import chunked

    calls = []
    real = chunked.checkpoint
    monkeypatch.setattr(chunked, "checkpoint", lambda fn, h, *a, **k: calls.append(h.shape[0]) or real(fn, h, *a, **k))
    hidden = torch.randn(1000, 8, requires_grad=True)
    weight = torch.randn(32, 8)
    got = chunked_cross_entropy_sum(hidden, weight, torch.randint(0, 32, (1000,)), chunk_bytes=1)
    assert len(calls) == -(-1000 // 4) == 250 and sum(calls) == 1000  # 4 rows a chunk: 1000 / 256 rounded up
    assert len(calls) <= chunked.MAX_CHUNKS and got.isfinite()
