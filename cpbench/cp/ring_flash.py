"""flash-attn's kernels as a ring block kernel, for models loaded with attn_implementation="flash_attention_2".

flash-attn computes a FULL tile (no mask) or a CAUSAL tile (the diagonal, top-left = bottom-right aligned since
the tile is square) and returns the LSE; its backward takes the final output and LSE, as the ring needs. Tiles
with an explicit mask (padding, packed documents, a partial sliding window) have no flash-attn form without
unpadding, so they go to the exact `TorchKernel`. Uses flash-attn's private `_flash_attn_forward` /
`_flash_attn_backward` (flash-attn >= 2.6 signatures); the import is guarded, and CPU CI cannot exercise this
path (tests skip it when flash-attn is absent).
"""

from __future__ import annotations

import inspect

import torch

from .ring_kernels import TorchKernel, acc_dtype
from .ring_masks import CAUSAL, DENSE, TileMask

FLASH_DTYPES = (torch.float16, torch.bfloat16)


def _flash_ops():
    try:
        from flash_attn.flash_attn_interface import _flash_attn_backward, _flash_attn_forward
    except ImportError:
        return None
    if "window_size_left" not in inspect.signature(_flash_attn_forward).parameters:
        raise ValueError(
            "cp_ring with flash_attention_2 needs flash-attn >= 2.6 (separate window_size_left/right arguments); "
            "upgrade flash-attn or load the model with attn_implementation='sdpa'."
        )
    return _flash_attn_forward, _flash_attn_backward


def flash_kernel_or_none(query: torch.Tensor, softcap: float | None):
    """The flash-attn kernel when it can run here (CUDA, fp16/bf16, flash-attn installed), else None."""
    if query.device.type != "cuda" or query.dtype not in FLASH_DTYPES:
        return None
    ops = _flash_ops()
    return None if ops is None else FlashAttnKernel(*ops, softcap=softcap)


class FlashAttnKernel:
    def __init__(self, fwd, bwd, softcap: float | None = None):
        self._fwd, self._bwd = fwd, bwd
        self.softcap = softcap
        self._fallback = TorchKernel(softcap)

    def forward(self, q, k, v, tile: TileMask, scale: float):
        if tile.kind == DENSE:
            return self._fallback.forward(q, k, v, tile, scale)
        q_, k_, v_ = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # flash-attn wants [B, S, H, D]
        out, lse, _, _ = self._fwd(
            q_, k_, v_, 0.0, scale, tile.kind == CAUSAL, -1, -1, self.softcap or 0.0, None, False
        )
        return out.transpose(1, 2).to(acc_dtype(q.dtype)), lse

    def backward(self, dout, q, k, v, out, lse, tile: TileMask, scale: float, dq_acc, dk_acc, dv_acc) -> None:
        if tile.kind == DENSE:
            return self._fallback.backward(dout, q, k, v, out, lse, tile, scale, dq_acc, dk_acc, dv_acc)
        q_, k_, v_, o_, do_ = (x.transpose(1, 2).contiguous() for x in (q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(q_), torch.empty_like(k_), torch.empty_like(v_)
        self._bwd(
            do_, q_, k_, v_, o_, lse.float().contiguous(), dq, dk, dv, 0.0, scale, tile.kind == CAUSAL, -1, -1,
            self.softcap or 0.0, None, False, None,
        )
        dq_acc += dq.transpose(1, 2)
        dk_acc += dk.transpose(1, 2)
        dv_acc += dv.transpose(1, 2)
