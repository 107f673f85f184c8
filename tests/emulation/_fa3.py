"""FlashAttention-3's host code and kernels, emulated: `mha_fwd` and `mha_bwd` of hopper/flash_api.cpp (Dao-AILab/
flash-attention @0251105a, `fa4-v4.0.0.beta27`; flash_api.cpp last changed at 0f82fead), for the GPU whose compute
capability the caller gives. flash_attn_3.py wraps them in flash_attn_interface.py's functions.

What the device code assumes (verified in those files):
- q/k/v/out/dout are read through their own strides (set_params_fprop / set_params_dgrad: row, head and batch strides
  from the tensors) with a contiguous last dim (checked);
- causal and local masks are bottom-right aligned per sequence (hopper/mask.h: causal_row_offset = 1 + seqlen_k -
  n_block * kBlockN - seqlen_q); windows as mha_fwd normalises them: `left >= seqlen_k - 1` and `right >= seqlen_q -
  1` become -1, causal sets right = 0, then set_params_fprop's `left < 0 -> seqlen_k - 1`, `right < 0 -> seqlen_q
  - 1` (max_seqlen_q/k in varlen);
- a row that sees no key: out 0, LSE -inf (hopper/softmax.h: row_sum 0 -> -INFINITY); seqlen_k == 0 with queries:
  out 0, LSE +inf (mha_fwd);
- the backward reads the LSE from its data pointer as contiguous fp32 [B, H, S_q] / [H, total_q]
  (flash_bwd_launch_template.h stride_LSE), checking nothing about it, and takes an LSE of -inf as 0
  (flash_bwd_preprocess_kernel.h: `lse == -INFINITY ? 0.f`); GQA's dk/dv accumulate in fp32 (dk_accum) and are
  rounded once;
- varlen: rows past max_seqlen_q and keys past max_seqlen_k are never visited (the grids come from them); memory no
  sequence covers stays as torch::empty left it.
"""

from __future__ import annotations

import torch

from ._common import INF, Undefined, attention_grads, check, emulated, repeat_kv, scores, softmax, storage_read
from ._flash import shape_msg

API = "hopper/flash_api.cpp"
ARCH = "FlashAttention only supports Ampere GPUs or newer."
FWD_DTYPE = "FlashAttention only supports fp16, bf16, and fp8_e4m3 data type"
BWD_DTYPE = "FlashAttention only support fp16 and bf16 data type"
LAST_DIM = "Input tensor must have contiguous last dimension"
MAX_HEAD = "FlashAttention forward only supports head dimension at most 256"
GQA = "Number of heads in key/value must divide number of heads in query"
DV = ("If V headdim is different from Q/K dim, we only support Q/K headdim in (128, 192] and V headdim in (96, 128], "
      "or (Q/K <= 64 and V <= 512).")
DETERMINISTIC = "Deterministic backward not supported for hdim 256."


def round_up_headdim(d: int) -> int:
    return next((r for r in (64, 96, 128, 192) if d <= r), 256)


def window(seqlen_q: int, seqlen_k: int, causal: bool, left: int, right: int):
    """(is_causal, is_local, left, right) as mha_fwd / mha_bwd and set_params_fprop leave them."""
    if left >= seqlen_k - 1:
        left = -1
    if right >= seqlen_q - 1:
        right = -1
    if seqlen_q == 1 and left == -1 and right == -1:
        causal = False  # "causal=true is the same as causal=false in this case"
    if causal:
        right = 0
    is_causal = left < 0 and right == 0
    is_local = (left >= 0 or right >= 0) and not is_causal
    return is_causal, is_local, seqlen_k - 1 if left < 0 else left, seqlen_q - 1 if right < 0 else right


def visible(lq: int, lk: int, win) -> torch.Tensor:
    """hopper/mask.h Mask::apply (causal_row_offset), per sequence: bottom-right aligned."""
    is_causal, is_local, left, right = win
    i = torch.arange(lq)[:, None] + lk - lq
    j = torch.arange(lk)[None, :]
    if is_causal:
        return j <= i
    if is_local:
        return (j >= i - left) & (j <= i + right)
    return torch.ones(lq, lk, dtype=torch.bool)


def _common(q, k, v, capability, fwd: bool):
    check(capability[0] >= 8, ARCH)
    if fwd:
        emulated(q.dtype != torch.float8_e4m3fn, "fp8")
        check(q.dtype in (torch.float16, torch.bfloat16), FWD_DTYPE)
    else:
        check(q.dtype in (torch.float16, torch.bfloat16), BWD_DTYPE)
    check(k.dtype == q.dtype, "query and key must have the same dtype")
    check(v.dtype == q.dtype, "query and value must have the same dtype")


def _cu(cu, max_len, name):
    check(cu.is_contiguous(), f"{name} must be contiguous")
    check(cu.dtype == torch.int32, f"{name} must have dtype torch.int32")
    check(max_len is not None, f"max_seqlen_{name[-1]} must be provided if {name} is provided")


def _head_dims(d: int, d_v: int, capability, fwd: bool):
    if fwd:
        check(d <= 256, MAX_HEAD)
    if fwd and d_v != d:
        check((128 < d <= 192 and 96 < d_v <= 128) or (d <= 64 and d_v <= 512), DV)
        check(capability[0] == 9, "Only Hopper supports different V headdim")
    check(d % 8 == 0, "head_size should be a multiple of 8")
    check(d_v % 8 == 0, "head_size_v should be a multiple of 8")
    if not fwd:
        check(max(d, d_v) <= 256, MAX_HEAD)


def _sequences(cu_q, cu_k, b, sq, sk, total_q, total_k):
    """(batch index or None, q range, k range) per sequence; a range outside the tensors is a read past them."""
    if cu_q is None:
        return [(i, (0, sq), (0, sk)) for i in range(b)]
    out = []
    for n, (qa, qb, ka, kb) in enumerate(zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:])):
        if not (0 <= qa <= qb <= total_q and 0 <= ka <= kb <= total_k):
            raise Undefined(f"cu_seqlens range q [{qa}, {qb}) / k [{ka}, {kb}) outside {total_q} / {total_k} tokens")
        out.append((None, (qa, qb), (ka, kb)))
    return out


def _rows(x, seq, varlen: bool):
    i, (a, b) = seq[0], seq[1]
    return x[a:b] if varlen else x[i]


def _keys(x, seq, varlen: bool):
    i, _, (a, b) = seq
    return x[a:b] if varlen else x[i]


def mha_fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, left, right, softcap, capability):
    """-> (out, softmax_lse) as mha_fwd returns them (no k_new, paging, rotary or fp8: the ring uses none)."""
    _common(q, k, v, capability, fwd=True)
    for x in (q, k, v):
        check(x.stride(-1) == 1, LAST_DIM)
    varlen = cu_q is not None
    if varlen:
        _cu(cu_q, max_q, "cu_seqlens_q")
    if cu_k is not None:
        _cu(cu_k, max_k, "cu_seqlens_k")
    emulated(varlen == (cu_k is not None), "varlen on one side only")
    b = cu_q.numel() - 1 if varlen else q.size(0)
    sq, total_q = (max_q, q.size(0)) if varlen else (q.size(1), b * q.size(1))
    h, d, d_v, hk = q.size(-2), q.size(-1), v.size(-1), k.size(-2)
    sk = max_k if varlen else k.size(1)
    if not varlen:
        check(b == k.size(0), "batch_size must be equal to batch_size_k")
    check(d <= 256, MAX_HEAD)
    check(h % hk == 0, GQA)
    _head_dims(d, d_v, capability, fwd=True)
    win = window(sq, sk, causal, left, right)
    if varlen:
        check(tuple(q.shape) == (total_q, h, d), shape_msg("q", "total_q, num_heads, head_size"))
        check(tuple(cu_q.shape) == (b + 1,), shape_msg("cu_seqlens_q", "batch_size + 1"))
        check(tuple(k.shape) == (k.size(0), hk, d), shape_msg("k", "total_k, num_heads_k, head_size"))
        check(tuple(v.shape) == (k.size(0), hk, d_v), shape_msg("v", "total_k, num_heads_k, head_size_v"))
        check(tuple(cu_k.shape) == (b + 1,), shape_msg("cu_seqlens_k", "batch_size + 1"))
        out, lse = torch.full((total_q, h, d_v), float("nan"), dtype=q.dtype), torch.full((h, total_q), float("nan"))
    else:
        check(tuple(k.shape) == (b, sk, hk, d), shape_msg("k", "batch_size_k, seqlen_k, num_heads_k, head_size"))
        check(tuple(v.shape) == (b, sk, hk, d_v), shape_msg("v", "batch_size_k, seqlen_k, num_heads_k, head_size_v"))
        out, lse = torch.empty(b, sq, h, d_v, dtype=q.dtype), torch.empty(b, h, sq)
    for seq in _sequences(cu_q, cu_k, b, sq, sk, total_q, k.size(0)):
        qs, ks, vs = _rows(q, seq, varlen), _keys(k, seq, varlen), _keys(v, seq, varlen)
        lq, lk = qs.shape[0], ks.shape[0]
        rows = min(lq, sq)  # m blocks come from max_seqlen_q: rows past it are never computed
        if lk == 0:
            o, l = torch.zeros(lq, h, d_v), torch.full((h, lq), INF)
        else:
            p, l = softmax(scores(qs.transpose(0, 1), ks.transpose(0, 1), scale, softcap)[0], visible(lq, lk, win))
            o = (p @ repeat_kv(vs.transpose(0, 1), h)).transpose(0, 1)  # no key: P 0, out 0, LSE -inf
        if varlen:
            (a, _), lse_rows = seq[1], slice(seq[1][0], seq[1][0] + rows)
            out[a:a + rows], lse[:, lse_rows] = o[:rows], l[:, :rows]
        else:
            out[seq[0]], lse[seq[0]] = o, l
    return out, lse


def mha_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, scale, causal, left, right, softcap,
            deterministic, capability):
    """-> (softmax_d, dq, dk, dv): dq/dk/dv written into the given buffers (or fresh ones)."""
    _common(q, k, v, capability, fwd=False)
    check(out.dtype == q.dtype, "query and out must have the same dtype")
    check(dout.dtype == q.dtype, "query and dout must have the same dtype")
    for x in (q, k, v):
        check(x.stride(-1) == 1, LAST_DIM)
    check(out.stride(-1) == 1, "out tensor must have contiguous last dimension")
    check(dout.stride(-1) == 1, "dout tensor must have contiguous last dimension")
    varlen = cu_q is not None
    if varlen:
        _cu(cu_q, max_q, "cu_seqlens_q")
        _cu(cu_k, max_k, "cu_seqlens_k")
    b = cu_q.numel() - 1 if varlen else q.size(0)
    sq, total_q = (max_q, q.size(0)) if varlen else (q.size(1), b * q.size(1))
    sk = max_k if varlen else k.size(1)
    h, d, d_v, hk = q.size(-2), q.size(-1), v.size(-1), k.size(-2)
    _head_dims(d, d_v, capability, fwd=False)
    check(h % hk == 0, GQA)
    is_causal, is_local, l_, r_ = window(sq, sk, causal, left, right)
    check(not deterministic or round_up_headdim(max(d, d_v)) < 256, DETERMINISTIC)
    qd, kd = ("total_q", "total_k") if varlen else ("batch_size, seqlen_q", "batch_size, seqlen_k")
    q_lead, k_lead = ((total_q,), (k.size(0),)) if varlen else ((b, sq), (b, sk))
    for name, x, lead, dims, last in (("q", q, q_lead, qd, d), ("out", out, q_lead, qd, d_v),
                                      ("dout", dout, q_lead, qd, d_v), ("k", k, k_lead, kd, d),
                                      ("v", v, k_lead, kd, d_v)):
        heads = h if name in ("q", "out", "dout") else hk
        check(tuple(x.shape) == (*lead, heads, last), shape_msg(name, f"{dims}, num_heads, head_size"))
    grads = []
    for name, given, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if given is None:
            grads.append(torch.full_like(like, float("nan")))
            continue
        check(given.dtype == q.dtype, f"{name} must have the same dtype as q")
        check(given.stride(-1) == 1, f"{name} must have contiguous last dimension")
        check(given.shape == like.shape, shape_msg(name, "like " + name[1:]))
        grads.append(given)
    dq, dk, dv = grads
    if lse.dtype != torch.float32:
        raise Undefined(f"softmax_lse is {lse.dtype}; the kernel reads it as float32 without checking")
    lse_read = storage_read(lse, (h, total_q) if varlen else (b, h, sq),
                            (total_q, 1) if varlen else (h * sq, sq, 1), "softmax_lse read contiguous")
    win = (is_causal, is_local, l_, r_)
    for seq in _sequences(cu_q, cu_k, b, sq, sk, total_q, k.size(0)):
        qs, os_, dos = (_rows(x, seq, varlen) for x in (q, out, dout))
        ks, vs = _keys(k, seq, varlen), _keys(v, seq, varlen)
        lq, lk = qs.shape[0], ks.shape[0]
        if varlen and (lk > sk or lq > sq):
            raise Undefined(f"a sequence of {lq} queries / {lk} keys with max_seqlen_q/k {sq}/{sk}: the kernel skips "
                            "the rest")
        l = lse_read[:, seq[1][0]:seq[1][1]] if varlen else lse_read[seq[0]]
        qh, kh, vh, doh = (x.transpose(0, 1) for x in (qs, ks, vs, dos))
        s, raw = scores(qh, kh, scale, softcap)
        s = s.masked_fill(~visible(lq, lk, win), -INF)
        p = torch.exp(s - l.masked_fill(torch.isneginf(l), 0)[..., None])
        delta = (dos.float() * os_.float()).sum(-1).T
        dtanh = 1 - torch.tanh(raw / softcap) ** 2 if softcap > 0 else None
        gq, gk, gv, _ = attention_grads(doh, qh, kh, vh, p, delta, scale, dtanh)
        g = h // hk
        gk, gv = (x.unflatten(0, (hk, g)).sum(1).transpose(0, 1) for x in (gk, gv))  # fp32 sums, rounded once
        if varlen:
            (qa, qb), (ka, kb) = seq[1], seq[2]
            dq[qa:qb], dk[ka:kb], dv[ka:kb] = gq.transpose(0, 1), gk, gv
        else:
            dq[seq[0]], dk[seq[0]], dv[seq[0]] = gq.transpose(0, 1), gk, gv
    softmax_d = torch.full((h, total_q) if varlen else (b, h, sq), float("nan"))  # not read by the ring
    return softmax_d, dq, dk, dv
