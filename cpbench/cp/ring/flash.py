"""flash-attn's kernels as a ring block kernel, for models loaded with attn_implementation="flash_attention_2".

flash-attn computes a FULL tile (no mask) or a CAUSAL tile (the diagonal, top-left = bottom-right aligned since the
tile is square) and returns the LSE; its backward takes the final output and LSE, as the ring needs. Masked tiles come
as SEGMENTS where they can (packed documents, padded keys, a sliding window: cp/ring/segments.py) and run through
flash-attn's varlen functions with cu_seqlens and window_size. The rest (a padded run inside a document, a window
cutting a packed tile) go to PyTorch's fused kernels for the same target GPU with a bias (`ring_cuda.CudaSdpaKernel`:
cuDNN's where the target's SDPA prefers it, else the memory-efficient one), or to the exact `TorchKernel` with logit
soft-capping, as do head dims above flash-attn's 256 and a value head dim other than the query's (see `_head_dims`).
Uses flash-attn's private `_flash_attn_forward` / `_flash_attn_backward` and their varlen forms (the flash-attn >= 2.7
signatures, with separate window_size_left/right); the import is guarded. CPU CI runs this glue against a strict
emulation of those functions (tests/unit/test_ring_flash.py, tests/unit/test_ring_segments.py); no CI job runs the
real kernels yet.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from cpbench.cp.ring.cuda import FLASH_MIN_CAPABILITY, CudaSdpaKernel
from cpbench.cp.ring.kernels import TorchKernel, acc_dtype
from cpbench.cp.ring.masks import CAUSAL, DENSE, SEGMENTS, TileMask
from cpbench.cp.ring.segments import VarlenOps, varlen_backward, varlen_forward
from cpbench.cp.ring.target import KernelTarget, resolve_target

FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


def _parameters(fn) -> set[str]:
    # flash-attn >= 2.7 registers its private functions as torch custom ops: a CustomOpDef's own signature is
    # (*args, **kwargs), and the function it wraps (`_init_fn`) keeps the real one.
    return set(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)


def _flash_ops():
    """flash-attn's (forward, backward, varlen forward, varlen backward), or None where it is not installed."""
    try:
        from flash_attn.flash_attn_interface import (
            _flash_attn_backward,
            _flash_attn_forward,
            _flash_attn_varlen_backward,
            _flash_attn_varlen_forward,
        )
    except ImportError:
        return None
    if "window_size_left" not in _parameters(_flash_attn_forward):
        raise ValueError(
            "cp_ring with flash_attention_2 needs flash-attn >= 2.7 (separate window_size_left/right arguments); "
            "upgrade flash-attn or load the model with attn_implementation='sdpa'."
        )
    return _flash_attn_forward, _flash_attn_backward, _flash_attn_varlen_forward, _flash_attn_varlen_backward


def flash_kernel_or_none(query: torch.Tensor, softcap: float | None, target: KernelTarget | None = None):
    """The flash-attn kernel when it can run on the target (default: the query's device; CUDA, Ampere or newer,
    fp16/bf16, flash-attn installed), else None. The tiles it cannot take go to PyTorch's fused kernels for the same
    target (cuDNN's on Hopper)."""
    target = target or resolve_target(None, query)
    if target.device != "cuda" or query.dtype not in FLASH_DTYPES:
        return None
    if target.capability < FLASH_MIN_CAPABILITY:  # flash-attn 2 runs on Ampere and newer only
        return None
    ops = _flash_ops()
    if ops is None:
        return None
    return FlashAttnKernel(*ops, softcap=softcap, masked=None if softcap else CudaSdpaKernel(target=target))


def _bshd(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, H, S, D] -> flash-attn's [B, S, H, D] in the query's dtype, the head dim zero-padded to a multiple of 8:
    its kernels take no other, and flash-attn's own autograd functions pad the same way (zeros change no score)."""
    x = x.transpose(1, 2).to(dtype)
    pad = -x.shape[-1] % 8
    return F.pad(x, (0, pad)) if pad else x.contiguous()


def _head_dims(q: torch.Tensor, v: torch.Tensor | None) -> bool:
    """Whether flash-attn takes these head dims: one for q, k and v (flash_api.cpp mha_fwd:417-418 and
    mha_varlen_fwd: CHECK_SHAPE(v, batch_size, seqlen_k, num_heads_k, head_size); emulated in tests/emulation/_flash.py
    `mha_fwd`), at most 256. A layer whose value head dim differs (multi-head latent attention) runs every tile on the
    `masked` kernel, PyTorch's memory-efficient one, which takes it (cp/ring/cuda.py)."""
    return (v is None or v.shape[-1] == q.shape[-1]) and q.shape[-1] <= FLASH_MAX_HEAD_DIM


class FlashAttnKernel:
    def __init__(self, fwd, bwd, varlen_fwd=None, varlen_bwd=None, *, softcap: float | None = None, masked=None):
        """`masked`: the kernel for the tiles flash-attn cannot take (default: the exact `TorchKernel`). Without
        the varlen pair, masked tiles are never asked for as SEGMENTS."""
        self._fwd, self._bwd = fwd, bwd
        self.softcap = softcap
        self._fallback = masked or TorchKernel(softcap)
        self._varlen = None
        if varlen_fwd is not None and varlen_bwd is not None:
            self._varlen_fwd, self._varlen_bwd = varlen_fwd, varlen_bwd
            self._varlen = VarlenOps(self._call_varlen_forward, self._call_varlen_backward)

    def head_dims_ok(self, q: torch.Tensor, v: torch.Tensor | None) -> bool:
        """Whether this kernel takes a layer of these head dims (FlashAttention-3 and -4 override it)."""
        return _head_dims(q, v)

    def takes_segments(self, q: torch.Tensor, v: torch.Tensor | None = None) -> bool:
        return self._varlen is not None and self.head_dims_ok(q, v)

    def _serves(self, q: torch.Tensor, v: torch.Tensor, tile: TileMask) -> bool:
        return tile.kind != DENSE and self.head_dims_ok(q, v)

    def _call_varlen_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, left, right, scale):
        out, lse, *_ = self._varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, scale, causal, left, right,
                                        float(self.softcap or 0.0), None, False)
        return out, lse

    def _call_varlen_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, left, right, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._varlen_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, 0.0, scale, causal, left,
                         right, float(self.softcap or 0.0), None, False, None)
        return dq, dk, dv

    def _dense_forward(self, q, k, v, causal: bool, scale: float):
        """One dense call on [B, S, H, D] tensors: (out, LSE fp32 [B, H, S])."""
        # softmax_scale, causal, window_size_left/right, softcap: the custom op's schema wants plain floats.
        out, lse, _, _ = self._fwd(q, k, v, 0.0, float(scale), causal, -1, -1, float(self.softcap or 0.0), None, False)
        return out, lse

    def _dense_backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        """One dense backward call: (dq, dk, dv) [B, S, H(kv), D]; `lse` fp32 [B, H, S] contiguous."""
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # dk, dv: kv heads (GQA)
        self._bwd(dout, q, k, v, out, lse, dq, dk, dv, 0.0, float(scale), causal, -1, -1, float(self.softcap or 0.0),
                  None, False, None)
        return dq, dk, dv

    def forward(self, q, k, v, tile: TileMask, scale: float):
        if tile.kind == SEGMENTS:
            return varlen_forward(self._varlen, q, k, v, tile.segments, scale, acc_dtype(q.dtype))
        if not self._serves(q, v, tile):
            return self._fallback.forward(q, k, v, tile, scale)
        q_, k_, v_ = (_bshd(x, q.dtype) for x in (q, k, v))
        out, lse = self._dense_forward(q_, k_, v_, tile.kind == CAUSAL, scale)
        acc = acc_dtype(q.dtype)
        return out[..., : v.shape[-1]].transpose(1, 2).to(acc), lse.to(acc)  # flash kernels' LSE is always fp32

    def backward(self, dout, q, k, v, out, lse, tile: TileMask, scale: float, dq_acc, dk_acc, dv_acc) -> None:
        if tile.kind == SEGMENTS:
            return varlen_backward(self._varlen, dout, q, k, v, out, lse, tile.segments, scale, dq_acc, dk_acc, dv_acc)
        if not self._serves(q, v, tile):
            return self._fallback.backward(dout, q, k, v, out, lse, tile, scale, dq_acc, dk_acc, dv_acc)
        # flash kernels' backward wants out and dout in the query's dtype and the LSE as fp32 [B, H, S], contiguous.
        q_, k_, v_, o_, do_ = (_bshd(x, q.dtype) for x in (q, k, v, out, dout))
        dq, dk, dv = self._dense_backward(do_, q_, k_, v_, o_, lse.float().contiguous(), tile.kind == CAUSAL, scale)
        d, d_v = q.shape[-1], v.shape[-1]
        dq_acc += dq[..., :d].transpose(1, 2)
        dk_acc += dk[..., :d].transpose(1, 2)
        dv_acc += dv[..., :d_v].transpose(1, 2)
