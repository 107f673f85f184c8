"""The emulations of FlashAttention-3 and FlashAttention-4 (tests/emulation/flash_attn_3.py, flash_attn_4.py): (a) their
math equals plain fp64 references, and (b) every contract row holds - a call that violates a "check" row raises the
kernel's message, and each "layout" and "semantics" row has a test below that fails if the emulation read the tensor
otherwise or masked by the obvious semantics (causal alignment, windows, empty rows, what is copied or refused).
cuDNN's: test_kernel_contracts_cudnn.py.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.emulation import _fa3
from tests.emulation import flash_attn_3 as e3
from tests.emulation import flash_attn_4 as e4
from tests.emulation._common import KernelError, Undefined
from tests.unit.test_kernel_emulations import (
    BF16,
    F16,
    F32,
    bottom_right,
    check_all,
    qkv,
    reference,
    rnd,
    varlen_inputs,
    varlen_reference,
)

CONTRACT = e3.CONTRACT + e4.CONTRACT


def fa3(q, k, v, causal=False, **kw):
    return e3._flash_attn_forward(q, k, v, softmax_scale=0.3, causal=causal, **kw)[:2]


def fa3_grads(do, q, k, v, out, lse, causal=False, **kw):
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    e3._flash_attn_backward(do, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, softmax_scale=0.3, is_causal=causal, **kw)
    return dq, dk, dv


def fa4(q, k, v, causal=False, **kw):
    return e4._flash_attn_fwd(q, k, v, softmax_scale=0.3, causal=causal, return_lse=True, **kw)[:2]


def fa4_grads(do, q, k, v, out, lse, causal=False, **kw):
    return e4._flash_attn_bwd(q, k, v, out, do, lse, softmax_scale=0.3, causal=causal, **kw)


# -- (a) the math --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["fa3", "fa4"])
@pytest.mark.parametrize("sq,sk,causal,softcap", [(5, 5, True, 0.0), (3, 6, True, 2.0), (5, 4, False, 0.0)])
def test_flash_3_and_4_match_reference(impl, sq, sk, causal, softcap):
    q, k, v, do = qkv(sq=sq, sk=sk, layout="bshd")
    fwd, bwd = (fa3, fa3_grads) if impl == "fa3" else (fa4, fa4_grads)
    out, lse = fwd(q, k, v, causal, softcap=softcap)
    grads = bwd(do, q, k, v, out, lse, causal, softcap=softcap)
    ref = reference(*(x.transpose(1, 2) for x in (q, k, v, do)), bottom_right(sq, sk, causal), 0.3, softcap=softcap)
    check_all((out.transpose(1, 2), lse, *(g.transpose(1, 2) for g in grads)), ref, BF16)


@pytest.mark.parametrize("impl", ["fa3", "fa4"])
@pytest.mark.parametrize("window", [(-1, -1), (2, 0)])
def test_flash_3_and_4_varlen_match_reference(impl, window):
    q, k, v, do, cu_q, cu_k, mq, mk = varlen_inputs()
    left, right = window
    var = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq, max_seqlen_k=mk)
    if impl == "fa3":
        out, lse = fa3(q, k, v, True, window_size_left=left, window_size_right=right, **var)
        grads = fa3_grads(do, q, k, v, out, lse, True, window_size_left=left, window_size_right=right, **var)
    else:
        w = dict(window_size_left=None if left < 0 else left, window_size_right=None if right < 0 else right)
        out, lse = fa4(q, k, v, True, **w, **var)
        grads = fa4_grads(do, q, k, v, out, lse, True, **w, **var)
    left_ = None if left < 0 else left
    ref = varlen_reference(q, k, v, do, cu_q, cu_k, lambda lq, lk: bottom_right(lq, lk, True, left_, 0), 0.3)
    check_all((out, lse, *grads), ref, BF16)


# -- (b) every check row: one call that violates it ----------------------------------------------------------------


def _fa3_on(cap, call):
    def run():
        saved, e3.CAPABILITY[0] = e3.CAPABILITY[0], cap
        try:
            return call()
        finally:
            e3.CAPABILITY[0] = saved
    return run


def _fa4_on(arch, call):
    def run():
        saved, e4.ARCH[0] = e4.ARCH[0], arch
        try:
            return call()
        finally:
            e4.ARCH[0] = saved
    return run


def _fa3_bwd(dtype=BF16, out_dtype=None, d=8, deterministic=False, dq=None):
    q, k, v, do = qkv(sq=4, sk=4, d=d, dtype=dtype, layout="bshd")
    out, lse = torch.zeros_like(q, dtype=out_dtype or dtype), torch.zeros(2, 4, 4)
    grads = torch.empty_like(q) if dq is None else dq, torch.empty_like(k), torch.empty_like(v)
    return e3._flash_attn_backward(do, q, k, v, out, lse, dq=grads[0], dk=grads[1], dv=grads[2],
                                   softmax_scale=0.3, deterministic=deterministic)


def _fa4_bwd(lse=None, out_dtype=None, dtype=BF16):
    q, k, v, do = qkv(sq=4, sk=4, layout="bshd", dtype=dtype)
    out = torch.zeros_like(q, dtype=out_dtype or dtype)
    return e4._flash_attn_bwd(q, k, v, out, do, torch.zeros(2, 4, 4) if lse is None else lse, softmax_scale=0.3)


def _mq(**kw):
    return qkv(sq=4, sk=4, **kw)[:3]


VIOLATIONS = {
    "fa3.types": lambda: e3._flash_attn_forward(*qkv(layout="bshd")[:3], window_size_left=1.5),
    "fa3.arch": _fa3_on((7, 5), lambda: fa3(*qkv(layout="bshd")[:3])),
    "fa3.fwd_dtype": lambda: fa3(*qkv(layout="bshd", dtype=F32)[:3]),
    "fa3.bwd_dtype": lambda: _fa3_bwd(dtype=F32),
    "fa3.kv_dtype": lambda: fa3(qkv(layout="bshd")[0], *qkv(layout="bshd", dtype=F16)[1:3]),
    "fa3.out_dtype": lambda: _fa3_bwd(out_dtype=F16),
    "fa3.cu_dtype": lambda: fa3(*varlen_inputs()[:3], cu_seqlens_q=torch.tensor([0, 3, 8]),
                                cu_seqlens_k=varlen_inputs()[5], max_seqlen_q=5, max_seqlen_k=5),
    "fa3.max_seqlen": lambda: fa3(*varlen_inputs()[:3], cu_seqlens_q=varlen_inputs()[4],
                                  cu_seqlens_k=varlen_inputs()[5], max_seqlen_k=5),
    "fa3.batch": lambda: fa3(qkv(layout="bshd")[0], *qkv(b=1, layout="bshd")[1:3]),
    "fa3.head_max": lambda: fa3(*qkv(layout="bshd", d=264)[:3]),
    "fa3.gqa": lambda: fa3(*qkv(h=3, hk=2, layout="bshd")[:3]),
    "fa3.dv": lambda: fa3(*qkv(layout="bshd", d=128)[:2], rnd(2, 5, 2, 64)),
    "fa3.dv_hopper": _fa3_on((8, 0), lambda: fa3(*qkv(layout="bshd", d=64)[:2], rnd(2, 5, 2, 128))),
    "fa3.head_mult8": lambda: fa3(*qkv(layout="bshd", d=12)[:3]),
    "fa3.shape": lambda: fa3(qkv(layout="bshd")[0], rnd(2, 5, 2, 8), rnd(2, 6, 2, 8)),
    "fa3.deterministic": lambda: _fa3_bwd(d=256, deterministic=True),
    "fa3.dq_dtype": lambda: _fa3_bwd(dq=torch.empty(2, 4, 4, 8, dtype=F16)),
    "fa4.fwd_dtype": lambda: fa4(*qkv(layout="bshd", dtype=F32)[:3]),
    "fa4.same_dtype": lambda: fa4(qkv(layout="bshd", dtype=F16)[0], *qkv(layout="bshd")[1:3]),
    "fa4.fwd_arch": _fa4_on(70, lambda: fa4(*qkv(layout="bshd")[:3])),
    "fa4.bwd_arch": _fa4_on(80, lambda: _fa4_bwd()),
    "fa4.gqa": lambda: fa4(*qkv(h=3, hk=2, layout="bshd")[:3]),
    "fa4.cu_dtype": lambda: fa4(*varlen_inputs()[:3], cu_seqlens_q=torch.tensor([0, 3, 8]),
                                cu_seqlens_k=varlen_inputs()[5]),
    "fa4.cu_contiguous": lambda: fa4(*varlen_inputs()[:3],
                                     cu_seqlens_q=torch.tensor([0, 0, 3, 0, 8], dtype=torch.int32)[::2],
                                     cu_seqlens_k=varlen_inputs()[5]),
    "fa4.kv_shape": lambda: fa4(qkv(layout="bshd")[0], rnd(2, 5, 2, 8), rnd(2, 6, 2, 8)),
    "fa4.sm90_head_dims": lambda: fa4(*qkv(layout="bshd", d=264)[:3]),
    "fa4.sm100_head_dims": _fa4_on(100, lambda: fa4(*qkv(layout="bshd", d=160)[:3])),
    "fa4.bwd_dtype": lambda: _fa4_bwd(dtype=F32),
    "fa4.bwd_same_dtype": lambda: _fa4_bwd(out_dtype=F16),
    "fa4.lse_shape": lambda: _fa4_bwd(lse=torch.zeros(2, 4, 5)),
    "fa4.lse_dtype": lambda: _fa4_bwd(lse=torch.zeros(2, 4, 4, dtype=torch.float64)),
}


CHECKS = [row for row in CONTRACT if row.kind == "check"]


@pytest.mark.parametrize("row", CHECKS, ids=lambda row: row.id)
def test_a_call_violating_a_check_row_raises_its_message(row):
    with pytest.raises(RuntimeError) as info:
        VIOLATIONS[row.id]()
    assert row.message in str(info.value), (row.message, str(info.value))
    assert isinstance(info.value, KernelError) or row.id == "fa3.types"  # the dispatcher's own error


def test_every_row_is_covered():
    ids = [row.id for row in CONTRACT]
    assert len(ids) == len(set(ids))
    assert {row.id for row in CHECKS} == set(VIOLATIONS)
    here = sys.modules[__name__]
    for row in CONTRACT:
        assert row.kind in ("check", "layout", "semantics") and row.source and row.requires, row
        if row.kind != "check":
            assert callable(getattr(here, row.test, None)), f"{row.id}: no test {row.test}"


# -- (b) layout and semantics rows ---------------------------------------------------------------------------------


def test_fa3_strided_inputs():
    q, k, v, _ = qkv(d=16, layout="bshd")
    wide = [x[..., ::2] for x in (q, k, v)]  # copied by the wrapper (maybe_contiguous)
    assert torch.equal(fa3(*wide)[0], fa3(*(x.contiguous() for x in wide))[0])
    views = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in qkv(layout="bshd")[:3]]  # read as given
    assert torch.equal(fa3(*views)[0], fa3(*(x.contiguous() for x in views))[0])


def test_fa3_backward_reads_lse_contiguous():
    q, k, v, do = qkv(layout="bshd")
    out, lse = fa3(q, k, v)
    permuted = lse.transpose(1, 2).contiguous().transpose(1, 2)  # same values, [B, S, H] memory
    right, wrong = fa3_grads(do, q, k, v, out, lse), fa3_grads(do, q, k, v, out, permuted)
    assert not torch.allclose(right[0].float(), wrong[0].float(), atol=1e-2)
    with pytest.raises(Undefined):
        fa3_grads(do, q, k, v, out, lse.double())


def test_fa3_window_rules():
    win = _fa3.window
    assert win(4, 6, False, 5, -1) == (False, False, 5, 3)  # left >= S_k - 1: none; then -1 -> S_k - 1 / S_q - 1
    assert win(4, 6, True, -1, 7) == (True, False, 5, 0)  # causal: right 0
    assert win(4, 6, False, 2, -1) == (False, True, 2, 3)  # right -1 beside a left: S_q - 1, never S_k
    q, k, v, do = qkv(sq=4, sk=6, layout="bshd")
    lse = fa3(q, k, v, window_size_left=2)[1]
    ref = reference(*(x.transpose(1, 2) for x in (q, k, v, do)), bottom_right(4, 6, False, 2, 3), 0.3)[1]
    assert torch.allclose(lse.double(), ref, atol=1e-5)


def test_fa3_causal_is_bottom_right():
    q, k, v, do = qkv(sq=2, sk=4, layout="bshd")
    lse = fa3(q, k, v, causal=True)[1]
    ref = reference(*(x.transpose(1, 2) for x in (q, k, v, do)), bottom_right(2, 4), 0.3)[1]
    assert torch.allclose(lse.double(), ref, atol=1e-5)


def test_fa3_outputs():
    q, k, v, _ = qkv(sq=4, sk=2, layout="bshd")
    out, lse = fa3(q, k, v, causal=True)  # bottom-right: rows 0 and 1 see no key
    assert out.shape == q.shape and lse.shape == (2, 4, 4) and lse.dtype == F32
    assert (lse[..., :2] == -float("inf")).all() and (out[:, :2] == 0).all()
    vq, vk, vv, _, cu_q, cu_k, mq, mk = varlen_inputs()
    assert fa3(vq, vk, vv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq, max_seqlen_k=mk)[1].shape == (4, 8)


def test_fa4_copies_unaligned_inputs():
    q, k, v, _ = qkv(d=16, layout="bshd")
    wide = [x[..., ::2] for x in (q, k, v)]
    assert torch.equal(fa4(*wide)[0], fa4(*(x.contiguous() for x in wide))[0])
    q, k, v, _ = qkv(layout="bshd")
    shifted = rnd(2 * 5 * 4 * 8 + 1)[1:].view(2, 5, 4, 8)  # an unaligned pointer: cloned, not refused
    assert torch.equal(fa4(shifted, k, v)[0], fa4(shifted.clone(), k, v)[0])


def test_fa4_returns_the_lse_only_when_asked():
    q, k, v, _ = qkv(layout="bshd")
    assert e4._flash_attn_fwd(q, k, v)[1] is None
    assert e4._flash_attn_fwd(q.requires_grad_(), k, v)[1].shape == (2, 4, 5)


def test_fa4_window_rules():
    assert e4.resolve_window(True, 3, None) == (False, True, 3, 0)  # causal with a left window: local (3, 0)
    assert e4.resolve_window(True, None, None) == (True, False, None, None)
    assert e4.resolve_window(False, 2, None) == (False, True, 2, None)  # right unbounded
    assert e4.visible(3, 5, (False, True, 1, None)).sum(-1).tolist() == [4, 3, 2]


def test_fa4_causal_is_bottom_right():
    q, k, v, do = qkv(sq=2, sk=4, layout="bshd")
    lse = fa4(q, k, v, causal=True)[1]
    ref = reference(*(x.transpose(1, 2) for x in (q, k, v, do)), bottom_right(2, 4), 0.3)[1]
    assert torch.allclose(lse.double(), ref, atol=1e-5)
