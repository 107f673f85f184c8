"""Which points are `skipped`, and why — decided before they would launch.

- a style that this install has not registered (a documented style whose implementation has not landed);
- a style that cannot serve the point's attention backend (its registered `implementations`);
- a FlashAttention backend (2, 3 or 4) whose package is not installed, with the install that brings it;
- a CUDA point on a machine with fewer GPUs than ranks (one GPU per rank: NCCL refuses two ranks on one GPU,
  and gloo cannot run all-to-all on CUDA tensors);
- in a projection (`cpbench estimate`), instead of the two above: a backend whose kernels cannot run on fake CPU
  tensors (flash-attn, flex_attention);
- loss = "liger" where Liger-Kernel cannot run: not installed, not CUDA, or a projection (Triton on fake tensors);
- mixed precision on one rank: it is FSDP2's policy, and a 1-rank point is not sharded;
- a peer implementation (peers/registry.py) that is not installed or cannot run on the point's device; in a projection,
  every attention-level point (`cpbench estimate` projects the model step);
- a point longer than a sequence at which the same configuration already ran out of memory: the longest
  length that fitted, per cp size, is then data in the table.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

from cpbench.harness.suite.spec import NO_STYLE, Point

# backend -> (its distribution, the module transformers and the ring import, the install that brings it)
KERNEL_PACKAGES = {
    "flash_attention_2": ("flash-attn", "flash_attn", "pip install 'cpbench[gpu]'"),
    "flash_attention_3": ("flash-attn-3", "flash_attn_interface",
                          "build FlashAttention-3 from FlashAttention's hopper/ folder (`python setup.py install`; "
                          "it is not on PyPI), then pip install 'cpbench[fa3]'"),
    "flash_attention_4": ("flash-attn-4", "flash_attn.cute", "pip install 'cpbench[fa4]'"),
}


def kernel_package_missing(attn_implementation: str) -> str | None:
    """Why a FlashAttention backend cannot load here (its distribution is not installed), with the install that
    fixes it; None when it is installed or needs no package. The distribution decides, as transformers decides
    (utils/import_utils.py is_flash_attn_*_available): flash-attn 2 and 4 share the `flash_attn` module."""
    if attn_implementation not in KERNEL_PACKAGES:
        return None
    dist, module, install = KERNEL_PACKAGES[attn_implementation]
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return f"attn_implementation={attn_implementation!r} needs the {dist!r} package ({module}), not installed " \
               f"here: {install}"
    return None


class SkipRules:
    def __init__(self):
        self.oom_at: dict[str, int] = {}  # family -> shortest length that ran out of memory
        self.fit_at: dict[str, int] = {}  # family -> longest length that fitted

    def observe(self, point: Point, status: str) -> None:
        f, s = point.family_key, point.seq_len
        if status == "oom":
            self.oom_at[f] = min(s, self.oom_at.get(f, s))
        elif status == "ok":
            self.fit_at[f] = max(s, self.fit_at.get(f, s))

    def learn(self, table, points: list[Point]) -> None:
        """Replays the rows of a run being resumed."""
        by_id = {p.point_id: p for p in points}
        for pid, status in zip(table["point_id"], table["status"], strict=True):
            if pid in by_id:
                self.observe(by_id[pid], status)

    def why_skip(self, point: Point, *, projection: bool = False) -> str | None:
        """Why `point` is not run (measured, or `projection`: on fake tensors here), or None."""
        checks = (self._style, self._backend, self._unsharded_mixed_precision)
        checks += (self._projectable,) if projection else (self._implementation, self._kernels, self._devices)
        return next((why for why in (check(point) for check in checks) if why), None) or self._oom(point)

    @staticmethod
    def _implementation(point: Point) -> str | None:
        from cpbench.harness.peers.registry import get_peer

        return get_peer(point.implementation).why_unavailable(point.device) if point.cp_size > 1 else None

    @staticmethod
    def _projectable(point: Point) -> str | None:
        if point.level == "attention":
            return "a projection runs the model's training step; level = \"attention\" points are measured only"
        if point.attn_implementation == "flex_attention":
            return "a projection cannot run flex_attention's compiled kernels on fake tensors"
        if point.loss_mode == "liger":
            return ("a projection cannot run Liger-Kernel's Triton kernels on fake tensors; project loss = \"chunked\", "
                    "the same computation in torch (close in memory: both hold one chunk's logits at a time)")
        return None

    @staticmethod
    def _unsharded_mixed_precision(point: Point) -> str | None:
        if point.mixed_precision and point.world_size == 1:
            return ("mixed_precision is FSDP2's policy (fp32 master weights, bf16 compute) and a 1-rank point is not "
                    "sharded: give the suite world_size >= 2 to compare cp 1 under FSDP")
        return None

    @staticmethod
    def _style(point: Point) -> str | None:
        from cpbench.cp import STYLES

        if point.cp_style == NO_STYLE or point.cp_style in STYLES:
            return None
        return (f"cp_style {point.cp_style!r} is not registered in this cpbench (registered: {STYLES.names()}); "
                "the point runs once its implementation lands")

    @staticmethod
    def _backend(point: Point) -> str | None:
        from cpbench.cp import STYLES

        if point.cp_style == NO_STYLE:
            return None
        served = getattr(STYLES.get(point.cp_style), "implementations", None)
        if served is None or point.attn_implementation in served:
            return None
        return f"{point.cp_style} serves {list(served)}, not attn_implementation={point.attn_implementation!r}"

    @staticmethod
    def _kernels(point: Point) -> str | None:
        if point.loss_mode == "liger":
            if point.device != "cuda":
                return "loss = \"liger\" runs Liger-Kernel's Triton kernels, CUDA only; use loss = \"chunked\" on CPU"
            if importlib.util.find_spec("liger_kernel") is None:
                return "loss = \"liger\" needs Liger-Kernel, not installed here: pip install 'cpbench[liger]'"
        return kernel_package_missing(point.attn_implementation)

    @staticmethod
    def _devices(point: Point) -> str | None:
        if point.device != "cuda":
            return None
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have >= point.world_size:
            return None
        return (f"needs {point.world_size} CUDA device(s), one per rank; this machine has {have}: NCCL refuses two "
                "ranks on one GPU and gloo has no all-to-all for CUDA tensors")

    def _oom(self, point: Point) -> str | None:
        at = self.oom_at.get(point.family_key)
        if at is None or point.seq_len <= at:
            return None
        fit = self.fit_at.get(point.family_key)
        longest = f"the longest that fitted is {fit}" if fit else "no length fitted"
        return f"this configuration ran out of memory at seq_len={at}; {longest}"
