"""FlashAttention-2's host code (mha_fwd, mha_varlen_fwd, mha_bwd, mha_varlen_bwd) and kernels, once for the two
builds cpbench calls: aten's vendored copy (aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp, pytorch
commit 03b7c19d) behind `_flash_attention_forward/_backward`, and flash-attn 2.8.3 (csrc/flash_attn/flash_api.cpp at
v2.8.3 = 060c9188; line numbers below are that file's) behind flash_attn_interface.py. `aten=True` picks aten's
messages and its differences. Dense tensors are q [B, Sq, H, D], k/v [B, Sk, Hk, D]; varlen ones [T, H, D].

The kernels' semantics, from their source:
- windows (mha_fwd :399-404, mha_varlen_fwd :585-609, set_params_fprop :139-144): a window >= seqlen_k (varlen:
  max_seqlen_k) becomes -1; causal sets right = 0; then left < 0 <= right makes left = seqlen_k and left >= 0 > right
  makes right = seqlen_k (NOT unbounded: a row i sees j <= i + lk - lq + seqlen_k); is_causal = left < 0 && right == 0.
  Masks are bottom-right aligned per sequence (mask.h:53-54): i sees j in [i+lk-lq-left, i+lk-lq+right].
- forward with seqlen_q == 1 (varlen: max_seqlen_q == 1) drops causal (:403, :585), which changes nothing a caller
  sees (one bottom-right causal row sees every key); with GQA it also takes the seqlenq_ngroups_swapped path (:408).
- a row that sees no key: out 0, LSE +INFINITY (flash_fwd_kernel.h:125, softmax.h:180); seqlen_k == 0: all rows
  (:497-503). The backward's exp(s - lse) takes an LSE of -inf as 0 (softmax.h:76, flash_bwd_kernel.h:534).
- the backward reads the LSE from its data pointer as contiguous [B, H, Sq] (dense) or [H, total_q] (varlen),
  checking neither dtype, shape nor strides (flash_bwd_kernel.h:124); out/dout/dq/dk/dv through their own strides
  (set_params_dgrad :212-231); GQA dk/dv go through dk_expanded then at::sum_out (:899, :966).
- varlen: rows past max_seqlen_q are never computed (grid from params.seqlen_q), keys past max_seqlen_k never reach
  the backward (grid_n), memory no sequence covers is left as torch::empty left it.
"""

from __future__ import annotations

import torch

from ._common import (
    INF,
    Undefined,
    attention_grads,
    check,
    emulated,
    expect,
    kv_grads,
    repeat_kv,
    scores,
    softmax,
    storage_read,
    unwritten,
)

HEAD_MULT8 = {True: "head_size must be a multiple of 8, this is ensured by padding!",
              False: "query, key, value, and out_ must have a head_size that is a multiple of 8"}
BWD_HEAD_MULT8 = "head_size should be a multiple of 8"
FWD_MAX_HEAD = "FlashAttention forward only supports head dimension at most 256"
BWD_MAX_HEAD = "FlashAttention backward only supports head dimension at most 256"
DTYPE = "FlashAttention only support fp16 and bf16 data type"
GQA = "Number of heads in key/value must divide number of heads in query"
LAST_DIM = "Input tensor must have contiguous last dimension"


def shape_msg(name: str, dims: str) -> str:
    return f"{name} must have shape ({dims})"  # CHECK_SHAPE (flash_api.cpp:21)


def window(seqlen_k: int, causal: bool, left: int, right: int, drop_causal: bool = False):
    """(is_causal, left, right) as mha_* and set_params_fprop leave them (the module docstring's rules)."""
    if left >= seqlen_k:
        left = -1
    if right >= seqlen_k:
        right = -1
    causal = causal and not drop_causal
    if causal:
        right = 0
    is_causal = left < 0 and right == 0
    if left < 0 <= right:
        left = seqlen_k
    if left >= 0 > right:
        right = seqlen_k
    return is_causal, left, right


def visible(lq: int, lk: int, win) -> torch.Tensor:
    is_causal, left, right = win
    i = torch.arange(lq)[:, None] + lk - lq
    j = torch.arange(lk)[None, :]
    if is_causal:
        return j <= i
    if left < 0 and right < 0:
        return torch.ones(lq, lk, dtype=torch.bool)
    return (j >= i - left) & (j <= i + right)


def _inputs(q, k, v, aten: bool, extra=()):
    check(q.dtype in (torch.float16, torch.bfloat16), DTYPE)
    check(k.dtype == q.dtype, "query and key must have the same dtype")
    check(v.dtype == q.dtype, "query and value must have the same dtype")
    for name, x in extra:
        check(x.dtype == q.dtype, f"query and {name} must have the same dtype")
    for x in (q, k, v):
        check(x.stride(-1) == 1, LAST_DIM)


def _heads(batch: int, d: int, h: int, hk: int, aten: bool, fwd: bool):
    check(batch > 0, "batch size must be positive")
    if fwd and aten:
        check(d % 8 == 0, HEAD_MULT8[True])
    if fwd:
        check(d <= 256, FWD_MAX_HEAD)
    if fwd and not aten:
        check(d % 8 == 0, HEAD_MULT8[False])
    if not fwd:
        check(d % 8 == 0, BWD_HEAD_MULT8)
        check(d <= 256, BWD_MAX_HEAD)
    check(h % hk == 0, GQA)


def _dropout(dropout_p: float, softcap: float):
    if softcap > 0:
        check(dropout_p == 0, "Softcapping does not support dropout for now")
    expect(dropout_p < 1, "p_dropout < 1.f")  # set_params_fprop :132
    emulated(dropout_p == 0, "dropout")


def _seq_forward(qs, ks, vs, scale, softcap, win):
    """One sequence [l, H, D]: out fp32 [lq, H, D], LSE [H, lq] with flash's +inf for rows that see no key."""
    qh, kh, vh = (x.transpose(0, 1) for x in (qs, ks, vs))
    p, lse = softmax(scores(qh, kh, scale, softcap)[0], visible(qs.shape[0], ks.shape[0], win))
    out = p @ repeat_kv(vh, qh.shape[0])
    return out.transpose(0, 1), lse.masked_fill(torch.isneginf(lse), INF)


def _seq_backward(dos, qs, ks, vs, os_, lse, scale, softcap, win, delta_rows=None):
    """One sequence: fp32 dq [lq, H, D], per-query-head dk/dv [lk, H, D], delta [H, lq]. P = exp(s - lse) with the
    LSE given; delta = rowsum(dO * O) (dot_do_o), NaN past `delta_rows` (never computed)."""
    qh, kh, vh, doh = (x.transpose(0, 1) for x in (qs, ks, vs, dos))
    s, raw = scores(qh, kh, scale, softcap)
    s = s.masked_fill(~visible(qs.shape[0], ks.shape[0], win), -INF)
    p = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0)[..., None])
    delta = (dos.float() * os_.float()).sum(-1).T
    if delta_rows is not None:
        delta[:, delta_rows:] = float("nan")
    dtanh = 1 - torch.tanh(raw / softcap) ** 2 if softcap > 0 else None
    dq, dk, dv, _ = attention_grads(doh, qh, kh, vh, p, delta, scale, dtanh)
    return dq.transpose(0, 1), dk.transpose(0, 1), dv.transpose(0, 1), delta


def _sequences(cu_q, cu_k, total_q: int, total_k: int):
    """(qa, qb, ka, kb) per sequence; a range outside q/k is a read past the tensor (no check stops it)."""
    bounds = list(zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:]))
    for qa, qb, ka, kb in bounds:
        if not (0 <= qa <= qb <= total_q and 0 <= ka <= kb <= total_k):
            raise Undefined(f"cu_seqlens range q [{qa}, {qb}) / k [{ka}, {kb}) outside {total_q} / {total_k} tokens")
    return bounds


def _cu(cu_q, cu_k):
    check(cu_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32")
    check(cu_k.dtype == torch.int32, "cu_seqlens_k must have dtype int32")
    check(cu_q.is_contiguous(), "cu_seqlens_q must be contiguous")
    check(cu_k.is_contiguous(), "cu_seqlens_k must be contiguous")


def _buffer(given, like, name: str, dims: str):
    """dq/dk/dv: the caller's, checked (mha_bwd :852-873), or torch::empty_like (unwritten: NaN)."""
    if given is None:
        return torch.empty_like(like).fill_(float("nan"))
    check(given.dtype == like.dtype, f"{name} must have the same dtype as q")
    check(given.stride(-1) == 1, f"{name} must have contiguous last dimension")
    check(given.shape == like.shape, shape_msg(name, dims))
    return given


def mha_fwd(q, k, v, dropout_p, scale, causal, left, right, softcap, return_softmax, aten):
    _inputs(q, k, v, aten)
    check(q.dim() == 4, shape_msg("q", "batch_size, seqlen_q, num_heads, head_size"))
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if aten and b == 0:
        return torch.empty_like(q), torch.empty(0, h, sq)
    _heads(b, d, h, hk, aten, fwd=True)
    _dropout(dropout_p, softcap)
    win = window(sk, causal, left, right, drop_causal=sq == 1)
    head = "head_size_og" if aten else "head_size"
    check(tuple(k.shape) == (b, sk, hk, d), shape_msg("k", f"batch_size, seqlen_k, num_heads_k, {head}"))
    check(tuple(v.shape) == (b, sk, hk, d), shape_msg("v", f"batch_size, seqlen_k, num_heads_k, {head}"))
    check(not return_softmax, "return_softmax is only supported when p_dropout > 0.0")
    out, lse = torch.empty_like(q), torch.empty(b, h, sq)
    for i in range(b):
        if sk == 0:  # :497-503
            out[i], lse[i] = 0, INF
            continue
        o, lse[i] = _seq_forward(q[i], k[i], v[i], scale, softcap, win)
        out[i] = o
    return out, lse


def mha_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, zero_tensors, causal, left, right, softcap,
                   return_softmax, aten):
    _inputs(q, k, v, aten)
    _cu(cu_q, cu_k)
    head = "head_size_og" if aten else "head_size"
    check(q.dim() == 3, shape_msg("temp_q" if aten else "q", f"total_q, num_heads, {head}"))
    batch, (total_q, h, d), hk = cu_q.numel() - 1, q.shape, k.shape[1]
    _dropout(dropout_p, softcap)
    causal = causal and max_q != 1
    if causal:
        right = 0
    if max_q == 1 and h > hk and left < 0 and right < 0 and d % 8 == 0:  # seqlenq_ngroups_swapped (:592-600)
        check(total_q == batch, f"shape '[{batch}, {hk}, {h // max(hk, 1)}, {d}]' is invalid for input of size "
                                f"{q.numel()}")
    _heads(batch, d, h, hk, aten, fwd=True)
    win = window(max_k, causal, left, right)
    check(k.dim() == 3 and tuple(k.shape[1:]) == (hk, d), shape_msg("k", f"total_k, num_heads_k, {head}"))
    check(tuple(v.shape) == tuple(k.shape), shape_msg("v", f"total_k, num_heads_k, {head}"))
    check(tuple(cu_q.shape) == (batch + 1,), shape_msg("cu_seqlens_q", "batch_size + 1"))
    check(tuple(cu_k.shape) == (batch + 1,), shape_msg("cu_seqlens_k", "batch_size + 1"))
    check(not return_softmax, "return_softmax is only supported when p_dropout > 0.0")
    out = torch.empty_like(q).fill_(0 if zero_tensors else float("nan"))  # :663-666
    lse = torch.full((h, total_q), -INF if zero_tensors else float("nan"))
    if max_k == 0:  # :737-744
        return out.zero_(), lse.fill_(INF)
    for qa, qb, ka, kb in _sequences(cu_q, cu_k, total_q, k.shape[0]):
        rows = min(qb - qa, max_q)  # m blocks come from max_seqlen_q: rows past it are never computed
        o, s = _seq_forward(q[qa:qb], k[ka:kb], v[ka:kb], scale, softcap, win)
        out[qa:qa + rows], lse[:, qa:qa + rows] = o[:rows], s[:, :rows]
    return out, lse


def _bwd_inputs(dout, q, k, v, out, aten):
    _inputs(q, k, v, aten, extra=(("out", out), ("dout", dout)))
    check(out.stride(-1) == 1, "out tensor must have contiguous last dimension")
    check(dout.stride(-1) == 1, "dout tensor must have contiguous last dimension")


def _bwd_heads(dout, d, aten):
    if aten:
        check(dout.shape[-1] % 8 == 0, "head_size_og should be a multiple of 8, this is ensured by padding!")
        check(d == -(-dout.shape[-1] // 8) * 8, "head_size must be head_size_og rounded to a multiple of 8")


def _lse(lse, size, stride, what):
    if lse.dtype != torch.float32:  # no check: the kernel would read the bytes as float
        raise Undefined(f"softmax_lse is {lse.dtype}; the kernel reads it as float32 without checking")
    return storage_read(lse, size, stride, what)


def mha_bwd(dout, q, k, v, out, lse, dq, dk, dv, dropout_p, scale, causal, left, right, softcap, aten):
    if causal:
        right = 0
    _bwd_inputs(dout, q, k, v, out, aten)
    check(q.dim() == 4, shape_msg("q", "batch_size, seqlen_q, num_heads, head_size"))
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    _heads(b, d, h, hk, aten, fwd=False)
    _bwd_heads(dout, d, aten)
    _dropout(dropout_p, softcap)
    win = window(sk, causal, left, right)
    kdims, qdims = "batch_size, seqlen_k, num_heads_k, head_size", "batch_size, seqlen_q, num_heads, head_size"
    for name, x, want, dims in (("k", k, (b, sk, hk, d), kdims), ("v", v, (b, sk, hk, d), kdims),
                                ("out", out, (b, sq, h, d), qdims),
                                ("dout", dout, (b, sq, h, dout.shape[-1] if aten else d),
                                 qdims.replace("head_size", "head_size_og") if aten else qdims)):
        check(tuple(x.shape) == want, shape_msg(name, dims))
    dq, dk, dv = _buffer(dq, q, "dq", qdims), _buffer(dk, k, "dk", kdims), _buffer(dv, v, "dv", kdims)
    lse = _lse(lse, (b, h, sq), (h * sq, sq, 1), "softmax_lse read as [b, h, seqlen_q]")
    softmax_d = unwritten((b, h, -(-sq // 128) * 128), torch.float32)
    for i in range(b):
        gq, gk, gv, softmax_d[i, :, :sq] = _seq_backward(dout[i], q[i], k[i], v[i], out[i], lse[i], scale, softcap,
                                                         win)
        dq[i] = gq
        dk[i] = kv_grads(gk.transpose(0, 1), hk, q.dtype).transpose(0, 1)
        dv[i] = kv_grads(gv.transpose(0, 1), hk, q.dtype).transpose(0, 1)
    return dq, dk, dv, softmax_d


def mha_varlen_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, dropout_p, scale, zero_tensors,
                   causal, left, right, softcap, aten):
    if causal:
        right = 0
    _bwd_inputs(dout, q, k, v, out, aten)
    _cu(cu_q, cu_k)
    check(q.dim() == 3, shape_msg("q", "total_q, num_heads, head_size"))
    (total_q, h, d), batch, total_k, hk = q.shape, cu_q.numel() - 1, k.shape[0], k.shape[1]
    _heads(batch, d, h, hk, aten, fwd=False)
    _bwd_heads(dout, d, aten)
    _dropout(dropout_p, softcap)
    win = window(max_k, causal, left, right)
    kdims, qdims = "total_k, num_heads_k, head_size", "total_q, num_heads, head_size"
    for name, x, want, dims in (("k", k, (total_k, hk, d), kdims), ("v", v, (total_k, hk, d), kdims),
                                ("out", out, (total_q, h, d), qdims),
                                ("dout", dout, (total_q, h, dout.shape[-1] if aten else d), qdims)):
        check(tuple(x.shape) == want, shape_msg(name, dims))
    check(tuple(cu_q.shape) == (batch + 1,), shape_msg("cu_seqlens_q", "batch_size + 1"))
    check(tuple(cu_k.shape) == (batch + 1,), shape_msg("cu_seqlens_k", "batch_size + 1"))
    dq, dk, dv = _buffer(dq, q, "dq", qdims), _buffer(dk, k, "dk", kdims), _buffer(dv, v, "dv", kdims)
    lse = _lse(lse, (h, total_q), (total_q, 1), "softmax_lse read as [h, total_q]")
    # the kernel writes per-query-head grads into dk_expanded (torch::empty, :1122; dk itself without GQA), and
    # at::sum_out sums the whole of it into dk (:1195)
    dk_h, dv_h = (torch.full((total_k, h, d), 0.0 if zero_tensors else float("nan")) for _ in range(2))
    covered = torch.zeros(total_k, dtype=torch.bool)
    if zero_tensors:  # :1131-1136
        dq.zero_(), dk.zero_(), dv.zero_()
    softmax_d = unwritten((h, total_q + 128 * batch), torch.float32)
    for n, (qa, qb, ka, kb) in enumerate(_sequences(cu_q, cu_k, total_q, total_k)):
        if kb - ka > max_k:  # key blocks come from max_seqlen_k (grid_n): keys past it are never visited
            raise Undefined(f"a sequence has {kb - ka} keys but max_seqlen_k is {max_k}; the kernel skips the rest")
        gq, gk, gv, delta = _seq_backward(dout[qa:qb], q[qa:qb], k[ka:kb], v[ka:kb], out[qa:qb], lse[:, qa:qb],
                                          scale, softcap, win, delta_rows=max_q)  # dot_do_o's grid: max_seqlen_q
        dq[qa:qb], dk_h[ka:kb], dv_h[ka:kb], covered[ka:kb] = gq, gk, gv, True
        softmax_d[:, qa + 128 * n:qb + 128 * n] = delta
    for g, per_head in ((dk, dk_h), (dv, dv_h)):
        summed = kv_grads(per_head.transpose(0, 1), hk, q.dtype).transpose(0, 1)
        if h != hk:
            g.copy_(summed)  # unwritten rows of dk_expanded arrive as NaN
        else:
            g[covered] = summed[covered]  # dk_expanded is dk: rows no sequence covers keep what they held
    return dq, dk, dv, softmax_d
