"""Block kernels for ring attention: one tile's output and log-sum-exp, and its recompute-based backward.

A kernel sees one tile: queries q [B, H, q, D], keys k [B, Hkv, k, D], values v [B, Hkv, k, Dv] (GQA: query head
h uses kv head h // (H / Hkv), as transformers' `repeat_kv`; Dv may differ from D, as in multi-head latent attention),
and the tile's `TileMask` (never SKIP). `forward` returns the tile's output [B, H, q, Dv] and LSE in the accumulation
dtype (fp32, or fp64 for fp64 inputs); a row that sees no key gets
output 0 and LSE -inf, so merging it changes nothing. `backward` is flash-attention style: given the *final*
(merged) output and LSE of the rows, the tile's probabilities exp(s - lse) are its exact share of the global
softmax, so the tile's dq, dk, dv are its exact share of the gradients and no scores are kept from forward.

Kernels:
- `CpuSdpaKernel` — torch's CPU flash kernel (`_scaled_dot_product_flash_attention_for_cpu` and its backward),
  which returns the LSE and never holds a whole tile's scores: memory O(tile rows), like sdpa at cp=1. It takes one
  head dim for q, k and v: a tile whose value head dim differs is zero-padded to one (see `_one_head_dim`).
- `TorchKernel` — matmul + logsumexp on any device, also serving logit soft-capping; it holds the tile's scores
  (as eager attention holds the whole matrix).
- `FlashAttnKernel` (cp/ring/flash.py) — flash-attn's kernels, for flash_attention_2 models on CUDA;
  `FlashAttn3Kernel` (fa3.py) and `FlashAttn4Kernel` (fa4.py) — FlashAttention-3 and -4, for flash_attention_3/4.
- `CudaSdpaKernel` (cp/ring/cuda.py) — PyTorch's fused cuDNN / flash / memory-efficient kernels, for sdpa models on
  CUDA, chosen for the target GPU as SDPA chooses (cudnn.py, target.py); select.py has the whole table.
"""

from __future__ import annotations

import torch

from cpbench.cp.ring.masks import CAUSAL, DENSE, TileMask

RING_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Partial results merge in fp32 (fp64 inputs keep fp64, so fp64 tests can check to fp64 precision)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def safe_lse(lse: torch.Tensor) -> torch.Tensor:
    # A row that sees no key at all has LSE -inf; its masked scores are -inf too, so any finite value keeps
    # exp(s - lse) at 0 instead of NaN.
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def _mask_heads(allowed: torch.Tensor, h0: int, h1: int) -> torch.Tensor:
    return allowed if allowed.shape[1] == 1 else allowed[:, h0:h1]


class TorchKernel:
    def __init__(self, softcap: float | None = None):
        self.softcap = softcap

    def _scores(self, q, k, tile: TileMask, scale: float):
        """Scores [B, Hkv, G, q, k] (masked to -inf) and, with soft-capping, tanh of the raw scores."""
        b, h, sq, d = q.shape
        hkv = k.shape[1]
        acc = acc_dtype(q.dtype)
        qg = q.to(acc).reshape(b, hkv, h // hkv, sq, d)
        s = torch.matmul(qg, k.to(acc)[:, :, None].transpose(-1, -2)) * scale
        t = None
        if self.softcap:
            t = torch.tanh(s / self.softcap)
            s = t * self.softcap
        if tile.uniform is not None:
            # Eager's fully blocked rows: the scores vanish under the mask's minimum, their gradient does not
            # (see cp/ring/masks.py); a zero score forward with the usual backward is exactly that.
            s = s.masked_fill(_group_mask(tile.uniform[..., None], hkv), 0.0)
        if tile.kind == CAUSAL:
            s = s.masked_fill(torch.ones(sq, k.shape[2], dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        elif tile.kind == DENSE:
            s = s.masked_fill(~_group_mask(tile.allowed, hkv), float("-inf"))
        return qg, s, t

    def forward(self, q, k, v, tile: TileMask, scale: float):
        b, h, sq, _ = q.shape
        _, s, _ = self._scores(q, k, tile, scale)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - safe_lse(lse)[..., None])
        out = torch.matmul(p, v.to(s.dtype)[:, :, None])
        return out.reshape(b, h, sq, v.shape[-1]), lse.reshape(b, h, sq)

    def backward(self, dout, q, k, v, out, lse, tile: TileMask, scale: float, dq, dk, dv) -> None:
        b, h, sq, d = q.shape
        hkv, d_v = k.shape[1], v.shape[-1]
        qg, s, t = self._scores(q, k, tile, scale)
        acc = s.dtype
        p = torch.exp(s - safe_lse(lse.to(acc)).reshape(b, hkv, h // hkv, sq, 1))
        do = dout.to(acc).reshape(b, hkv, h // hkv, sq, d_v)
        delta = (do * out.to(acc).reshape(b, hkv, h // hkv, sq, d_v)).sum(-1, keepdim=True)
        dv += torch.matmul(p.transpose(-1, -2), do).sum(2)
        ds = p * (torch.matmul(do, v.to(acc)[:, :, None].transpose(-1, -2)) - delta)
        if t is not None:
            ds = ds * (1 - t * t)  # d(c * tanh(x / c)) / dx
        dq += (torch.matmul(ds, k.to(acc)[:, :, None]) * scale).reshape(b, h, sq, d)
        dk += torch.matmul(ds.transpose(-1, -2), qg).sum(2) * scale


def _group_mask(allowed: torch.Tensor, hkv: int) -> torch.Tensor:
    """[B|1, H|1, q, k] -> broadcastable against scores [B, Hkv, G, q, k]."""
    if allowed.shape[1] == 1:
        return allowed[:, :, None]
    return allowed.reshape(allowed.shape[0], hkv, -1, *allowed.shape[2:])


def _one_head_dim(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors zero-padded along the head dim to the largest one among them (unchanged where all agree).

    torch's CPU flash kernel requires one head dim for q, k and v (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp,
    cpu_flash_attention: "Q/K/V should have the same head size"), which multi-head latent attention breaks (q/k 192,
    v 128). Zero columns change no score (q.k gains 0; the scale is always passed explicitly), and a zero value
    column gives a zero output column and needs a zero out/dout column in backward, which leaves delta = rowsum(dO * O)
    as it was: every gradient is exact once the padding is cut off. The padding is a copy of the tile's v (and of its
    out/dout rows in backward), O(tile) like the kernel's own gradients, where the matmul kernel would hold the tile's
    fp32 scores (as sdpa itself does on CPU: sdp_utils_cpp.cpp check_head_dim_size_cpp sends unequal head dims to the
    math path); transformers pads v the same way for flash attention (integrations/flash_attention.py)."""
    d = max(x.shape[-1] for x in tensors)
    return tuple(x if x.shape[-1] == d else torch.nn.functional.pad(x, (0, d - x.shape[-1])) for x in tensors)


class CpuSdpaKernel:
    """torch's CPU flash-attention kernel: forward one call per kv head group, backward one per query head.

    The kernel broadcasts a single kv head over the query heads given with it (and sums dk/dv over them in
    backward), so GQA needs no copy of k/v at the query-head count.
    """

    _fwd = staticmethod(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
    _bwd = staticmethod(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)

    @staticmethod
    def _additive(tile: TileMask, dtype: torch.dtype):
        if tile.kind != DENSE:
            return None
        # This kernel takes an additive mask of the query's dtype, not a bool one.
        zero = torch.zeros((), dtype=dtype, device=tile.allowed.device)
        return zero.masked_fill(~tile.allowed, float("-inf"))

    def forward(self, q, k, v, tile: TileMask, scale: float):
        if tile.uniform is not None:
            return TorchKernel().forward(q, k, v, tile, scale)
        b, h, sq, _ = q.shape
        hkv, d_v = k.shape[1], v.shape[-1]
        g = h // hkv
        bias = self._additive(tile, q.dtype)
        q, k, v = _one_head_dim(q, k, v)
        out = torch.empty(b, h, sq, d_v, dtype=acc_dtype(q.dtype), device=q.device)
        lse = torch.empty(b, h, sq, dtype=out.dtype, device=q.device)
        for j in range(hkv):
            heads = slice(j * g, (j + 1) * g)
            mask = None if bias is None else _mask_heads(bias, heads.start, heads.stop)
            o, l = self._fwd(
                q[:, heads], k[:, j : j + 1], v[:, j : j + 1], 0.0, tile.kind == CAUSAL, attn_mask=mask, scale=scale
            )
            out[:, heads] = o[..., :d_v]
            lse[:, heads] = l
        if tile.kind == DENSE:
            # The kernel reports LSE 0 for a row that sees no key; the merge needs -inf there.
            lse.masked_fill_(~tile.allowed.any(-1), float("-inf"))
        return out, lse

    def backward(self, dout, q, k, v, out, lse, tile: TileMask, scale: float, dq, dk, dv) -> None:
        if tile.uniform is not None:
            return TorchKernel().backward(dout, q, k, v, out, lse, tile, scale, dq, dk, dv)
        g = q.shape[1] // k.shape[1]
        d, d_v = q.shape[-1], v.shape[-1]
        bias = self._additive(tile, q.dtype)
        lse = safe_lse(lse).to(acc_dtype(q.dtype))
        dout, q, k, v, out = _one_head_dim(dout, q, k, v, out)
        for head in range(q.shape[1]):
            # One query head at a time: the kernel returns fresh gradient tensors, and at this size they stay a
            # 1/H fraction of the layer's activations instead of a second dq.
            hq, hkv = slice(head, head + 1), slice(head // g, head // g + 1)
            mask = None if bias is None else _mask_heads(bias, head, head + 1)
            g_dq, g_dk, g_dv = self._bwd(
                dout[:, hq], q[:, hq], k[:, hkv], v[:, hkv], out[:, hq], lse[:, hq],
                0.0, tile.kind == CAUSAL, attn_mask=mask, scale=scale,
            )
            dq[:, hq] += g_dq[..., :d]
            dk[:, hkv] += g_dk[..., :d]
            dv[:, hkv] += g_dv[..., :d_v]
            del g_dq, g_dk, g_dv
