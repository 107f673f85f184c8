"""The four defects the kernel emulations found in the ring's CUDA glue, one test each, on CPU.

The emulations (tests/emulation/) are written from the kernels' sources - PyTorch's flash and memory-efficient ops,
flash-attn 2.8.3 - where the earlier ones in these tests were written from cpbench's own reading of the contracts
and passed all four. Each test runs the kernel the way the ring calls it (views of longer sequences, the final
output in the ring's [B, S, H, D] memory, pre-filled accumulators: test_ring_flash.run_kernel) and compares out, LSE,
dq, dk, dv with the exact `TorchKernel` on the dense tile; each failed before its fix:
1. the fp16/bf16 efficient backward reads `out` at a row stride of heads x head dim of the call, and the ring handed
   it its saved output per kv-head group: other rows, wrong gradients, with more than one kv head;
2. the efficient kernel checks attn_bias's batch size and never broadcasts it: a DENSE tile with a batch-1 mask and
   a batch of 2 was refused (directly and behind FlashAttnKernel's masked fallback);
3. flash reads a varlen window `(left >= 0, -1)` as right = max_seqlen_k, not unbounded: an off-diagonal window tile
   of packing that differs per row hid keys from the first rows of a long uncut segment;
4. the flash op refuses head dims that are not multiples of 8 (sdpa pads before calling it, the ring did not); the
   efficient kernel wants the strides such dims give aligned.
The GPU twins of these tests are tests/gpu/test_ring_cuda_contracts.py.
"""

from __future__ import annotations

import pytest
import torch

from cpbench.cp.ring.cuda import CudaSdpaKernel
from cpbench.cp.ring.flash import FlashAttnKernel
from cpbench.cp.ring.masks import CAUSAL, DENSE, FULL, SEGMENTS, TileMask, build_ring_masks
from tests.emulation.aten_sdpa import OPS, Counted
from tests.unit.test_ring_flash import FLASH_ATTN, HALF, check_against_exact, tolerances

B, H, HKV = 2, 4, 2  # GQA with more than one kv head: the efficient kernel runs one call per kv-head group


def _inputs(n: int, d: int, dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(B, H, n, d, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(B, HKV, n, d, generator=g).to(dtype) for _ in range(2))
    return q, k, v, dout


def _tol(dtype):
    tol = tolerances(dtype)
    if dtype in HALF:  # per-query-head gradients rounded to the dtype, then summed over the group of 2
        tol = {**tol, "lse_grads": 2 * tol["lse_grads"]}
    return tol


def _masked(seed: int, batch: int, n: int) -> TileMask:
    allowed = torch.rand(batch, 1, n, n, generator=torch.Generator().manual_seed(seed)) > 0.3
    allowed[0, 0, 1] = False  # a row that sees no key in this tile
    return TileMask(DENSE, allowed)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_1_efficient_backward_with_the_rings_saved_output_and_gqa(dtype):
    ops = Counted()
    kernel = CudaSdpaKernel(ops)
    check_against_exact(kernel, *_inputs(6, 8, dtype), _masked(0, B, 6), _tol(dtype))
    assert ops.calls["efficient_backward"] == HKV  # the route under test: one call per kv-head group


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_2_a_dense_tile_with_a_batch_one_mask_and_a_batch_of_two(dtype):
    """A window-only or broadcast position_ids mask has batch dimension 1; the batch has 2 rows."""
    ops = Counted()
    check_against_exact(CudaSdpaKernel(ops), *_inputs(6, 8, dtype), _masked(0, 1, 6), _tol(dtype))
    assert ops.calls["efficient"] == ops.calls["efficient_backward"] == HKV


def test_2_a_batch_one_mask_through_flash_attn_kernels_masked_fallback():
    ops = Counted()
    kernel = FlashAttnKernel(*FLASH_ATTN, masked=CudaSdpaKernel(ops))
    check_against_exact(kernel, *_inputs(6, 8, torch.bfloat16), _masked(0, 1, 6), _tol(torch.bfloat16))
    assert ops.calls["efficient"] == ops.calls["efficient_backward"] == HKV


def _window_tiles():
    """Sequence 20 in chunks of 10, window 12, rows packed differently: row 0 has documents of 8 and 12 tokens, row
    1 of 3, 14 and 3. Tile (10, 0) holds row 0's second document as 10 queries over 2 keys (the window does not cut
    it) and row 1's middle one as 7 over 7 (cut: left 4); flash's right = max_seqlen_k = 7 beside that left window
    would hide both keys from row 0's first query and one from its second. Returns (the tile as the kernel gets it,
    the same tile DENSE) for the diagonal tiles and that one."""
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in ((8, 12), (3, 14, 3))])
    lean, dense = (build_ring_masks(None, seq_len=20, padded_len=20, position_ids=pos, sliding_window=12,
                                    varlen=varlen) for varlen in (True, False))
    return [(lean.tile(q0, k0, 10), dense.tile(q0, k0, 10)) for q0, k0 in ((0, 0), (10, 0), (10, 10))]


@pytest.mark.parametrize("kernel", ["aten", "flash-attn"])
def test_3_off_diagonal_window_tile_of_packing_that_differs_per_row(kernel):
    q, k, v, dout = _inputs(10, 8, torch.bfloat16)
    tiles = _window_tiles()
    assert any(lean.kind == SEGMENTS for lean, _ in tiles)  # the varlen path is exercised, not only DENSE
    for lean, dense in tiles:
        kern = CudaSdpaKernel(OPS) if kernel == "aten" else FlashAttnKernel(*FLASH_ATTN, masked=CudaSdpaKernel(OPS))
        check_against_exact(kern, q, k, v, dout, lean, _tol(torch.bfloat16), ref_tile=dense)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("head_dim", [12, 20])
@pytest.mark.parametrize("name", ["causal", "full"])
def test_4_the_dense_flash_route_with_head_dims_flash_pads(name, head_dim, dtype):
    ops = Counted()
    tile = TileMask(CAUSAL if name == "causal" else FULL)
    check_against_exact(CudaSdpaKernel(ops), *_inputs(6, head_dim, dtype), tile, _tol(dtype))
    assert ops.calls["flash"] == ops.calls["flash_backward"] == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("head_dim", [12, 6])
def test_4_head_dims_through_the_efficient_route(head_dim, dtype):
    """A DENSE tile (and any fp32 one) runs the efficient kernel, whose rows and heads must be 8-element aligned in
    bf16 and 4-element in fp32 (12 is, in fp32; 6 is not): the head dim is padded to a multiple of 8 there too."""
    ops = Counted()
    check_against_exact(CudaSdpaKernel(ops), *_inputs(6, head_dim, dtype), _masked(0, B, 6), _tol(dtype))
    assert ops.calls["efficient"] == ops.calls["efficient_backward"] == HKV
