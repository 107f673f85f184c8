"""The ring's CUDA kernels on a real GPU, where their contracts bite (`python -m pytest -m gpu tests/gpu`).

Each test is one of the four defects found by reading the kernels' sources (issue 16), run the way the ring runs it,
against the exact matmul kernel on the same tile:
1. the memory-efficient backward in bf16 with the ring's saved output, which lives in [B, S, H, D] memory and is
   handed over per kv-head group (the kernel reads O's row stride as heads x head dim of the call);
2. a DENSE tile whose mask has batch dimension 1 with a batch of 2 (the efficient kernel checks the bias's batch
   size against the query's and does not broadcast);
3. an off-diagonal sliding-window tile of packed documents that differ per row (flash reads `(left, -1)` as
   right = max_seqlen_k);
4. the dense flash route with a head dim that is not a multiple of 8 (the flash op checks `head_size % 8 == 0`).
The CPU twins run the same tiles through emulations written from those sources (tests/unit/test_ring_contracts.py).
Skipped without CUDA."""

import pytest
import torch

from cpbench.cp.ring.cuda import CudaSdpaKernel
from cpbench.cp.ring.kernels import TorchKernel, acc_dtype
from cpbench.cp.ring.masks import CAUSAL, DENSE, TileMask, build_ring_masks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

B, H, HKV = 2, 8, 2


def _inputs(n, d, dtype, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, dout = (torch.randn(B, H, n, d, device="cuda", generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(B, HKV, n, d, device="cuda", generator=g).to(dtype) for _ in range(2))
    return q, k, v, dout


def _ring_out(x):
    """`x` [B, H, S, D] laid out as the ring saves its output: [B, S, H, D] memory."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _check(kernel, q, k, v, dout, tile, ref_tile, tol):
    exact, scale = TorchKernel(), q.shape[-1] ** -0.5
    ref_out, ref_lse = exact.forward(q, k, v, ref_tile, scale)
    out, lse = kernel.forward(q, k, v, tile, scale)
    grads, ref_grads = [], []
    for kern, t, acc in ((kernel, tile, grads), (exact, ref_tile, ref_grads)):
        acc.extend(torch.zeros(x.shape, dtype=acc_dtype(q.dtype), device="cuda") for x in (q, k, v))
        kern.backward(dout, q, k, v, _ring_out(ref_out.to(q.dtype)), ref_lse, t, scale, *acc)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)) and not lse.isnan().any()
    for got, want, what in ((out, ref_out, "out"), *zip(grads, ref_grads, ("dq", "dk", "dv"))):
        err = ((got.double() - want.double()).abs().max() / max(want.double().abs().max().item(), 1.0)).item()
        assert err <= tol, f"{what}: {err:.3g} > {tol:.3g}"


# bf16: out and gradients are rounded to bf16 once per kernel call, and GQA sums a group's shares (a few eps of the
# largest value); fp32: fp32 accumulation in other orders over <= 256 terms.
TOL = {torch.bfloat16: 4 * torch.finfo(torch.bfloat16).eps, torch.float32: 1e-4}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_efficient_backward_with_the_rings_saved_output_and_gqa(dtype):
    q, k, v, dout = _inputs(128, 64, dtype)
    allowed = torch.rand(B, 1, 128, 128, device="cuda") > 0.3
    tile = TileMask(DENSE, allowed)
    _check(CudaSdpaKernel(), q, k, v, dout, tile, tile, TOL.get(dtype, 8 * torch.finfo(torch.float16).eps))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_dense_tile_with_a_batch_one_mask_and_a_batch_of_two(dtype):
    allowed = torch.rand(1, 1, 96, 96, device="cuda") > 0.3  # a window-only or broadcast position_ids mask
    q, k, v, dout = _inputs(96, 64, dtype)
    tile = TileMask(DENSE, allowed)
    _check(CudaSdpaKernel(), q, k, v, dout, tile, tile, TOL[dtype])


def test_off_diagonal_window_tile_of_packing_that_differs_per_row():
    rows = [(8, 12), (3, 14, 3)]
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows]).cuda()
    lean = build_ring_masks(None, seq_len=20, padded_len=20, device="cuda", position_ids=pos, sliding_window=12,
                            varlen=True)
    dense = build_ring_masks(None, seq_len=20, padded_len=20, device="cuda", batch=lean.batch, sliding_window=12)
    q, k, v, dout = _inputs(10, 64, torch.bfloat16)
    for q0, k0 in ((0, 0), (10, 0), (10, 10)):
        _check(CudaSdpaKernel(), q, k, v, dout, lean.tile(q0, k0, 10), dense.tile(q0, k0, 10), TOL[torch.bfloat16])


@pytest.mark.parametrize("head_dim", [12, 80])
def test_the_dense_flash_route_with_head_dims_flash_pads(head_dim):
    q, k, v, dout = _inputs(64, head_dim, torch.bfloat16)
    kernel = CudaSdpaKernel()
    assert kernel.route(q, TileMask(CAUSAL)) == "flash"
    _check(kernel, q, k, v, dout, TileMask(CAUSAL), TileMask(CAUSAL), TOL[torch.bfloat16])
