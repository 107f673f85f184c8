"""The fused RMSNorm on a CUDA device (cpbench/cp/fused/norm.py): torch's own fused kernels take the call
(`_fused_rms_norm_cuda`, `_fused_rms_norm_backward_cuda`), and the values are the eager norm's within the one
rounding their weight-before-cast order differs by."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import cpbench
from cpbench.cp.fused import norm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class _Holder(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.norm = module


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torchs_fused_kernels_give_the_eager_norms_values(dtype):
    torch.manual_seed(0)
    eager = LlamaRMSNorm(4096, eps=1e-5).to("cuda", dtype)
    eager.weight.data = torch.randn(4096, device="cuda").to(dtype)
    fused = copy.deepcopy(eager)
    cpbench.use_fused_norm(_Holder(fused))
    x = torch.randn(2, 1024, 4096, device="cuda", dtype=dtype, requires_grad=True)
    y = x.detach().clone().requires_grad_()
    assert norm._torch_kernel(y, fused.weight)  # the CUDA kernels, not the CPU arithmetic
    a, b = eager(x), fused(y)
    grad = torch.randn_like(a)
    a.backward(grad)
    b.backward(grad)
    # bf16: one rounding of the output apart (eager casts before the weight's multiply, the kernel after); fp32: the
    # same terms summed in another order
    tol = dict(rtol=2 * torch.finfo(dtype).eps, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b, a, **tol)
    torch.testing.assert_close(y.grad, x.grad, **tol)
    # the weight's gradient sums 2,048 rows: bf16 accumulation differs by a few of its roundings
    torch.testing.assert_close(fused.weight.grad.float(), eager.weight.grad.float(), rtol=2e-2, atol=0.5)
