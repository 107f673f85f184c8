"""The ring's CUDA block kernel on a real GPU (`python -m pytest -m gpu tests/gpu`): PyTorch's fused flash and
memory-efficient ops against the exact matmul kernel, tile by tile, for every tile kind, GQA, bf16 and fp32 —
the same checks tests/unit/test_ring_cuda.py runs against emulations on CPU. Skipped without CUDA."""

import pytest
import torch

from cpbench.cp.ring.cuda import CudaSdpaKernel
from cpbench.cp.ring.kernels import TorchKernel, acc_dtype
from cpbench.cp.ring.masks import CAUSAL, DENSE, FULL, TileMask

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


@pytest.mark.parametrize("case", ["packed", "left-padded", "window"])
def test_varlen_segments_match_the_exact_kernel_on_cuda(case):
    """SEGMENTS tiles through aten's flash op with cu_seqlens and window sizes, against the exact kernel on the same
    tile's dense mask (the CPU twin is tests/unit/test_ring_segments.py)."""
    from cpbench.cp.ring.masks import SEGMENTS, build_ring_masks

    s, n = 512, 256
    kwargs = {
        "packed": {"position_ids": torch.cat([torch.arange(100), torch.arange(300), torch.arange(112)])[None]},
        "left-padded": {"attention_mask": torch.cat([torch.zeros(2, 40), torch.ones(2, s - 40)], 1).long()},
        "window": {"sliding_window": 96},
    }[case]
    kwargs = {key: value.cuda() if torch.is_tensor(value) else value for key, value in kwargs.items()}
    lean = build_ring_masks(kwargs.pop("attention_mask", None), seq_len=s, padded_len=s, device="cuda",
                            varlen=True, **kwargs)
    dense = build_ring_masks(None, seq_len=s, padded_len=s, device="cuda", batch=lean.batch,
                             sliding_window=lean.window)
    g = torch.Generator(device="cuda").manual_seed(2)
    q, dout = (torch.randn(B, H, n, D, device="cuda", generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(B, 2, n, D, device="cuda", generator=g).bfloat16() for _ in range(2))
    seen = 0
    for q0, k0 in ((0, 0), (n, 0), (n, n)):
        tile = lean.tile(q0, k0, n)
        if tile.kind != SEGMENTS:
            continue
        seen += 1
        exact, ref_tile = TorchKernel(), dense.tile(q0, k0, n)
        ref = exact.forward(q, k, v, ref_tile, D**-0.5)
        out, lse, grads = _run(CudaSdpaKernel(), q, k, v, dout, tile, D**-0.5, ref)
        _, _, ref_grads = _run(exact, q, k, v, dout, ref_tile, D**-0.5, ref)
        tol = 4 * torch.finfo(torch.bfloat16).eps  # bf16 out and gradients, as above
        for got, want, what in ((out, ref[0], "out"), *zip(grads, ref_grads, ("dq", "dk", "dv"))):
            err = ((got.double() - want.double()).abs().max() / max(want.double().abs().max().item(), 1.0)).item()
            assert err <= tol, f"{case} tile ({q0}, {k0}) {what}: {err:.3g} > {tol:.3g}"
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref[1]))
    assert seen, f"{case}: no tile came as SEGMENTS"
