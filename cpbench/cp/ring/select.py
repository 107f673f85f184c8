"""Which block kernel serves a ring layer: the model's attention implementation, the device and the dtype decide.

- flash_attention_2 on CUDA (fp16/bf16, flash-attn installed, Ampere or newer): `FlashAttnKernel` (flash.py);
- CPU: torch's CPU flash kernel (`CpuSdpaKernel`, kernels.py);
- CUDA otherwise: PyTorch's fused kernels (`CudaSdpaKernel`, cuda.py);
- logit soft-capping, and anything else: the exact `TorchKernel`.

A value head dim other than the query's (multi-head latent attention): flash-attn 2 and PyTorch's flash kernel take
one head dim for q, k and v (flash_api.cpp CHECK_SHAPE(v, ..., head_size); tests/emulation/_flash.py), PyTorch's
memory-efficient kernel takes v's own (tests/emulation/aten_efficient.py). Such a layer gets `CudaSdpaKernel` on
CUDA even for flash_attention_2 (which routes every tile to the efficient kernel), and `CpuSdpaKernel` on CPU (which
zero-pads to one head dim: the CPU kernel has no other form, and padding keeps it O(tile rows), where `TorchKernel`
would hold every tile's fp32 scores).
"""

from __future__ import annotations

import torch

from cpbench.cp.ring.cuda import CudaSdpaKernel, cuda_capability
from cpbench.cp.ring.flash import flash_kernel_or_none
from cpbench.cp.ring.kernels import RING_IMPLEMENTATIONS, CpuSdpaKernel, TorchKernel

CPU_SDPA_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def select_kernel(
    attn_implementation: str, query: torch.Tensor, softcap: float | None = None, device_type: str | None = None,
    value: torch.Tensor | None = None,
):
    """The block kernel for a model's attention implementation, on `device_type` (default: the query's device)
    and the query's dtype; `value` (default: v's head dim is q's) tells a layer whose value head dim differs."""
    device_type = device_type or query.device.type
    if attn_implementation not in RING_IMPLEMENTATIONS:
        raise ValueError(
            f"Ring attention cannot serve attn_implementation={attn_implementation!r}; it serves "
            f"{list(RING_IMPLEMENTATIONS)}. Load the model with one of those, or use cp_ulysses (any backend)."
        )
    same_head_dim = value is None or value.shape[-1] == query.shape[-1]
    if attn_implementation == "flash_attention_2" and same_head_dim:
        kernel = flash_kernel_or_none(query, softcap, device_type)
        if kernel is not None:
            return kernel
    if softcap is None and device_type == "cpu" and query.dtype in CPU_SDPA_DTYPES:
        return CpuSdpaKernel()
    if softcap is None and device_type == "cuda":
        return CudaSdpaKernel(capability=cuda_capability(query))
    return TorchKernel(softcap)
