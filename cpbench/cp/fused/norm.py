"""A fused RMSNorm: each of a model's RMSNorm modules runs as one op forward (`cpbench::rms_norm`) and one op
backward (`cpbench::rms_norm_backward`), saving for the backward only its input and one fp32 statistic a row.

transformers' eager RMSNorm is some ten kernels (the input cast to fp32, its square, the mean, the add of eps, the
rsqrt, the multiply, the cast back, the weight's multiply), each through HBM, and autograd keeps their fp32
intermediates for the backward, which runs as many again. A fused norm reads the input once and writes the output
once each way, as torchtitan's Llama ran it in its April 2024 benchmarks (a Triton `fused_rmsnorm`) and as Liger's
RMSNorm runs it.

On a CUDA device the ops call torch's own fused kernels, `aten._fused_rms_norm` and `aten._fused_rms_norm_backward`
(aten/src/ATen/native/cuda/layer_norm_kernel.cu: `_fused_rms_norm_cuda`, `_fused_rms_norm_backward_cuda`; fp32
statistics, the weight applied in fp32 before the one cast back, so a bf16 output can differ from the eager norm's
by one rounding). Elsewhere (a CPU has no such kernel: torch decomposes the forward and has no backward) the ops run
the eager norm's own arithmetic, in its order. Either way the two ops are what a step's trace sees, so a projection
prices one fused kernel each way (its bytes in and out) and counts the memory the fused norm keeps.

Only a norm whose forward is transformers' Llama RMSNorm's, source for source (`weight * (x.float() * rsqrt(mean(x²)
+ eps)).to(dtype)`: 138 classes of some 130 families are), is replaced; a model with another RMSNorm (Gemma's
`1 + weight`, OLMo's order) is refused with the classes named.
"""

from __future__ import annotations

import inspect
import types
import warnings
from functools import lru_cache

import torch

NORM_MODES = ("eager", "fused")
FUSED_ATTR = "_cpbench_fused_norm"


@lru_cache(maxsize=None)
def _has_cuda_kernel(name: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA")


KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # where the kernels' statistic is fp32, as here


def _torch_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch's fused CUDA kernels take this call: a CUDA tensor of a half or single dtype and a weight of its dtype.
    A CUDA call they cannot take (a weight of another dtype: an fp32 norm weight under autocast) runs the eager
    arithmetic inside the op, said once: a projection prices the op as one kernel, and it then runs as ten."""
    if not x.is_cuda:
        return False
    if x.dtype in KERNEL_DTYPES and weight.dtype == x.dtype and _has_cuda_kernel("aten::_fused_rms_norm_backward"):
        return True
    warnings.warn(f"cpbench fused norm: a {x.dtype} input with a {weight.dtype} weight is not what torch's fused "
                  "kernels take; this norm runs the eager arithmetic (about ten kernels) inside the op. Give the "
                  "norm weights the input's dtype (the model's dtype, or FSDP2's param_dtype).", stacklevel=3)
    return False


@torch.library.custom_op("cpbench::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The normalized `x` times `weight`, and the fp32 reciprocal RMS of each row (`[..., 1]`); both contiguous (the
    CUDA kernel makes its input so first)."""
    x = x.contiguous()
    if _torch_kernel(x, weight):
        out, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        return out, rstd.view(*x.shape[:-1], 1)
    h = x.to(torch.float32)
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (h * rstd).to(x.dtype), rstd


@rms_norm.register_fake
def _(x, weight, eps):
    out = x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))
    return out, x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@torch.library.custom_op("cpbench::rms_norm_backward", mutates_args=())
def rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of `x` and `weight`, from the forward's input and statistic; both contiguous."""
    grad, x = grad.contiguous(), x.contiguous()
    if _torch_kernel(x, weight):
        dx, dw = torch.ops.aten._fused_rms_norm_backward(grad, x, [x.shape[-1]], rstd, weight, [True, True])
        return dx, dw
    normed = x.to(torch.float32) * rstd
    dw = (grad * normed.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    dn = (grad * weight).to(torch.float32)
    dx = rstd * (dn - normed * (dn * normed).mean(-1, keepdim=True))
    return dx.to(x.dtype), dw


@rms_norm_backward.register_fake
def _(grad, x, weight, rstd):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(weight, memory_format=torch.contiguous_format))


def _setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.mark_non_differentiable(output[1])  # the statistic takes no gradient
    ctx.set_materialize_grads(False)  # ... and no zeros are made for it


def _backward(ctx, grad, _grad_rstd):
    if grad is None:  # the output took no part in the loss
        return None, None, None
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward(grad, x, weight, rstd)
    return dx, dw, None


rms_norm.register_autograd(_backward, setup_context=_setup)


@lru_cache(maxsize=1)
def _llama_forward_source() -> str:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return inspect.getsource(LlamaRMSNorm.forward)


@lru_cache(maxsize=None)
def _is_llama_norm(cls: type) -> bool:
    try:
        return inspect.getsource(cls.forward) == _llama_forward_source()
    except (OSError, TypeError):
        return False


def _fused_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, float(self.variance_epsilon))[0]


def _norms(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")]


def fusion_problem(model: torch.nn.Module) -> str | None:
    """Why the fused op cannot run `model`'s norms (it has none, or one whose forward is not the Llama norm's), or
    None: what `use_fused_norm` refuses and a suite's check refuses before any launch (harness/suite/levers.py)."""
    norms = _norms(model)
    other = sorted({type(m).__name__ for _, m in norms if not _is_llama_norm(type(m))})
    if other:
        return (f"{type(model).__name__} has RMSNorm modules whose forward is not transformers' Llama RMSNorm's "
                f"({', '.join(other)}); the fused op computes only that one")
    return None if norms else f"{type(model).__name__} has no RMSNorm module to fuse"


def use_fused_norm(model: torch.nn.Module) -> torch.nn.Module:
    """Run every RMSNorm of `model` as the fused ops (module names, weights and FSDP groups unchanged). Call it
    before `use_tiled_mlp` (which moves a norm's call into its tiles). Returns the model; calling it again does
    nothing more."""
    problem = fusion_problem(model)
    if problem:
        raise ValueError(f"fused norm: {problem}: leave norm = 'eager' for it.")
    todo = [(name, m) for name, m in _norms(model) if not getattr(m, FUSED_ATTR, False)]
    replaced = [name for name, m in todo if "forward" in vars(m)]
    if replaced:  # checked for every norm before any is changed: a refusal leaves the model as it was
        named = ", ".join(replaced[:3]) + (f" and {len(replaced) - 3} more" if len(replaced) > 3 else "")
        raise ValueError(f"fused norm: the forward of {named} is already replaced on the module (by "
                         "cpbench.use_tiled_mlp, which moves a norm into its tiles, or another library's hook): "
                         "call cpbench.use_fused_norm first.")
    for _, module in todo:
        module.forward = types.MethodType(_fused_forward, module)
        setattr(module, FUSED_ATTR, True)
    return model
