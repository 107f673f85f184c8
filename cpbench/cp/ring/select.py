"""Which block kernel serves a ring layer: the model's attention implementation, the target GPU and the dtype decide.

The target (cp/ring/target.py) is the GPU the kernels are chosen for: the device at hand, or the one a CPU run or a
projection stands for (`DistributedConfig(cp_kernel_device="cuda", cp_kernel_capability=(9, 0))`, `cpbench estimate
--gpu`). On a CUDA target each backend's tiles run the kernel the model's own attention runs on that card:

| backend | FULL / CAUSAL tiles | SEGMENTS tiles (packed, padded, windowed) | DENSE tiles |
| sdpa, Hopper/Blackwell, cuDNN > 9.15 | cuDNN (cudnn.py) | cuDNN run by run, or flash varlen | cuDNN with a bias |
| sdpa, elsewhere (A100, ...) | PyTorch's flash | flash varlen | memory-efficient with a bias |
| flash_attention_2 (Ampere+) | flash-attn 2 (flash.py) | flash-attn 2 varlen | as sdpa on the card |
| flash_attention_3 (Ampere+; Hopper) | FlashAttention-3 (fa3.py) | FlashAttention-3 varlen | as sdpa on the card |
| flash_attention_4 (Hopper+) | FlashAttention-4 (fa4.py) | FlashAttention-4 varlen | as sdpa on the card |

Each kernel module says why, with the time model's figures, and the contract its calls keep. A flash backend whose
package is not installed (a CPU run standing for a GPU without the emulations), or whose head dims it cannot take,
gets sdpa's kernel for the card (`CudaSdpaKernel`, which takes a value head dim other than the query's: multi-head
latent attention). Logit soft-capping: the flash backends take it; sdpa gets the exact `TorchKernel`. On CPU:
torch's CPU flash kernel (`CpuSdpaKernel`, which zero-pads an MLA layer to one head dim: the CPU kernel has no other
form, and padding keeps it O(tile rows), where `TorchKernel` would hold every tile's fp32 scores).
"""

from __future__ import annotations

import torch

from cpbench.cp.ring.cuda import CudaSdpaKernel
from cpbench.cp.ring.fa3 import fa3_kernel_or_none
from cpbench.cp.ring.fa4 import fa4_kernel_or_none
from cpbench.cp.ring.flash import flash_kernel_or_none
from cpbench.cp.ring.kernels import RING_IMPLEMENTATIONS, CpuSdpaKernel, TorchKernel
from cpbench.cp.ring.target import resolve_target

CPU_SDPA_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
FLASH_BACKENDS = {"flash_attention_2": flash_kernel_or_none, "flash_attention_3": fa3_kernel_or_none,
                  "flash_attention_4": fa4_kernel_or_none}


def select_kernel(
    attn_implementation: str, query: torch.Tensor, softcap: float | None = None, device_type=None,
    value: torch.Tensor | None = None,
):
    """The block kernel for a model's attention implementation on `device_type` (None: the query's device; a device
    type; or a `KernelTarget` naming the GPU), in the query's dtype; `value` (default: v's head dim is q's) tells a
    layer whose value head dim differs."""
    target = resolve_target(device_type, query)
    if attn_implementation not in RING_IMPLEMENTATIONS:
        raise ValueError(
            f"Ring attention cannot serve attn_implementation={attn_implementation!r}; it serves "
            f"{list(RING_IMPLEMENTATIONS)}. Load the model with one of those, or use cp_ulysses (any backend)."
        )
    flash = FLASH_BACKENDS.get(attn_implementation)
    if flash is not None:
        kernel = flash(query, softcap, target)
        if kernel is not None and kernel.head_dims_ok(query, value):
            return kernel
    if softcap is None and target.device == "cpu" and query.dtype in CPU_SDPA_DTYPES:
        return CpuSdpaKernel()
    if softcap is None and target.device == "cuda":
        return CudaSdpaKernel(target=target)
    return TorchKernel(softcap)
