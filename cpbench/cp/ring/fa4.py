"""FlashAttention-4 as the ring's tile kernel, for models loaded with attn_implementation="flash_attention_4".

FlashAttention-4 (PyPI `flash-attn-4`, module `flash_attn.cute`: CuTe-DSL kernels compiled on first use) runs on
Hopper and Blackwell; a flash_attention_4 model's own attention runs it (cp 1, Ulysses). The ring calls its
`flash_attn.cute.interface._flash_attn_fwd` / `_flash_attn_bwd`, dense and varlen, by keyword: FULL and CAUSAL tiles
dense, SEGMENTS tiles varlen with cu_seqlens and windows, DENSE tiles on PyTorch's fused kernels for the same GPU
(`CudaSdpaKernel`: cuDNN's there), or the exact `TorchKernel` with logit soft-capping, which FlashAttention-4 takes.

The contract the calls keep, from flash_attn/cute/interface.py (tests/emulation/flash_attn_4.py enforces each):
- the backward runs on compute capability 9.x-12.x only (`_flash_attn_bwd`: "Unsupported compute capability.
  Supported: 9.x, 10.x, 11.x, 12.x"), so the ring takes it from Hopper on; fp16/bf16 (the backward's "inputs must be
  float16 or bfloat16"); k/v [B, S_k, H_k, D] with H % H_k == 0; strides are never refused but copied
  (cute_dsl_utils.maybe_contiguous: 16-byte aligned pointer and strides, contiguous last dim);
- head dims (`_validate_head_dims`): on sm90 8..256 and multiples of 8 for q/k and v alike; on sm100/sm110 both
  <= 128, or (192, 128), or (256, 256) (whose dedicated kernel takes no soft-capping); sm120 validates nothing, and
  the ring takes only equal head dims <= 128 there (`head_dims_ok`);
- causal and windows bottom-right per sequence (flash_attn/cute/mask.py), top-left on the ring's square diagonal
  tiles; windows are `None` for unbounded, and a left window beside `None` on the right is `local` with no right
  bound (`_resolve_causal_local_window`), so the ring's -1 becomes None;
- the LSE (fp32 [B, H, S_q], varlen [H, total_q]) is allocated only when some input requires grad or
  `return_lse=True`: the ring asks for it; the backward checks its shape and dtype ("lse must have shape ...",
  "lse must be float32") and takes the final output and LSE; it returns (dq, dk, dv) (GQA's dk/dv summed in fp32).
"""

from __future__ import annotations

import torch

from cpbench.cp.ring.cuda import CudaSdpaKernel
from cpbench.cp.ring.flash import FLASH_DTYPES, FlashAttnKernel
from cpbench.cp.ring.kernels import safe_lse
from cpbench.cp.ring.target import KernelTarget

MIN_CAPABILITY = (9, 0)  # the backward's supported architectures start at 9.x


def _fa4_ops():
    """FlashAttention-4's (`_flash_attn_fwd`, `_flash_attn_bwd`), or None where it is not installed."""
    try:
        from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd
    except (ImportError, OSError):  # not installed (flash-attn 2 alone may ship a `cute` folder that cannot load)
        return None
    return _flash_attn_fwd, _flash_attn_bwd


def fa4_kernel_or_none(query: torch.Tensor, softcap: float | None, target: KernelTarget):
    """The FlashAttention-4 kernel where it runs on the target (CUDA, Hopper or newer, fp16/bf16, installed)."""
    if target.device != "cuda" or query.dtype not in FLASH_DTYPES or target.capability < MIN_CAPABILITY:
        return None
    ops = _fa4_ops()
    if ops is None:
        return None
    masked = None if softcap else CudaSdpaKernel(target=target)
    return FlashAttn4Kernel(*ops, softcap=softcap, masked=masked, capability=target.capability)


def _window(w: int):
    return None if w < 0 else w


class FlashAttn4Kernel(FlashAttnKernel):
    name = "fa4"

    def __init__(self, fwd, bwd, *, softcap: float | None = None, masked=None, capability=(9, 0)):
        super().__init__(fwd, bwd, fwd, bwd, softcap=softcap, masked=masked)
        self.capability = tuple(capability)

    def head_dims_ok(self, q: torch.Tensor, v: torch.Tensor | None) -> bool:
        d = q.shape[-1] + (-q.shape[-1] % 8)
        d_v = d if v is None else v.shape[-1] + (-v.shape[-1] % 8)
        major = self.capability[0]
        if major == 9:
            return d <= 256 and d_v <= 256
        if major in (10, 11):
            if (d, d_v) == (256, 256):
                return not self.softcap  # the dedicated hd256 kernel takes no soft-capping
            return (d <= 128 and d_v <= 128) or (d, d_v) == (192, 128)
        return d == d_v and d <= 128

    def _kw(self, scale: float, causal: bool, left: int = -1, right: int = -1) -> dict:
        return {"softmax_scale": float(scale), "causal": causal, "softcap": float(self.softcap or 0.0),
                "window_size_left": _window(left), "window_size_right": _window(right)}

    def _dense_forward(self, q, k, v, causal: bool, scale: float):
        out, lse, *_ = self._fwd(q, k, v, return_lse=True, **self._kw(scale, causal))
        return out, lse

    def _dense_backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        return self._bwd(q, k, v, out, dout, safe_lse(lse), **self._kw(scale, causal))[:3]

    def _call_varlen_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, left, right, scale):
        out, lse, *_ = self._fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                 max_seqlen_k=max_k, return_lse=True, **self._kw(scale, causal, left, right))
        return out, lse

    def _call_varlen_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, left, right, scale):
        return self._bwd(q, k, v, out, dout, safe_lse(lse).contiguous(), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                         max_seqlen_q=max_q, max_seqlen_k=max_k, **self._kw(scale, causal, left, right))[:3]
