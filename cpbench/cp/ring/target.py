"""The GPU a ring layer's block kernels are chosen for: its compute capability and the cuDNN torch runs there.

Which kernel computes a tile depends on the card as much as on the model's backend: PyTorch's SDPA puts cuDNN's
fused attention first on Hopper and Blackwell with a recent cuDNN, and FlashAttention-2 elsewhere; FlashAttention-3
runs on Hopper, FlashAttention-4 on Hopper and Blackwell. The ring makes the same choice as the model's own
attention on the same card, on a real GPU, in a CPU run standing for one and in a projection of one (DESIGN.md,
"Long context at scale"), so the target is explicit:

- on a real GPU the device's own capability, cuDNN and CUDA versions decide (a target given in the config is
  ignored there: the kernels must run on the card at hand);
- elsewhere `DistributedConfig(cp_kernel_device="cuda", cp_kernel_capability=(9, 0), cp_kernel_cudnn_version=...)`
  names the card (a training loop or a test on CPU standing for it, `cpbench estimate --gpu` from the profile's
  `capability` and `cudnn_version`); without a capability the target is an A100 (8.0), without a cuDNN version the
  one torch's own CUDA wheels ship (`TORCH_WHEEL_CUDNN`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

AMPERE = (8, 0)  # the default target GPU: PyTorch's flash kernels and flash-attn 2 are built for Ampere and newer
# cuDNN of the torch build a CPU run stands for: torch 2.13.0's Linux wheels require nvidia-cudnn-cu13==9.20.0.48
# (their PyPI metadata; gpus.toml cites the same), in torch.backends.cudnn.version()'s encoding
TORCH_WHEEL_CUDNN = 92000
TORCH_WHEEL_CUDA = (13, 0)  # those wheels are built with CUDA 13
SDPA_KERNELS = ("cudnn", "flash", "efficient")  # what `sdpa_kernel` may force (`cpbench estimate --sdpa-kernel`)


@dataclass(frozen=True)
class KernelTarget:
    """`device`: "cuda" or "cpu"; for CUDA, the card's `capability` (major, minor), its `cudnn_version`
    (torch.backends.cudnn.version()'s encoding: 9.20.0 -> 92000; None: no cuDNN), the CUDA version torch was built
    with, and `sdpa_kernel`: the kernel an sdpa model's tiles are forced to (None: torch's own priority)."""

    device: str | None = "cuda"  # None: the tensors' device (a config naming a GPU without cp_kernel_device)
    capability: tuple[int, int] = AMPERE
    cudnn_version: int | None = TORCH_WHEEL_CUDNN
    cuda_version: tuple[int, int] = TORCH_WHEEL_CUDA
    sdpa_kernel: str | None = None
    cudnn_deprioritized: bool = False  # TORCH_CUDNN_SDPA_DEPRIORITIZED on a real GPU (see sdpa_prefers_cudnn)

    @property
    def sm(self) -> str:
        return f"sm{self.capability[0]}{self.capability[1]}"


def kernel_target(device: str | None, capability=None, cudnn_version: int | None = None,
                  sdpa_kernel: str | None = None) -> KernelTarget | None:
    """The target a DistributedConfig names (None: the device of the tensors, chosen at the first call)."""
    if device is None and capability is None and cudnn_version is None and sdpa_kernel is None:
        return None
    return KernelTarget(device=device, capability=tuple(capability or AMPERE),
                        cudnn_version=TORCH_WHEEL_CUDNN if cudnn_version is None else cudnn_version,
                        sdpa_kernel=sdpa_kernel)


def resolve_target(kernel_device, query: torch.Tensor) -> KernelTarget:
    """`kernel_device` as a style receives it (None, a device type, or a `KernelTarget`) resolved for `query`: a
    query on a real GPU takes that GPU's own capability and libraries, keeping only a forced `sdpa_kernel`."""
    if isinstance(kernel_device, KernelTarget):
        given = kernel_device if kernel_device.device else replace(kernel_device, device=query.device.type)
    else:
        given = KernelTarget(device=kernel_device or query.device.type)
    if query.device.type == "cuda":
        return _this_gpu(query.device, given.sdpa_kernel)
    return given


def _this_gpu(device: torch.device, sdpa_kernel: str | None) -> KernelTarget:
    cuda = tuple(int(x) for x in (torch.version.cuda or "0.0").split(".")[:2])
    return KernelTarget(
        device="cuda", capability=tuple(torch.cuda.get_device_capability(device)),
        cudnn_version=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        cuda_version=cuda, sdpa_kernel=sdpa_kernel,
        # torch reads this variable itself (sdp_utils.cpp check_prefer_cudnn_attention); mirrored so that the ring
        # and the model's own SDPA calls agree on the card at hand. A target standing for a card never reads it.
        cudnn_deprioritized=os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").lower() in ("1", "true", "on"),
    )


def sdpa_prefers_cudnn(target: KernelTarget) -> bool:
    """Whether PyTorch's SDPA tries cuDNN's fused attention first on this target: torch's own rule,
    aten/src/ATen/native/transformers/cuda/sdp_utils.cpp `check_prefer_cudnn_attention` (pytorch @001f694a):
    cuDNN > 9.15.0 ("cuDNN 9.15.1 required for seq_len not divisible by 128 fix"), compute capability 9.x or 10.x,
    and with a CUDA < 13 build only minor 0 or 3; then `priority_order` puts cudnn_attention before flash,
    efficient and math. Elsewhere the order is flash, efficient, math, cuDNN (Context.h sdp_priority_order), so a
    call flash or the efficient kernel can take never reaches cuDNN. `sdpa_kernel` forces the answer
    (`cpbench estimate --sdpa-kernel`)."""
    if target.sdpa_kernel is not None:
        return target.sdpa_kernel == "cudnn"
    major, minor = target.capability
    if target.cudnn_deprioritized or target.cudnn_version is None or target.cudnn_version <= 91500:
        return False
    return major in (9, 10) and (target.cuda_version >= (13, 0) or minor in (0, 3))
