"""CudaSdpaKernel (the ring's block kernel for sdpa on CUDA, cp/ring/cuda.py), on CPU, against PyTorch's
fused ops as tests/emulation/aten_sdpa.py emulates them from the kernels' sources.

The emulations bind each call to the real op's schema and make the host code's checks (flash: fp16/bf16 only, head
dims multiples of 8; efficient: equal head counts, an attn_bias of exactly [B, H, M, N] in the query's dtype, aligned
strides), and read memory the way the kernels do (the efficient backward reads `out` at a row stride of heads x head
dim of the call, and its LSE rows padded to 32); tests/unit/test_kernel_emulations.py pins them. Here: FULL, CAUSAL
and DENSE tiles (also in row blocks) in fp32, bf16 and fp16, with GQA, equal the exact `TorchKernel` on the same tile,
each op called as often as the route says; tiles the fused kernels cannot take stay exact; the ring picks this kernel
for CUDA; and the real ops accept the calls under fake tensors (their meta kernels check them), as a projection runs
them. The four defects the emulations found have their own tests in test_ring_contracts.py.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cpbench.cp.ring.cuda import CudaSdpaKernel
from cpbench.cp.ring.kernels import CpuSdpaKernel, TorchKernel
from cpbench.cp.ring.masks import CAUSAL, DENSE, FULL, TileMask
from cpbench.cp.ring.select import select_kernel
from tests.emulation.aten_sdpa import Counted
from tests.unit.test_ring_flash import SCALE, B, D, H, Q, check_against_exact, tiles, tolerances


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kv_heads", [H, 2])
@pytest.mark.parametrize("name", ["full", "causal", "dense", "dense-in-row-blocks"])
def test_fused_kernels_glue_matches_the_exact_kernel(name, kv_heads, dtype):
    tile = tiles()[name.split("-")[0]]
    g = torch.Generator().manual_seed(1)
    q, dout = (torch.randn(B, H, Q, D, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(B, kv_heads, Q, D, generator=g).to(dtype) for _ in range(2))
    ops = Counted()
    blocks = 1
    if name == "dense-in-row-blocks":  # a bias budget of 4 rows: the 6-row tile runs as rows 0-3, then 4-5
        per_row = B * (Q + 16) * dtype.itemsize
        kernel, blocks = CudaSdpaKernel(ops, bias_block_bytes=4 * per_row), 2
    else:
        kernel = CudaSdpaKernel(ops)
    tol = tolerances(dtype)
    if dtype != torch.float32:  # the fused kernels return per-query-head gradients in the dtype; GQA sums two
        tol = {**tol, "lse_grads": 2 * tol["lse_grads"]}
    check_against_exact(kernel, q, k, v, dout, tile, tol)

    route = "flash" if dtype != torch.float32 and not name.startswith("dense") else "efficient"
    # flash: one call (GQA as it is); efficient: one per kv head and row block
    calls = 1 if route == "flash" else kv_heads * blocks
    assert ops.calls[route] == ops.calls[f"{route}_backward"] == calls
    assert sum(ops.calls.values()) == 2 * calls


def test_tiles_the_fused_kernels_cannot_take_stay_exact():
    ops = Counted()
    kernel = CudaSdpaKernel(ops)
    q = torch.randn(B, H, Q, D, dtype=torch.float64)
    uniform = TileMask(DENSE, torch.ones(B, 1, Q, Q, dtype=torch.bool), uniform=torch.zeros(B, 1, Q, dtype=torch.bool))
    for x, tile in ((q, TileMask(CAUSAL)), (q.float(), uniform)):  # fp64; eager's fully blocked rows
        assert kernel.route(x, tile) == "torch"
        out, lse = kernel.forward(x, x, x, tile, SCALE)
        ref_out, ref_lse = TorchKernel().forward(x, x, x, tile, SCALE)
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert kernel.route(torch.randn(1, 1, 2, 320).bfloat16(), TileMask(FULL)) == "efficient"  # head dim > 256
    assert sum(ops.calls.values()) == 0


def test_the_ring_picks_the_fused_kernel_for_cuda_and_keeps_cpu_and_softcap_as_they_were():
    q = torch.zeros(1, 1, 1, 8, dtype=torch.bfloat16)
    for implementation in ("sdpa", "eager", "flash_attention_2"):  # flash_attention_2 without flash-attn here
        assert isinstance(select_kernel(implementation, q, device_type="cuda"), CudaSdpaKernel)
    assert isinstance(select_kernel("sdpa", q, softcap=30.0, device_type="cuda"), TorchKernel)
    assert isinstance(select_kernel("sdpa", q), CpuSdpaKernel)


@pytest.mark.parametrize("name", ["causal", "dense"])
def test_the_real_ops_accept_the_calls_under_fake_tensors(name):
    """What a projection runs: the real ops' meta kernels, which check argument types and shapes."""
    tile = tiles()[name]
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(B, H, 40, D, dtype=torch.bfloat16)
        k = torch.empty(B, 2, 40, D, dtype=torch.bfloat16)
        if name == "dense":
            tile = TileMask(DENSE, torch.ones(B, 1, 40, 40, dtype=torch.bool))
        kernel = CudaSdpaKernel()
        out, lse = kernel.forward(q, k, k, tile, SCALE)
        dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32) for x in (q, k, k))
        kernel.backward(q, q, k, k, out, lse, tile, SCALE, dq, dk, dv)
        assert out.shape == q.shape and lse.shape == q.shape[:3] and dk.shape == k.shape
