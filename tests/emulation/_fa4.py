"""FlashAttention-4's host code and kernels, emulated: `_flash_attn_fwd` and `_flash_attn_bwd` of
flash_attn/cute/interface.py (Dao-AILab/flash-attention @0251105a, fa4-v4.0.0.beta27; plain Python functions there
too, taking the keywords the ring uses), on the architecture `ARCH` names (interface._get_device_arch: major * 10 +
minor; default 90, an H100). The CuTe kernels' math: fp32, the mask of flash_attn/cute/mask.py. flash_attn_4.py has
the public functions, the installer and the contract table.

FA4's host checks are Python `assert`s: they raise `Assertion` (an AssertionError, and a KernelError for the
contract tests) with FA4's message. Layout: FA4 never refuses strides; `maybe_contiguous` (cute_dsl_utils.py)
copies a tensor whose pointer or non-last strides are not 16-byte aligned or whose last dim is strided. LSE -inf
handed to the backward is not special-cased here: exp(s - lse) is then inf and the gradients NaN (the ring hands
none). The `learnable_sink`, score/mask mods, block sparsity, paging, split-KV, fp8 and qv paths are not emulated.
"""

from __future__ import annotations

import collections
import math

import torch

from ._common import INF, KernelError, attention_grads, emulated, repeat_kv, scores, softmax

PY = "flash_attn/cute/interface.py"
ARCH = [90]
CALLS = collections.Counter()  # "fa4" / "fa4_backward": calls of the two functions, by whoever (ring or model)
HALF = (torch.float16, torch.bfloat16)


class Assertion(KernelError, AssertionError):
    """An `assert` of FA4's interface failed."""


def _assert(cond: bool, message: str) -> None:
    if not cond:
        raise Assertion(message)


def _aligned_layout(t: torch.Tensor, align_bytes: int = 16) -> bool:
    elems = max(1, align_bytes // t.element_size())
    return t.stride(-1) == 1 and (t.storage_offset() * t.element_size()) % align_bytes == 0 and \
        all(s == 0 or s % elems == 0 for s in t.stride()[:-1])


def maybe_contiguous(t, align_bytes: int = 16):
    """cute_dsl_utils.maybe_contiguous: kept if aligned, else copied (never an error)."""
    if t is None:
        return None
    if t.is_contiguous():
        return t if (t.storage_offset() * t.element_size()) % align_bytes == 0 else t.clone()
    return t if _aligned_layout(t, align_bytes) else t.contiguous()


def validate_head_dims(d: int, d_v: int, major: int, alignment: int) -> None:
    """interface._validate_head_dims (not for sm80 / sm120)."""
    if major == 9:
        _assert(8 <= d <= 256 and 8 <= d_v <= 256 and d % alignment == 0 and d_v % alignment == 0,
                f"(head_dim, head_dim_v)=({d}, {d_v}) is not supported on SM90. head_dim and head_dim_v must be "
                f"between 8 and 256 and divisible by {alignment}.")
    elif major in (10, 11):
        ok = (8 <= d <= 128 and 8 <= d_v <= 128) or (d, d_v) == (192, 128) or \
            ((d == 64 or d == d_v) and d_v == 512) or (d, d_v) == (256, 256)
        _assert(ok and d % alignment == 0 and d_v % alignment == 0,
                f"(head_dim, head_dim_v)=({d}, {d_v}) is not supported on SM100/SM110. head_dim and head_dim_v must "
                f"be between 8 and 128 and divisible by {alignment}, or (192, 128) for DeepSeek, or (256, 256) for "
                "hd256.")


def resolve_window(causal, left, right):
    """interface._resolve_causal_local_window (no mask_mod)."""
    if causal:
        right = 0
    if left is not None and right is not None and left + right < 0:
        left = right = None
    if left is not None or right is not None:
        if left is None and right == 0:
            return True, False, None, None
        return False, True, left, right
    return causal, False, left, right


def visible(lq: int, lk: int, win) -> torch.Tensor:
    """flash_attn/cute/mask.py: bottom-right per sequence; a None side of a local window is unbounded."""
    causal, local, left, right = win
    i = torch.arange(lq)[:, None] + lk - lq
    j = torch.arange(lk)[None, :]
    ok = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        return j <= i
    if local and right is not None:
        ok &= j <= i + right
    if local and left is not None:
        ok &= j >= i - left
    return ok


def _seqs(cu_q, cu_k, b, sq, sk):
    if cu_q is None:
        return [(i, None, None) for i in range(b)]
    return [(None, (qa, qb), (ka, kb))
            for qa, qb, ka, kb in zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:])]


def _index(x, seq, which: int):
    i, qr, kr = seq
    if i is not None:
        return x[i]
    a, b = qr if which == 0 else kr
    return x[a:b]


def _common(q, k, v, cu_q, cu_k, arch, fwd: bool):
    for t in (cu_q, cu_k):
        if t is not None:
            _assert(t.dtype == torch.int32, "cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k must be int32"
                    if fwd else "cu_seqlens_q, cu_seqlens_k must be int32")
            _assert(t.stride(0) == 1, "cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k must be contiguous")
    _assert(q.shape[-2] % k.shape[-2] == 0, "num_head must be divisible by num_head_kv")
    if arch // 10 not in (8, 12):
        validate_head_dims(q.shape[-1], v.shape[-1], arch // 10, 16 // v.element_size())


def _flash_attn_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                    max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, page_table=None, softmax_scale=None,
                    causal=False, softcap=None, window_size_left=None, window_size_right=None, learnable_sink=None,
                    num_splits=1, pack_gqa=None, return_lse=False, out=None, lse=None, **rest):
    emulated(qv is None and seqused_q is None and seqused_k is None and page_table is None and learnable_sink is None
             and out is None and lse is None and num_splits == 1 and not any(v_ is not None for v_ in rest.values()),
             "qv / seqused / paging / sinks / splits / given outputs / mods")
    CALLS["fa4"] += 1
    requires_grad = any(t is not None and t.requires_grad for t in (q, k, v))
    q, k, v = (maybe_contiguous(t) for t in (q, k, v))
    varlen = cu_seqlens_q is not None
    b = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
    sq = None if varlen else q.shape[1]
    total_q = q.shape[0] if varlen else b * sq
    h, d, hk, d_v, sk = q.shape[-2], q.shape[-1], v.shape[-2], v.shape[-1], v.shape[-3]
    emulated(varlen == (cu_seqlens_k is not None), "varlen on one side only")
    if varlen:
        _assert(k.shape == (sk, hk, d) and v.shape == (sk, hk, d_v), "assert k.shape == (seqlen_k, num_head_kv, "
                "head_dim)")
        _assert(cu_seqlens_k.shape == (b + 1,), "cu_seqlens_k must have shape (batch_size + 1,)")
    else:
        _assert(k.shape == (b, sk, hk, d) and v.shape == (b, sk, hk, d_v),
                "assert k.shape == (batch_size, seqlen_k, num_head_kv, head_dim)")
    _assert(v.dtype in HALF, "inputs must be float16, bfloat16, fp8 e4m3fn, or fp8 e5m2")
    _assert(q.dtype == v.dtype and k.dtype == v.dtype, "q, k, v, and qv must have the same dtype")
    arch = ARCH[0]
    _assert(arch // 10 in (8, 9, 10, 11, 12), "Unsupported compute capability. Supported: 8.x, 9.x, 10.x, 11.x, 12.x")
    _common(q, k, v, cu_seqlens_q, cu_seqlens_k, arch, fwd=True)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    softcap = None if softcap == 0.0 else softcap
    out = torch.empty(*((total_q,) if varlen else (b, sq)), h, d_v, dtype=q.dtype)
    lse = torch.empty((h, total_q) if varlen else (b, h, sq)) if requires_grad or return_lse else None
    if sk == 0 or total_q == 0:
        out.zero_()
        if lse is not None:
            lse.fill_(-INF)
        return out, lse, None, None
    win = resolve_window(causal, window_size_left, window_size_right)
    max_q = max_seqlen_q if max_seqlen_q is not None else (total_q if varlen else sq)
    if varlen:
        out.fill_(float("nan"))  # tokens no sequence covers: torch.empty, never written
        if lse is not None:
            lse.fill_(float("nan"))
    for seq in _seqs(cu_seqlens_q, cu_seqlens_k, b, sq, sk):
        qs, ks, vs = _index(q, seq, 0), _index(k, seq, 1), _index(v, seq, 1)
        lq, lk = qs.shape[0], ks.shape[0]
        p, l = softmax(scores(qs.transpose(0, 1), ks.transpose(0, 1), scale, softcap or 0.0)[0], visible(lq, lk, win))
        o = (p @ repeat_kv(vs.transpose(0, 1), h)).transpose(0, 1)  # a row with no key: 0, LSE -inf
        rows = min(lq, max_q)
        if varlen:
            a = seq[1][0]
            out[a:a + rows] = o[:rows]
            if lse is not None:
                lse[:, a:a + rows] = l[:, :rows]
        else:
            out[seq[0]] = o
            if lse is not None:
                lse[seq[0]] = l
    return out, lse, None, None


def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, window_size_left=None,
                    window_size_right=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                    max_seqlen_q=None, max_seqlen_k=None, deterministic=False, dq=None, dk=None, dv=None, dlse=None,
                    learnable_sink=None, **rest):
    emulated(seqused_q is None and seqused_k is None and dlse is None and learnable_sink is None
             and dq is None and dk is None and dv is None and not any(x is not None for x in rest.values()),
             "seqused / dlse / sinks / given grads / mods")
    CALLS["fa4_backward"] += 1
    arch = ARCH[0]
    _assert(arch // 10 in (9, 10, 11, 12), "Unsupported compute capability. Supported: 9.x, 10.x, 11.x, 12.x")
    win = resolve_window(causal, window_size_left, window_size_right)
    q, k, v, out, dout, lse = (maybe_contiguous(t) for t in (q, k, v, out, dout, lse))
    varlen = cu_seqlens_q is not None
    h, d, hk, d_v = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
    if varlen:
        b, total_q, total_k = cu_seqlens_q.shape[0] - 1, q.shape[0], k.shape[0]
        _assert(k.shape == (total_k, hk, d) and v.shape == (total_k, hk, d_v), "assert k.shape == (total_k, ...)")
        _assert(out.shape == dout.shape == (total_q, h, d_v), "assert out.shape == (total_q, num_head, head_dim_v)")
        _assert(lse.shape == (h, total_q), "lse must have shape (num_head, total_q)")
    else:
        b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
        _assert(k.shape == (b, sk, hk, d) and v.shape == (b, sk, hk, d_v), "assert k.shape == (batch_size, ...)")
        _assert(out.shape == dout.shape == (b, sq, h, d_v), "assert out.shape == (batch_size, seqlen_q, ...)")
        _assert(lse.shape == (b, h, sq), "lse must have shape (batch_size, num_head, seqlen_q)")
    _assert(q.dtype in HALF, "inputs must be float16 or bfloat16")
    _assert(q.dtype == k.dtype == v.dtype == out.dtype == dout.dtype, "inputs must have the same dtype")
    _assert(lse.dtype == torch.float32, "lse must be float32")
    _assert(not (arch // 10 == 12 and deterministic), "deterministic backward not supported on SM 12.0")
    _common(q, k, v, cu_seqlens_q, cu_seqlens_k, arch if arch // 10 != 12 else 80, fwd=False)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))  # torch.empty: uncovered tokens unwritten
    for seq in _seqs(cu_seqlens_q, cu_seqlens_k, b, None, None):
        qs, os_, dos = (_index(x, seq, 0) for x in (q, out, dout))
        ks, vs = _index(k, seq, 1), _index(v, seq, 1)
        l = lse[:, seq[1][0]:seq[1][1]] if varlen else lse[seq[0]]
        qh, kh, vh, doh = (x.transpose(0, 1) for x in (qs, ks, vs, dos))
        s, raw = scores(qh, kh, scale, softcap or 0.0)
        s = s.masked_fill(~visible(qs.shape[0], ks.shape[0], win), -INF)
        p = torch.exp(s - l[..., None])
        delta = (dos.float() * os_.float()).sum(-1).T
        dtanh = 1 - torch.tanh(raw / softcap) ** 2 if softcap else None
        gq, gk, gv, _ = attention_grads(doh, qh, kh, vh, p, delta, scale, dtanh)
        gk, gv = (x.unflatten(0, (hk, h // hk)).sum(1).transpose(0, 1) for x in (gk, gv))  # fp32 dK/dV accumulation
        _index(dq, seq, 0).copy_(gq.transpose(0, 1))
        _index(dk, seq, 1).copy_(gk)
        _index(dv, seq, 1).copy_(gv)
    return dq, dk, dv
