"""Block kernels against plain attention, and the choice of kernel per attn_implementation."""

from __future__ import annotations

import pytest
import torch

from cpbench.cp.ring.kernels import CpuSdpaKernel, TorchKernel
from cpbench.cp.ring.masks import CAUSAL, DENSE, FULL, TileMask
from cpbench.cp.ring.select import select_kernel

B, H, HKV, Q, D = 2, 4, 2, 6, 8
SCALE = D**-0.5


def tiles():
    allowed = torch.rand(B, 1, Q, Q, generator=torch.Generator().manual_seed(0)) > 0.4
    allowed[0, 0, 2] = False  # a row that sees no key
    return {"full": TileMask(FULL), "causal": TileMask(CAUSAL), "dense": TileMask(DENSE, allowed)}


def as_bool(tile: TileMask) -> torch.Tensor:
    if tile.kind == FULL:
        return torch.ones(1, 1, Q, Q, dtype=torch.bool)
    if tile.kind == CAUSAL:
        return torch.ones(Q, Q, dtype=torch.bool).tril()[None, None]
    return tile.allowed


def reference(q, k, v, allowed, softcap=None):
    k, v = (x.repeat_interleave(H // HKV, 1) for x in (k, v))
    s = q @ k.transpose(-1, -2) * SCALE
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, -1).nan_to_num() @ v, torch.logsumexp(s, -1)


@pytest.mark.parametrize("kernel", [TorchKernel(), CpuSdpaKernel(), TorchKernel(softcap=2.0)], ids=str)
@pytest.mark.parametrize("name", ["full", "causal", "dense"])
def test_kernel_matches_plain_attention(kernel, name):
    tile = tiles()[name]
    g = torch.Generator().manual_seed(1)
    q, do = (torch.randn(B, H, Q, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, HKV, Q, D, generator=g, dtype=torch.float64) for _ in range(2))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = reference(*leaves, as_bool(tile), getattr(kernel, "softcap", None))
    ref_out.backward(do)

    out, lse = kernel.forward(q, k, v, tile, SCALE)
    grads = [torch.zeros_like(x) for x in (q, k, v)]
    kernel.backward(do, q, k, v, out, lse, tile, SCALE, *grads)
    # fp64 on both sides, sums of <= Q terms: rounding only, far below 1e-12.
    assert torch.allclose(out, ref_out, atol=1e-12)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-12)
    for got, leaf in zip(grads, leaves):
        assert torch.allclose(got, leaf.grad, atol=1e-12)


def test_ring_serves_only_what_it_can_and_says_which():
    q = torch.zeros(1, 1, 1, 8)
    served = r"\['eager', 'sdpa', 'flash_attention_2', 'flash_attention_3', 'flash_attention_4'\]"
    with pytest.raises(ValueError, match=r"flex_attention.*" + served):
        select_kernel("flex_attention", q)
    assert isinstance(select_kernel("sdpa", q), CpuSdpaKernel)
    assert isinstance(select_kernel("eager", q, softcap=30.0), TorchKernel)
    # flash_attention_2 on CPU (no flash-attn kernels here): the exact torch kernels serve it.
    assert isinstance(select_kernel("flash_attention_2", q), CpuSdpaKernel)


def test_flash_attn_kernel_needs_cuda_and_flash_attn():
    pytest.importorskip("flash_attn")
    if not torch.cuda.is_available():
        pytest.skip("flash-attn kernels need CUDA")
    from cpbench.cp.ring.flash import FlashAttnKernel

    q = torch.zeros(1, 2, 8, 64, device="cuda", dtype=torch.bfloat16)
    assert isinstance(select_kernel("flash_attention_2", q), FlashAttnKernel)


def test_a_model_the_ring_cannot_serve_is_refused_at_load_time():
    from transformers import AutoModelForCausalLM

    import cpbench
    from cpbench.cp.apply import resolve_for
    from tests.dist.models import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    model.config._attn_implementation = "flex_attention"
    config = cpbench.DistributedConfig(cp_size=2, cp_plan={"model.layers.*.self_attn": "cp_ring"})
    with pytest.raises(ValueError, match="cp_ring.*flex_attention"):
        resolve_for(model, config)
