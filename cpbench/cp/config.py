"""`DistributedConfig`: transformers' distributed config plus a context-parallel axis.

The ranks of a cp group share one batch but hold different tokens, so they count as data-parallel ranks for
gradient reduction: `dp_size` includes `cp_size`, and FSDP2 shards and reduces over `fsdp x cp`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.distributed import DistributedConfig as HFDistributedConfig

MIN_TORCH = (2, 10)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


@dataclass
class DistributedConfig(HFDistributedConfig):
    """transformers' `DistributedConfig` with `cp_size` and `cp_plan`.

    Args:
        cp_size: ranks that split every sequence between them. 1 turns context parallelism off.
        cp_plan: overrides merged into the model's default plan, keyed like `model.cp_plan`
            (e.g. `{"model.layers.*.self_attn": "cp_ring"}`). A value of `None` removes a rule.
        cp_ulysses_degree: for the hybrid style `cp_usp`, the ranks of each Ulysses group (consecutive ranks of
            the cp group: inside a node); the ring runs over cp_size / cp_ulysses_degree such groups. 1 (the
            default) or cp_size reduce `cp_usp` to the ring or to Ulysses.
        cp_kernel_device: the device type ("cuda", "cpu") whose attention kernels the CP styles pick; None (the
            default) is the device of the tensors. A projection (`cpbench estimate`) runs a CUDA step on CPU fake
            tensors and sets "cuda", so that the kernels, and the memory they hold, are those CUDA would run.
        cp_kernel_capability: the CUDA compute capability of the GPU the kernels are chosen for, e.g. (9, 0) for an
            H100, (10, 0) for a B200 (default (8, 0), an A100): cuDNN's attention on Hopper and Blackwell,
            FlashAttention-4 from Hopper on (docs/training-loop.md has the table). On a real GPU the device's own
            capability decides.
        cp_kernel_cudnn_version: the cuDNN of that GPU's torch, as torch.backends.cudnn.version() gives it (9.20.0 is
            92000; default: the one torch's own CUDA wheels ship): SDPA prefers cuDNN from 9.15.1 on.
        cp_sdpa_kernel: "cudnn", "flash" or "efficient" to force the kernel an sdpa model's ring tiles run (as
            `cpbench estimate --sdpa-kernel`), or None (default) for the choice PyTorch's SDPA makes on the GPU.
    """

    cp_size: int | None = None
    cp_plan: dict[str, str | None] | None = None
    cp_ulysses_degree: int | None = None
    cp_kernel_device: str | None = None
    cp_kernel_capability: tuple[int, int] | None = None
    cp_kernel_cudnn_version: int | None = None
    cp_sdpa_kernel: str | None = None

    def __post_init__(self):
        if self.cp_size is None:
            self.cp_size = 1
        if not isinstance(self.cp_size, int) or isinstance(self.cp_size, bool) or self.cp_size < 1:
            raise ValueError(f"`cp_size` must be an integer >= 1, got {self.cp_size!r}.")
        if self.cp_plan is not None and not isinstance(self.cp_plan, dict):
            raise TypeError(
                f"`cp_plan` must be a dict mapping module patterns to style names, got {type(self.cp_plan).__name__}."
            )
        if self.cp_ulysses_degree is None:
            self.cp_ulysses_degree = 1
        u = self.cp_ulysses_degree
        if not isinstance(u, int) or isinstance(u, bool) or u < 1 or self.cp_size % u:
            raise ValueError(
                f"`cp_ulysses_degree` must be a positive integer that divides cp_size={self.cp_size}, got {u!r} "
                f"(e.g. cp_size=8 with cp_ulysses_degree=2: Ulysses over pairs of ranks, the ring over 4 pairs)."
            )
        if self.cp_kernel_device not in (None, "cpu", "cuda"):
            raise ValueError(f"`cp_kernel_device` must be None, 'cpu' or 'cuda', got {self.cp_kernel_device!r}.")
        self._check_kernel_target()
        if self.cp_size > 1:  # before transformers' checks, whose messages don't know about cp
            self._refuse_unsupported_combinations()
        super().__post_init__()

    def _check_kernel_target(self) -> None:
        cap, cudnn, sdpa = self.cp_kernel_capability, self.cp_kernel_cudnn_version, self.cp_sdpa_kernel
        if cap is not None:
            if (not isinstance(cap, (tuple, list)) or len(cap) != 2
                    or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in cap)):
                raise ValueError(f"`cp_kernel_capability` must be a CUDA compute capability (major, minor), e.g. "
                                 f"(9, 0) for an H100, got {cap!r}.")
            self.cp_kernel_capability = tuple(cap)
        if cudnn is not None and (not isinstance(cudnn, int) or isinstance(cudnn, bool) or cudnn < 0):
            raise ValueError(f"`cp_kernel_cudnn_version` must be an integer as torch.backends.cudnn.version() gives it "
                             f"(cuDNN 9.20.0 is 92000), got {cudnn!r}.")
        if sdpa not in (None, "cudnn", "flash", "efficient"):
            raise ValueError(f"`cp_sdpa_kernel` must be None, 'cudnn', 'flash' or 'efficient', got {sdpa!r}.")
        named = [n for n in ("cp_kernel_capability", "cp_kernel_cudnn_version", "cp_sdpa_kernel") if getattr(self, n)
                 is not None]
        if named and self.cp_kernel_device == "cpu":
            raise ValueError(f"`{named[0]}` names a CUDA GPU's kernels, but cp_kernel_device='cpu'; set "
                             "cp_kernel_device='cuda' (or None on a GPU), or drop it.")

    def _refuse_unsupported_combinations(self) -> None:
        for name in ("pp_size", "tp_size", "ep_size"):
            value = getattr(self, name) or 1
            if value > 1:
                raise ValueError(
                    f"`{name}={value}` together with `cp_size={self.cp_size}` is not supported yet: cpbench composes "
                    f"context parallelism with FSDP and dp_replicate only. Set `{name}=1` or `cp_size=1`."
                )
        # The deprecated flag alone would become ep_size = tp_size = 1 in transformers' checks, silently no EP.
        if self.enable_expert_parallel:
            raise ValueError(
                f"`enable_expert_parallel=True` together with `cp_size={self.cp_size}` is not supported yet: under "
                "context parallelism an MoE model's experts are FSDP-sharded with the rest of it, never expert-"
                "parallel. Drop `enable_expert_parallel` (and `ep_size`), or set `cp_size=1`."
            )
        if _torch_version() < MIN_TORCH:
            raise ValueError(
                f"Context parallelism needs torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}, found {torch.__version__}. "
                "Upgrade torch or set `cp_size=1`."
            )

    @property
    def dp_size(self) -> int:
        """Ranks that reduce gradients together: `dp_replicate_size * fsdp_size * cp_size`."""
        return self.dp_replicate_size * self.fsdp_size * self.cp_size

    @property
    def world_size(self) -> int:
        """Processes the mesh needs."""
        return self.pp_size * self.dp_replicate_size * self.fsdp_size * self.cp_size * self.tp_size

    @property
    def mesh_shape(self) -> tuple[int, int, int, int, int]:
        return (self.pp_size, self.dp_replicate_size, self.fsdp_size, self.cp_size, self.tp_size)
