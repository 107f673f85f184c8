"""The ring's new tiles on a real GPU (`python -m pytest -m gpu tests/gpu -rs`): cuDNN's attention (the sdpa kernel on
Hopper and Blackwell, forced here on any sm80+ GPU with cuDNN), FlashAttention-3 and FlashAttention-4, each against
the exact matmul kernel tile by tile (FULL, CAUSAL, DENSE through the masked fallback, a packed SEGMENTS tile), with
GQA in bf16 - the checks tests/unit/test_ring_hopper_kernels.py runs against the emulations on CPU. A kernel whose
package is not installed, or that this GPU cannot run, is skipped with the reason (and the pip install that fixes it).
"""

import pytest
import torch

from cpbench.cp.ring import fa3 as ring_fa3
from cpbench.cp.ring import fa4 as ring_fa4
from cpbench.cp.ring.cuda import CudaSdpaKernel
from cpbench.cp.ring.kernels import TorchKernel, acc_dtype
from cpbench.cp.ring.masks import CAUSAL, DENSE, FULL, SEGMENTS, TileMask, build_ring_masks
from cpbench.cp.ring.target import KernelTarget, resolve_target

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

B, H, HKV, S, D = 2, 8, 2, 256, 128


def _target(**force) -> KernelTarget:
    here = resolve_target(None, torch.empty(0, device="cuda"))
    return KernelTarget(**{**here.__dict__, **force})


def _kernel(which: str):
    target = _target()
    if which == "cudnn":
        if not torch.backends.cudnn.is_available() or target.capability < (8, 0):
            pytest.skip("cuDNN attention needs cuDNN and an sm80+ GPU")
        return CudaSdpaKernel(target=_target(sdpa_kernel="cudnn"))  # forced: also on an A100 (SDPA's 4th choice)
    make, package = ((ring_fa3.fa3_kernel_or_none, "build flash-attn-3, then pip install 'cpbench[fa3]'")
                     if which == "fa3" else (ring_fa4.fa4_kernel_or_none, "pip install 'cpbench[fa4]'"))
    kernel = make(torch.empty(1, device="cuda", dtype=torch.bfloat16), None, target)
    if kernel is None:
        pytest.skip(f"{which} does not run here ({target.sm}) or is not installed: {package}")
    return kernel


def _run(kernel, q, k, v, dout, tile, ref_tile, scale):
    exact = TorchKernel()
    ref = exact.forward(q, k, v, ref_tile, scale)
    results = []
    for kern, t in ((kernel, tile), (exact, ref_tile)):
        out, lse = kern.forward(q, k, v, t, scale)
        grads = [torch.zeros(x.shape, dtype=acc_dtype(q.dtype), device="cuda") for x in (q, k, v)]
        kern.backward(dout, q, k, v, ref[0].to(q.dtype), ref[1], t, scale, *grads)
        results.append((out, lse, grads))
    (out, lse, grads), (ref_out, ref_lse, ref_grads) = results
    tol = 4 * torch.finfo(torch.bfloat16).eps  # bf16 out and gradients, fp32 accumulation on both sides
    for got, want, what in ((out, ref_out, "out"), *zip(grads, ref_grads, ("dq", "dk", "dv"))):
        err = ((got.double() - want.double()).abs().max() / max(want.double().abs().max().item(), 1.0)).item()
        assert err <= tol, f"{what}: {err:.3g} > {tol:.3g}"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))


@pytest.mark.parametrize("which", ["cudnn", "fa3", "fa4"])
@pytest.mark.parametrize("name", ["full", "causal", "dense", "packed"])
def test_new_tiles_match_the_exact_kernel_on_cuda(which, name, monkeypatch):
    from cpbench.cp.ring import cudnn

    monkeypatch.setattr(cudnn, "RUN_MIN_FLOPS", 0)  # cuDNN: a packed tile run by run (flash varlen: the sdpa tests)
    kernel = _kernel(which)
    g = torch.Generator(device="cuda").manual_seed(1)
    q, dout = (torch.randn(B, H, S, D, device="cuda", generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(B, HKV, S, D, device="cuda", generator=g).bfloat16() for _ in range(2))
    tile = ref_tile = TileMask(CAUSAL if name == "causal" else FULL)
    if name == "dense":
        allowed = torch.rand(B, 1, S, S, device="cuda", generator=g) > 0.3
        allowed[0, 0, 5] = False  # a row that sees no key
        tile = ref_tile = TileMask(DENSE, allowed)
    elif name == "packed":
        pos = torch.cat([torch.arange(100), torch.arange(300), torch.arange(112)])[None].cuda()
        lean = build_ring_masks(None, seq_len=2 * S, padded_len=2 * S, device="cuda", position_ids=pos, varlen=True)
        dense = build_ring_masks(None, seq_len=2 * S, padded_len=2 * S, device="cuda", batch=lean.batch)
        tile, ref_tile = lean.tile(S, S, S), dense.tile(S, S, S)
        assert tile.kind == SEGMENTS
    _run(kernel, q, k, v, dout, tile, ref_tile, D**-0.5)
