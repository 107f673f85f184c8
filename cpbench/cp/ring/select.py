"""Which block kernel serves a ring layer: the model's attention implementation, the device and the dtype decide.

- flash_attention_2 on CUDA (fp16/bf16, flash-attn installed, Ampere or newer): `FlashAttnKernel` (flash.py);
- CPU: torch's CPU flash kernel (`CpuSdpaKernel`, kernels.py);
- CUDA otherwise: PyTorch's fused kernels (`CudaSdpaKernel`, cuda.py);
- logit soft-capping, and anything else: the exact `TorchKernel`.
"""

from __future__ import annotations

import torch

from cpbench.cp.ring.cuda import CudaSdpaKernel, cuda_capability
from cpbench.cp.ring.flash import flash_kernel_or_none
from cpbench.cp.ring.kernels import RING_IMPLEMENTATIONS, CpuSdpaKernel, TorchKernel

CPU_SDPA_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def select_kernel(
    attn_implementation: str, query: torch.Tensor, softcap: float | None = None, device_type: str | None = None
):
    """The block kernel for a model's attention implementation, on `device_type` (default: the query's device)
    and the query's dtype."""
    device_type = device_type or query.device.type
    if attn_implementation not in RING_IMPLEMENTATIONS:
        raise ValueError(
            f"Ring attention cannot serve attn_implementation={attn_implementation!r}; it serves "
            f"{list(RING_IMPLEMENTATIONS)}. Load the model with one of those, or use cp_ulysses (any backend)."
        )
    if attn_implementation == "flash_attention_2":
        kernel = flash_kernel_or_none(query, softcap, device_type)
        if kernel is not None:
            return kernel
    if softcap is None and device_type == "cpu" and query.dtype in CPU_SDPA_DTYPES:
        return CpuSdpaKernel()
    if softcap is None and device_type == "cuda":
        return CudaSdpaKernel(capability=cuda_capability(query))
    return TorchKernel(softcap)
