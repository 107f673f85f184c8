"""FlashAttention-3 as the ring's tile kernel, for models loaded with attn_implementation="flash_attention_3".

FlashAttention-3 (the `flash-attn-3` package built from FlashAttention's hopper/ folder; module
`flash_attn_interface`, ops `torch.ops.flash_attn_3`) is what a flash_attention_3 model's own attention runs (cp 1,
Ulysses): on an H100 0.623 / 0.567 of the bf16 peak forward / backward against cuDNN's 0.545 / 0.522 and
FlashAttention-2's 0.339 / 0.326 (causal, head dim 128, 16k: the FlashAttention-3 paper, arXiv 2407.08608, Fig. 5, as
cpbench/harness/project/gpus.toml holds them).
The ring calls its private `_flash_attn_forward` / `_flash_attn_backward` (torch custom ops with fake kernels, so a
projection can trace them), dense and varlen, by keyword: FULL and CAUSAL tiles dense, SEGMENTS tiles (packed
documents, padded keys, windows) varlen with cu_seqlens and windows, DENSE tiles on PyTorch's fused kernels for the
same GPU (`CudaSdpaKernel`: cuDNN's on Hopper), or the exact `TorchKernel` with logit soft-capping, which
FlashAttention-3 itself takes.

The contract the calls keep, from hopper/flash_api.cpp (`mha_fwd`, `mha_bwd`) and hopper/flash_attn_interface.py
(tests/emulation/flash_attn_3.py enforces each, naming the line it comes from):
- Ampere or newer (mha_fwd: "FlashAttention only supports Ampere GPUs or newer."); fp16/bf16 (the backward takes no
  fp8); q/k/v with a contiguous last dim (other strides are read as given); k/v [B, S_k, H_k, D] with H % H_k == 0;
- head dims multiples of 8 (the ring pads) up to 256, and a value head dim other than the query's only on Hopper
  with (128 < d <= 192, 96 < d_v <= 128) or (d <= 64, d_v <= 512); the backward also needs max(d, d_v) <= 256
  (`head_dims_ok`);
- causal and windows are aligned bottom-right per sequence (hopper/mask.h), which is top-left on the ring's square
  diagonal tiles; a window's right side of -1 beside a left one becomes max_seqlen_q - 1 (set_params_fprop after
  mha_fwd's `window_size_right >= seqlen_q - 1` rule), which never hides a key of a segment, so
  cp/ring/segments.py's windows (written for flash-attn 2's stricter reading) hold as they are;
- the LSE is fp32 [B, H, S_q] dense and [H, total_q] varlen; the backward reads it through those strides from its data
  pointer (flash_bwd_launch_template.h: nothing checks it), so it is handed a contiguous one; an LSE of -inf is read
  as 0 (flash_bwd_preprocess_kernel.h), and the ring hands it none;
- dq/dk/dv are written in place at q's and k/v's shapes; GQA's dk/dv are summed in fp32 (dk_accum) before rounding.
"""

from __future__ import annotations

import inspect

import torch

from cpbench.cp.ring.cuda import FLASH_MIN_CAPABILITY, CudaSdpaKernel
from cpbench.cp.ring.flash import FLASH_DTYPES, FlashAttnKernel
from cpbench.cp.ring.kernels import safe_lse
from cpbench.cp.ring.target import KernelTarget

MAX_HEAD_DIM = 256  # flash_api.cpp get_max_headdim() of a full build


def _parameters(fn) -> set[str]:
    return set(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)  # a custom op keeps the real signature


def _fa3_ops():
    """FlashAttention-3's (`_flash_attn_forward`, `_flash_attn_backward`), or None where it is not installed."""
    try:
        from flash_attn_interface import _flash_attn_backward, _flash_attn_forward
    except (ImportError, OSError):  # not installed, or its CUDA extension cannot load here
        return None
    missing = {"cu_seqlens_q", "window_size_left", "softcap"} - _parameters(_flash_attn_forward)
    if missing or "softmax_lse" not in _parameters(_flash_attn_backward):
        raise ValueError(
            f"cp_ring with flash_attention_3 needs flash_attn_interface's `_flash_attn_forward` with keyword "
            f"arguments {sorted(missing) or ['cu_seqlens_q', 'window_size_left', 'softcap']} and "
            "`_flash_attn_backward(dout, q, k, v, out, softmax_lse, ...)` (FlashAttention-3 of 2025 or newer); "
            "rebuild flash-attn-3 from a newer FlashAttention, or load the model with attn_implementation='sdpa'."
        )
    return _flash_attn_forward, _flash_attn_backward


def fa3_kernel_or_none(query: torch.Tensor, softcap: float | None, target: KernelTarget):
    """The FlashAttention-3 kernel where it runs on the target (CUDA, Ampere or newer, fp16/bf16, installed)."""
    if target.device != "cuda" or query.dtype not in FLASH_DTYPES or target.capability < FLASH_MIN_CAPABILITY:
        return None
    ops = _fa3_ops()
    if ops is None:
        return None
    masked = None if softcap else CudaSdpaKernel(target=target)
    return FlashAttn3Kernel(*ops, softcap=softcap, masked=masked, capability=target.capability)


class FlashAttn3Kernel(FlashAttnKernel):
    name = "fa3"

    def __init__(self, fwd, bwd, *, softcap: float | None = None, masked=None, capability=(9, 0)):
        # The dense and the varlen forms are one function each (cu_seqlens given or not).
        super().__init__(fwd, bwd, fwd, bwd, softcap=softcap, masked=masked)
        self.capability = tuple(capability)
        self._causal = "is_causal" if "is_causal" in _parameters(bwd) else "causal"  # the backward's spelling

    def head_dims_ok(self, q: torch.Tensor, v: torch.Tensor | None) -> bool:
        d = q.shape[-1] + (-q.shape[-1] % 8)
        d_v = d if v is None else v.shape[-1] + (-v.shape[-1] % 8)
        if max(d, d_v) > MAX_HEAD_DIM:
            return False
        if d_v == d:
            return True
        return self.capability[0] == 9 and ((128 < d <= 192 and 96 < d_v <= 128) or d <= 64)

    def _kw(self, scale: float, causal: bool, left: int = -1, right: int = -1) -> dict:
        return {"softmax_scale": float(scale), "window_size_left": left, "window_size_right": right,
                "softcap": float(self.softcap or 0.0)}

    def _dense_forward(self, q, k, v, causal: bool, scale: float):
        out, lse, *_ = self._fwd(q, k, v, causal=causal, **self._kw(scale, causal))
        return out, lse

    def _dense_backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._bwd(dout, q, k, v, out, safe_lse(lse), dq=dq, dk=dk, dv=dv, **{self._causal: causal},
                  **self._kw(scale, causal))
        return dq, dk, dv

    def _call_varlen_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, left, right, scale):
        out, lse, *_ = self._fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                 max_seqlen_k=max_k, causal=causal, **self._kw(scale, causal, left, right))
        return out, lse

    def _call_varlen_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, left, right, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._bwd(dout, q, k, v, out, safe_lse(lse).contiguous(), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                  max_seqlen_q=max_q, max_seqlen_k=max_k, dq=dq, dk=dk, dv=dv, **{self._causal: causal},
                  **self._kw(scale, causal, left, right))
        return dq, dk, dv
