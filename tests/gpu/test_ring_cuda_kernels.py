"""The ring's CUDA block kernel on a real GPU (`python -m pytest -m gpu tests/gpu`): PyTorch's fused flash and
memory-efficient ops against the exact matmul kernel, tile by tile, for every tile kind, GQA, bf16 and fp32 —
the same checks tests/unit/test_ring_cuda.py runs against emulations on CPU. Skipped without CUDA."""

import pytest
import torch

from cpbench.cp.ring_cuda import CudaSdpaKernel
from cpbench.cp.ring_kernels import TorchKernel, acc_dtype
from cpbench.cp.ring_masks import CAUSAL, DENSE, FULL, TileMask

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

B, H, S, D = 2, 8, 256, 64


def _tile(name):
    if name == "dense":
        g = torch.Generator(device="cuda").manual_seed(0)
        allowed = torch.rand(B, 1, S, S, device="cuda", generator=g) > 0.3
        allowed[0, 0, 5] = False  # a row that sees no key
        return TileMask(DENSE, allowed)
    return TileMask(CAUSAL if name == "causal" else FULL)


def _run(kernel, q, k, v, dout, tile, scale, ref):
    out, lse = kernel.forward(q, k, v, tile, scale)
    dq, dk, dv = (torch.zeros(x.shape, dtype=acc_dtype(q.dtype), device="cuda") for x in (q, k, v))
    ref_out, ref_lse = ref
    kernel.backward(dout, q, k, v, ref_out.to(q.dtype), ref_lse, tile, scale, dq, dk, dv)
    return out, lse, (dq, dk, dv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("kv_heads", [H, 2])
@pytest.mark.parametrize("name", ["full", "causal", "dense"])
def test_fused_ops_match_the_exact_kernel_on_cuda(name, kv_heads, dtype):
    g = torch.Generator(device="cuda").manual_seed(1)
    q, dout = (torch.randn(B, H, S, D, device="cuda", generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(B, kv_heads, S, D, device="cuda", generator=g).to(dtype) for _ in range(2))
    tile, scale = _tile(name), D**-0.5
    exact = TorchKernel()
    ref = exact.forward(q, k, v, tile, scale)
    out, lse, grads = _run(CudaSdpaKernel(), q, k, v, dout, tile, scale, ref)
    _, _, ref_grads = _run(exact, q, k, v, dout, tile, scale, ref)
    # bf16: the fused kernels round out and dq/dk/dv to bf16 (a few eps of the largest value); fp32: TF32-free
    # fp32 accumulation in different orders (1e-4 of the largest value leaves room for 256-term sums).
    tol = 4 * torch.finfo(torch.bfloat16).eps if dtype == torch.bfloat16 else 1e-4
    for got, want, what in ((out, ref[0], "out"), *zip(grads, ref_grads, ("dq", "dk", "dv"))):
        err = ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
        assert err <= tol, f"{what}: {err:.3g} > {tol:.3g}"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref[1]))
