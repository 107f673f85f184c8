"""The ring's attention sinks (cp/ring/sinks.py) and its kernels with a value head dim other than the query's.

Sinks: a tile's keys split into two blocks, each through a block kernel, merged by LSE as the ring merges them, the
sink correction added, then the backward as the ring runs it (every tile given the final output and LSE, and the
sink's own reduction) equals autograd through a dense softmax over [scores, sink] with the sink's weight dropped
(gpt_oss's eager_attention_forward): output, dq, dk, dv and dsink, GQA included, with a row that sees no key.

dv != dqk: TorchKernel and CpuSdpaKernel (which zero-pads to one head dim) against dense attention in fp64, both ways
round (dv < dqk as in MLA, dv > dqk); CudaSdpaKernel through the emulated aten ops (tests/emulation/) routes every
tile to the memory-efficient kernel and matches TorchKernel; flash-attn's kernel hands such tiles to its fallback
and the selector never picks it; an emulated flash op refuses v's head dim, which is why.
"""

from __future__ import annotations

import pytest
import torch

from cpbench.cp.ring.attention import _merge
from cpbench.cp.ring.cuda import CudaSdpaKernel
from cpbench.cp.ring.flash import FlashAttnKernel
from cpbench.cp.ring.kernels import CpuSdpaKernel, TorchKernel
from cpbench.cp.ring.masks import CAUSAL, DENSE, FULL, TileMask
from cpbench.cp.ring.select import select_kernel
from cpbench.cp.ring.sinks import add_sinks, check_sinks, sink_grad
from cpbench.cp.ulysses import heads_of
from tests.emulation._common import KernelError
from tests.emulation.aten_sdpa import Counted
from tests.emulation.flash_attn import FUNCTIONS

B, H, HKV, Q = 2, 4, 2, 6
SCALE = 0.3
FLASH_ATTN = tuple(FUNCTIONS[key] for key in ("fwd", "bwd", "varlen_fwd", "varlen_bwd"))


def _allowed(keys: int = Q) -> torch.Tensor:
    allowed = torch.rand(B, 1, Q, keys, generator=torch.Generator().manual_seed(0)) > 0.4
    allowed[0, 0, 2] = False  # a row that sees no key
    return allowed


def tiles() -> dict:
    return {"full": TileMask(FULL), "causal": TileMask(CAUSAL), "dense": TileMask(DENSE, _allowed())}


def as_bool(tile: TileMask, keys: int = Q) -> torch.Tensor:
    if tile.kind == FULL:
        return torch.ones(1, 1, Q, keys, dtype=torch.bool)
    if tile.kind == CAUSAL:
        return torch.ones(Q, keys, dtype=torch.bool).tril()[None, None]
    return tile.allowed


def dense(q, k, v, allowed, sinks=None):
    """Plain attention [B, H, Q, Dv] (GQA as repeat_kv); with sinks, the softmax over [scores, sink] with the sink's
    weight dropped, as gpt_oss's eager attention computes it."""
    k, v = (x.repeat_interleave(H // HKV, 1) for x in (k, v))
    s = (q @ k.transpose(-1, -2) * SCALE).masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    p = torch.softmax(s, -1).nan_to_num()
    return (p[..., :-1] if sinks is not None else p) @ v


def inputs(d: int, d_v: int, dtype=torch.float64, seed: int = 1, keys: int = Q):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Q, d, generator=g, dtype=dtype)
    k = torch.randn(B, HKV, keys, d, generator=g, dtype=dtype)
    v = torch.randn(B, HKV, keys, d_v, generator=g, dtype=dtype)
    dout = torch.randn(B, H, Q, d_v, generator=g, dtype=dtype)
    return q, k, v, dout


def _autograd(q, k, v, dout, allowed, sinks=None):
    leaves = [x.clone().requires_grad_() for x in (q, k, v)] + ([sinks.clone().requires_grad_()] if sinks is not None
                                                                 else [])
    out = dense(*leaves[:3], allowed, leaves[3] if sinks is not None else None)
    out.backward(dout)
    return out.detach(), [x.grad for x in leaves]


# fp64 on both sides, sums of <= 2Q terms: rounding only, far below 1e-12; a wrong head dim, slice or sink term
# is O(0.1).
ATOL = 1e-12


@pytest.mark.parametrize("kernel", [TorchKernel(), CpuSdpaKernel()], ids=lambda k: type(k).__name__)
@pytest.mark.parametrize("d,d_v", [(16, 8), (8, 16)])
@pytest.mark.parametrize("name", ["full", "causal", "dense"])
def test_kernels_take_the_value_head_dim_for_out_and_dv(kernel, d, d_v, name):
    tile = tiles()[name]
    q, k, v, dout = inputs(d, d_v)
    ref_out, ref_grads = _autograd(q, k, v, dout, as_bool(tile))
    out, lse = kernel.forward(q, k, v, tile, SCALE)
    grads = [torch.zeros_like(x) for x in (q, k, v)]
    kernel.backward(dout, q, k, v, out, lse, tile, SCALE, *grads)
    assert out.shape == (B, H, Q, d_v)
    assert torch.allclose(out, ref_out, atol=ATOL)
    for got, ref in zip(grads, ref_grads):
        assert torch.allclose(got, ref, atol=ATOL)


@pytest.mark.parametrize("kernel", [TorchKernel(), CpuSdpaKernel()], ids=lambda k: type(k).__name__)
@pytest.mark.parametrize("d_v", [8, 16])
@pytest.mark.parametrize("first", ["full", "causal", "dense"])
def test_sinks_after_the_merge_and_their_backward_are_exact(kernel, d_v, first):
    """Keys in two blocks (the second a DENSE tile; with a DENSE first one, row 2 of batch 0 sees no key at all and
    keeps the sink alone), merged as the ring merges them, then the sinks; the backward as the ring runs it."""
    q, k, v, dout = inputs(16, d_v, keys=2 * Q)
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    blocks = [(slice(0, Q), tiles()[first]), (slice(Q, 2 * Q), TileMask(DENSE, _allowed()))]
    allowed = torch.cat([as_bool(tile).expand(B, 1, Q, Q) for _, tile in blocks], dim=-1)
    ref_out, (ref_dq, ref_dk, ref_dv, ref_dsinks) = _autograd(q, k, v, dout, allowed, sinks)

    out = torch.zeros(B, H, Q, d_v, dtype=torch.float64)
    lse = torch.full((B, H, Q), float("-inf"), dtype=torch.float64)
    for cols, tile in blocks:
        _merge(out, lse, *kernel.forward(q, k[:, :, cols], v[:, :, cols], tile, SCALE))
    assert torch.isneginf(lse).any() == (first == "dense")
    lse = add_sinks(out, lse, sinks)
    assert torch.isfinite(lse).all() and torch.allclose(out, ref_out, atol=ATOL)

    dsinks = sink_grad(dout, out, lse, sinks)
    dq, dk, dv = (torch.zeros_like(x) for x in (q, k, v))
    for cols, tile in blocks:
        kernel.backward(dout, q, k[:, :, cols], v[:, :, cols], out, lse, tile, SCALE, dq, dk[:, :, cols],
                        dv[:, :, cols])
    for got, ref, what in ((dq, ref_dq, "dq"), (dk, ref_dk, "dk"), (dv, ref_dv, "dv"), (dsinks, ref_dsinks, "dsink")):
        assert torch.allclose(got, ref, atol=ATOL), what


def test_sinks_are_checked_against_the_heads():
    assert check_sinks(None, 4) is None
    with pytest.raises(ValueError, match=r"shape \(8,\).*4 query heads.*shape \[4\]"):
        check_sinks(torch.zeros(8), 4)


def test_ulysses_slices_per_head_tensors_in_the_all_to_all_head_order():
    x = torch.arange(8.0)
    assert [heads_of(x, r, 4).tolist() for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert heads_of(None, 0, 2) is None
    with pytest.raises(ValueError, match="6 entries.*4 ranks"):
        heads_of(torch.zeros(6), 0, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["full", "causal", "dense"])
def test_cuda_kernel_runs_dv_other_than_dqk_on_the_efficient_kernel(dtype, name):
    tile = tiles()[name]
    q, k, v, dout = (x.to(dtype) for x in inputs(16, 8, dtype=torch.float32))
    ops = Counted()
    kernel = CudaSdpaKernel(ops)
    assert kernel.route(q, tile, v) == "efficient" and not kernel.takes_segments(q, v)
    got, ref = _run(kernel, q, k, v, dout, tile), _run(TorchKernel(), q, k, v, dout, tile)
    # fp32: the same sums in another order (64 fp32 eps); bf16: out and each gradient rounded to bf16 once, and GQA
    # sums two per-head shares (4 bf16 eps), relative to the largest reference value.
    eps = torch.finfo(dtype).eps
    tol = 64 * eps if dtype == torch.float32 else 4 * eps
    for a, b, what in zip(got, ref, ("out", "dq", "dk", "dv")):
        err = ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
        assert err <= tol, f"{what}: {err:.3g} > {tol:.3g}"
    assert ops.calls["efficient"] == ops.calls["efficient_backward"] == HKV
    assert sum(ops.calls.values()) == 2 * HKV


def _run(kernel, q, k, v, dout, tile):
    """Forward, then backward given the exact kernel's final output in the query's dtype, laid out as the ring keeps
    it ([B, S, H, Dv] memory: rows at the stride of all heads)."""
    out, lse = kernel.forward(q, k, v, tile, SCALE)
    ref_out, ref_lse = TorchKernel().forward(q, k, v, tile, SCALE)
    final = ref_out.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)
    grads = [torch.zeros(x.shape, dtype=torch.float32) for x in (q, k, v)]
    kernel.backward(dout, q, k, v, final, ref_lse, tile, SCALE, *grads)
    return [out, *grads]


def test_flash_kernels_refuse_a_value_head_dim_other_than_the_querys_and_are_not_asked():
    q, k, v, _ = (x.bfloat16() for x in inputs(16, 8, dtype=torch.float32))
    with pytest.raises(KernelError, match=r"v must have shape"):  # flash_api.cpp CHECK_SHAPE(v, ...), emulated
        Counted()["flash"](q, k, v, 0.0, True, False, scale=SCALE)
    flash = FlashAttnKernel(*FLASH_ATTN, masked=CudaSdpaKernel(Counted()))
    assert not flash.takes_segments(q, v) and flash.takes_segments(q, q)
    out, _ = flash.forward(q, k, v, TileMask(CAUSAL), SCALE)  # through its fallback, the efficient kernel
    assert out.shape == (B, H, Q, 8)
    assert isinstance(select_kernel("flash_attention_2", q, device_type="cuda", value=v), CudaSdpaKernel)
    assert isinstance(select_kernel("sdpa", q.float(), value=v.float()), CpuSdpaKernel)
