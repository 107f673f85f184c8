"""The kernel emulations of tests/emulation: (a) their math equals plain fp64 references on well-formed inputs, and
(b) every contract row holds - a call violating a "check" row raises the kernel's message, and the "layout" and
"semantics" rows (what the kernels read through assumed strides, how they mask, what they write for empty rows)
each have a test below that would fail if the emulation read the tensor's own strides or the obvious semantics.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.emulation import aten_efficient
from tests.emulation import aten_flash as af
from tests.emulation import flash_attn as fa
from tests.emulation._common import KernelError, Undefined
from tests.emulation.aten_sdpa import OPS, Counted

CONTRACT = af.CONTRACT + aten_efficient.CONTRACT + fa.CONTRACT  # cuDNN, FA3, FA4: test_kernel_contracts_hopper.py
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
SEED, OFFSET = torch.zeros(2, dtype=torch.int64), torch.zeros((), dtype=torch.int64)
MASK = [True, True, True, False]
INF = float("inf")


def rnd(*shape, dtype=BF16, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def qkv(b=2, h=4, hk=2, sq=5, sk=5, d=8, dtype=BF16, layout="bhsd"):
    """q, k, v, dout; "bhsd" [B, H, S, D], "bshd" [B, S, H, D]."""
    shapes = [(b, h, sq, d), (b, hk, sk, d), (b, hk, sk, d), (b, h, sq, d)]
    xs = [rnd(*s, dtype=dtype, seed=i) for i, s in enumerate(shapes)]
    return xs if layout == "bhsd" else [x.transpose(1, 2).contiguous() for x in xs]


def bottom_right(lq, lk, causal=True, left=None, right=None):
    i, j = torch.arange(lq)[:, None] + lk - lq, torch.arange(lk)[None, :]
    ok = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        ok &= j <= i
    if left is not None:
        ok &= j >= i - left
    if right is not None:
        ok &= j <= i + right
    return ok


def reference(q, k, v, dout, visible, scale, bias=None, softcap=0.0):
    """fp64 out, LSE, dq, dk, dv of heads-first [B, H, M, D] inputs (kv heads repeated, their grads summed)."""
    g = q.shape[1] // k.shape[1]
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    with torch.enable_grad():
        s = leaves[0] @ leaves[1].repeat_interleave(g, 1).transpose(-1, -2) * scale
        s = softcap * torch.tanh(s / softcap) if softcap else s
        s = (s + (0 if bias is None else bias.double())).masked_fill(~visible, -INF)
        lse = torch.logsumexp(s, -1)
        out = torch.exp(s - lse[..., None]) @ leaves[2].repeat_interleave(g, 1)
        grads = torch.autograd.grad((out * dout.double()).sum(), leaves)
    return (out.detach(), lse.detach(), *grads)


def close(got, ref, tol, what=""):
    err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


TOL = {BF16: 2e-2, F16: 3e-3, F32: 1e-5}  # out, dq, dk, dv rounded to the dtype; delta uses the rounded out


def check_all(got, ref, dtype):
    for g, r, what in zip(got, ref, ("out", "lse", "dq", "dk", "dv")):
        close(g, r, 1e-5 if what == "lse" else TOL[dtype], what)  # the LSE is fp32 whatever the inputs


# -- (a) the math --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("sq,sk,causal", [(5, 5, True), (3, 6, True), (5, 4, False)])
def test_aten_flash_matches_reference(sq, sk, causal, dtype):
    q, k, v, do = qkv(sq=sq, sk=sk, dtype=dtype)
    out, lse, cq, ck, mq, mk, *_ = OPS["flash"](q, k, v, 0.0, causal, False, scale=0.3)
    grads = OPS["flash_backward"](do, q, k, v, out, lse, cq, ck, mq, mk, 0.0, causal, SEED, OFFSET, scale=0.3)
    check_all((out, lse, *grads), reference(q, k, v, do, bottom_right(sq, sk, causal), 0.3), dtype)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("m,n,causal", [(5, 5, True), (3, 6, True), (6, 3, False)])
def test_aten_efficient_matches_reference(m, n, causal, dtype):
    q, k, v, do = qkv(h=2, hk=2, sq=m, sk=n, dtype=dtype)
    bias = torch.zeros(2, 2, m, 16, dtype=dtype)[..., :n].copy_(rnd(2, 2, m, n, dtype=dtype, seed=9))
    out, lse, seed, offset = OPS["efficient"](q, k, v, bias, True, 0.0, causal, scale=0.3)
    grads = OPS["efficient_backward"](do, q, k, v, bias, out, lse, seed, offset, 0.0, MASK, causal, scale=0.3)
    visible = torch.ones(m, n, dtype=torch.bool).tril() if causal else torch.ones(m, n, dtype=torch.bool)
    check_all((out, lse[..., :m], *grads[:3]), reference(q, k, v, do, visible, 0.3, bias), dtype)
    assert grads[3] is None


def varlen_inputs(lens_q=(3, 5), lens_k=(4, 5), h=4, hk=2, d=8, dtype=BF16):
    tq, tk = sum(lens_q), sum(lens_k)
    q, do = rnd(tq, h, d, dtype=dtype, seed=1), rnd(tq, h, d, dtype=dtype, seed=2)
    k, v = rnd(tk, hk, d, dtype=dtype, seed=3), rnd(tk, hk, d, dtype=dtype, seed=4)
    cu = [torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32) for x in (lens_q, lens_k)]
    return q, k, v, do, *cu, max(lens_q), max(lens_k)


def varlen_reference(q, k, v, do, cu_q, cu_k, visible_of, scale, softcap=0.0):
    """Per sequence, the fp64 reference, packed back: out, lse [H, T], dq, dk, dv."""
    parts = []
    for qa, qb, ka, kb in zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:]):
        seq = [x[a:b].transpose(0, 1)[None] for x, a, b in ((q, qa, qb), (k, ka, kb), (v, ka, kb), (do, qa, qb))]
        parts.append(reference(*seq, visible_of(qb - qa, kb - ka), scale, softcap=softcap))
    out, lse, dq, dk, dv = ([p[i][0] for p in parts] for i in range(5))
    return (torch.cat([x.transpose(0, 1) for x in out]), torch.cat(lse, -1),
            *(torch.cat([x.transpose(0, 1) for x in g]) for g in (dq, dk, dv)))


@pytest.mark.parametrize("window", [(-1, -1), (2, 0)])
def test_aten_varlen_matches_reference(window):
    q, k, v, do, cu_q, cu_k, mq, mk = varlen_inputs()
    left, right = (None if w < 0 else w for w in window)
    out, lse, *_ = OPS["varlen"](q, k, v, cu_q, cu_k, mq, mk, 0.0, True, False, scale=0.3, window_size_left=left,
                                 window_size_right=right)
    grads = OPS["varlen_backward"](do, q, k, v, out, lse, cu_q, cu_k, mq, mk, 0.0, True, SEED, OFFSET, scale=0.3,
                                   window_size_left=left, window_size_right=right)
    ref = varlen_reference(q, k, v, do, cu_q, cu_k, lambda lq, lk: bottom_right(lq, lk, True, left, 0), 0.3)
    check_all((out, lse, *grads), ref, BF16)


def fa_round_trip(q, k, v, do, causal, softcap, window=(-1, -1)):
    out, lse, _, _ = fa._flash_attn_forward(q, k, v, 0.0, 0.3, causal, *window, softcap, None, False)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fa._flash_attn_backward(do, q, k, v, out, lse, dq, dk, dv, 0.0, 0.3, causal, *window, softcap, None, False, None)
    return out, lse, dq, dk, dv


@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("causal", [True, False])
def test_emulations_match_references(causal, softcap):
    """flash-attn's functions, dense (with softcap) and varlen."""
    q, k, v, do = qkv(sq=4, sk=6, layout="bshd")
    got = fa_round_trip(q, k, v, do, causal, softcap)
    ref = reference(*(x.transpose(1, 2) for x in (q, k, v, do)), bottom_right(4, 6, causal), 0.3, softcap=softcap)
    check_all((got[0].transpose(1, 2), got[1], *(g.transpose(1, 2) for g in got[2:])),
              (ref[0], ref[1], *ref[2:]), BF16)
    q, k, v, do, cu_q, cu_k, mq, mk = varlen_inputs()
    out, lse, _, _ = fa._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, mq, mk, 0.0, 0.3, causal, -1, -1, softcap,
                                                   None, False)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fa._flash_attn_varlen_backward(do, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, mq, mk, 0.0, 0.3, causal, -1, -1,
                                   softcap, None, False, None)
    ref = varlen_reference(q, k, v, do, cu_q, cu_k, lambda lq, lk: bottom_right(lq, lk, causal), 0.3, softcap)
    check_all((out, lse, dq, dk, dv), ref, BF16)


# -- (b) every check row: one call that violates it ----------------------------------------------------------------


def sdpa_flash_call(q=None, k=None, v=None, **kw):
    dq, dk, dv, _ = qkv(sq=4, sk=4)
    return OPS["flash"](dq if q is None else q, dk if k is None else k, dv if v is None else v, 0.0,
                        kw.pop("causal", False), kw.pop("debug", False), scale=0.3, **kw)


def sdpa_flash_bwd_call(dtype=BF16, d=8, out_dtype=None, dout_d=None):
    q, k, v, do = qkv(sq=4, sk=4, d=d, dtype=dtype)
    do = rnd(*do.shape[:-1], dout_d or d, dtype=dtype)
    out = torch.zeros_like(q, dtype=out_dtype or dtype)
    return af.flash_attention_backward(do.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2),
                                       v.transpose(1, 2), out.transpose(1, 2), torch.zeros(2, 4, 4), None, None,
                                       4, 4, 0.0, False, SEED, OFFSET, scale=0.3)


def varlen_call(cu_q=None, cu_k=None, both=True):
    q, k, v, _, cq, ck, mq, mk = varlen_inputs()
    return OPS["varlen"](q, k, v, cq if cu_q is None else cu_q, (ck if cu_k is None else cu_k) if both else None,
                         mq, mk, 0.0, False, False, scale=0.3)


def eff_call(q=None, k=None, v=None, bias=None, dtype=BF16, backward=False, lse=None, mask=MASK):
    dq, dk, dv, do = qkv(h=2, hk=2, sq=4, sk=4, dtype=dtype)
    q, k, v = (d if x is None else x for d, x in ((dq, q), (dk, k), (dv, v)))
    if not backward:
        return OPS["efficient"](q, k, v, bias, True, 0.0, False, scale=0.3)
    lse = torch.zeros(2, 2, 32) if lse is None else lse
    return OPS["efficient_backward"](do, q, k, v, bias, torch.zeros_like(q), lse, OFFSET, OFFSET, 0.0, mask, False,
                                     scale=0.3)


def strided(shape, strides, dtype=BF16, offset=0):
    size = offset + sum((s - 1) * st for s, st in zip(shape, strides)) + 1
    return torch.as_strided(torch.zeros(size, dtype=dtype), shape, strides, offset)


def fa_fwd_call(q=None, k=None, v=None, dropout=0.0, softcap=0.0, **kw):
    dq, dk, dv, _ = qkv(sq=4, sk=4, layout="bshd", **kw)
    return fa._flash_attn_forward(dq if q is None else q, dk if k is None else k, dv if v is None else v, dropout,
                                  0.3, False, -1, -1, softcap, None, False)


def fa_bwd_call(d=8, out=None, dq=None, dk=None, dtype=BF16):
    q, k, v, do = qkv(sq=4, sk=4, d=d, layout="bshd", dtype=dtype)
    out = torch.zeros_like(q) if out is None else out
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    return fa._flash_attn_backward(do, q, k, v, out, torch.zeros(2, 4, 4), dq, dk, torch.empty_like(v), 0.0, 0.3,
                                   False, -1, -1, 0.0, None, False, None)


def fa_varlen_call(cu_q=None, cu_k=None):
    q, k, v, _, cq, ck, mq, mk = varlen_inputs()
    return fa._flash_attn_varlen_forward(q, k, v, cq if cu_q is None else cu_q, ck if cu_k is None else cu_k, mq,
                                         mk, 0.0, 0.3, False, -1, -1, 0.0, None, False)


BIG_D = dict(d=264)
VIOLATIONS = {
    "aten.flash.schema": lambda: sdpa_flash_call(foo=1),
    "aten.flash.dtype": lambda: sdpa_flash_call(*qkv(dtype=F32)[:3]),
    "aten.flash.kv_dtype": lambda: sdpa_flash_call(k=qkv(sq=4, sk=4, dtype=F16)[1]),
    "aten.flash.out_dtype": lambda: sdpa_flash_bwd_call(out_dtype=F32),
    "aten.flash.last_dim": lambda: af.flash_attention_forward(*(x[..., ::2] for x in qkv(d=16, layout="bshd")[:3]),
                                                              None, None, 5, 5, 0.0, False, False),
    "aten.flash.head_mult8_fwd": lambda: sdpa_flash_call(*qkv(d=12)[:3]),
    "aten.flash.head_max_fwd": lambda: sdpa_flash_call(*qkv(**BIG_D)[:3]),
    "aten.flash.head_mult8_bwd": lambda: sdpa_flash_bwd_call(d=12),
    "aten.flash.head_og_bwd": lambda: sdpa_flash_bwd_call(d=16, dout_d=12),
    "aten.flash.gqa": lambda: sdpa_flash_call(*qkv(h=3, hk=2)[:3]),
    "aten.flash.kv_shape": lambda: sdpa_flash_call(k=rnd(1, 2, 4, 8), v=rnd(1, 2, 4, 8)),
    "aten.flash.kv_seqlen": lambda: sdpa_flash_call(v=rnd(2, 2, 5, 8)),
    "aten.flash.debug_mask": lambda: sdpa_flash_call(debug=True),
    "aten.flash.both_cu": lambda: varlen_call(both=False),
    "aten.flash.cu_dtype": lambda: varlen_call(cu_q=torch.tensor([0, 3, 8])),
    "aten.flash.cu_contiguous": lambda: varlen_call(cu_q=torch.tensor([0, 0, 3, 0, 8], dtype=torch.int32)[::2]),
    "aten.flash.cu_shape": lambda: varlen_call(cu_k=torch.tensor([0, 9], dtype=torch.int32)),
    "aten.efficient.schema": lambda: eff_call(backward=True, mask=[True, True, True]),
    "aten.efficient.dims": lambda: eff_call(q=rnd(2, 4, 8), k=rnd(2, 4, 8), v=rnd(2, 4, 8)),
    "aten.efficient.heads": lambda: eff_call(k=rnd(2, 1, 4, 8), v=rnd(2, 1, 4, 8)),
    "aten.efficient.kv_seqlen": lambda: eff_call(v=rnd(2, 2, 5, 8)),
    "aten.efficient.dtype": lambda: eff_call(*qkv(h=2, sq=4, sk=4, dtype=torch.float64)[:3]),
    "aten.efficient.last_dim": lambda: eff_call(q=rnd(2, 2, 4, 16)[..., ::2]),
    "aten.efficient.bias_dtype": lambda: eff_call(bias=torch.zeros(2, 2, 4, 8, dtype=F32)[..., :4]),
    "aten.efficient.bias_dim": lambda: eff_call(bias=torch.zeros(2, 4, 8)[..., :4].to(BF16)),
    "aten.efficient.bias_batch": lambda: eff_call(bias=torch.zeros(1, 2, 4, 8, dtype=BF16)[..., :4]),
    "aten.efficient.bias_heads": lambda: eff_call(bias=torch.zeros(2, 1, 4, 8, dtype=BF16)[..., :4]),
    "aten.efficient.bias_q": lambda: eff_call(bias=torch.zeros(2, 2, 5, 8, dtype=BF16)[..., :4]),
    "aten.efficient.bias_k": lambda: eff_call(bias=torch.zeros(2, 2, 4, 8, dtype=BF16)[..., :5]),
    "aten.efficient.bias_last": lambda: eff_call(bias=torch.zeros(2, 2, 8, 8, dtype=BF16)[:, :, :4, :4].mT),
    "aten.efficient.bias_align_fwd": lambda: eff_call(bias=strided((2, 2, 4, 4), (128, 64, 12, 1))),
    "aten.efficient.bias_align_bwd": lambda: eff_call(bias=strided((2, 2, 4, 4), (128, 64, 6, 1)), backward=True),
    "aten.efficient.launch_fwd": lambda: eff_call(q=rnd(2, 2, 5, 12)[:, :, :4, :8]),  # head stride 60
    "aten.efficient.launch_bwd": lambda: eff_call(q=rnd(2, 2, 5, 9)[:, :, :4, :8], backward=True),  # 45
    "aten.efficient.row_align": lambda: eff_call(q=rnd(2, 2, 4, 12)[..., :8]),  # head stride 48, row stride 12
    "aten.efficient.ptr_align": lambda: eff_call(q=rnd(2 * 2 * 4 * 8 + 1)[1:].view(2, 2, 4, 8)),
    "aten.efficient.lse_align": lambda: eff_call(backward=True, lse=torch.zeros(2, 2, 36)[..., :32]),
    "flash_attn.types": lambda: fa._flash_attn_forward(*qkv(layout="bshd")[:3], 0.0, 0.3, False, -1.0, -1, 0.0,
                                                       None, False),
    "flash_attn.dtype": lambda: fa_fwd_call(dtype=F32),
    "flash_attn.kv_dtype": lambda: fa_fwd_call(k=qkv(sq=4, sk=4, layout="bshd", dtype=F16)[1]),
    "flash_attn.out_dtype": lambda: fa_bwd_call(out=torch.zeros(2, 4, 4, 8, dtype=F32)),
    "flash_attn.head_mult8_fwd": lambda: fa_fwd_call(d=12),
    "flash_attn.head_max_fwd": lambda: fa_fwd_call(**BIG_D),
    "flash_attn.head_mult8_bwd": lambda: fa_bwd_call(d=12),
    "flash_attn.head_max_bwd": lambda: fa_bwd_call(**BIG_D),
    "flash_attn.gqa": lambda: fa_fwd_call(h=3, hk=2),
    "flash_attn.batch": lambda: fa_fwd_call(b=0),
    "flash_attn.kv_shape": lambda: fa_fwd_call(k=rnd(1, 4, 2, 8), v=rnd(1, 4, 2, 8)),
    "flash_attn.out_shape": lambda: fa_bwd_call(out=torch.zeros(2, 3, 4, 8, dtype=BF16)),
    "flash_attn.softcap_dropout": lambda: fa_fwd_call(dropout=0.1, softcap=2.0),
    "flash_attn.dq_dtype": lambda: fa_bwd_call(dq=torch.zeros(2, 4, 4, 8)),
    "flash_attn.dq_last_dim": lambda: fa_bwd_call(dq=torch.zeros(2, 4, 4, 16, dtype=BF16)[..., ::2]),
    "flash_attn.dk_shape": lambda: fa_bwd_call(dk=torch.zeros(2, 4, 4, 8, dtype=BF16)),
    "flash_attn.cu_dtype": lambda: fa_varlen_call(cu_q=torch.tensor([0, 3, 8])),
    "flash_attn.cu_contiguous": lambda: fa_varlen_call(cu_q=torch.tensor([0, 0, 3, 0, 8], dtype=torch.int32)[::2]),
    "flash_attn.cu_shape": lambda: fa_varlen_call(cu_k=torch.tensor([0, 9], dtype=torch.int32)),
}
CHECKS = [row for row in CONTRACT if row.kind == "check"]


@pytest.mark.parametrize("row", CHECKS, ids=lambda row: row.id)
def test_a_call_violating_a_check_row_raises_its_message(row):
    with pytest.raises(RuntimeError) as info:
        VIOLATIONS[row.id]()
    assert row.message in str(info.value), (row.message, str(info.value))
    assert isinstance(info.value, KernelError) or row.id == "flash_attn.types"  # the dispatcher's own error


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


def sdpa_flash_grads(q, k, v, do, out, lse, causal=False):
    return OPS["flash_backward"](do, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, SEED, OFFSET,
                                 scale=0.3)


def test_flash_backward_reads_lse_through_the_assumed_layout():
    q, k, v, do = qkv()
    out, lse, *_ = OPS["flash"](q, k, v, 0.0, False, False, scale=0.3)
    right = sdpa_flash_grads(q, k, v, do, out, lse)
    # the same values laid out [B, S, H]: the kernel reads that memory as if it were [B, H, S] contiguous
    permuted = lse.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(permuted, lse)
    got = sdpa_flash_grads(q, k, v, do, out, permuted)
    as_read = torch.as_strided(permuted, lse.shape, lse.stride()).clone()
    for g, r, w in zip(got, sdpa_flash_grads(q, k, v, do, out, as_read), right):
        assert torch.equal(g, r) and not torch.allclose(g.float(), w.float(), atol=1e-2)
    with pytest.raises(Undefined):  # a bf16 LSE: read as float, unchecked
        sdpa_flash_grads(q, k, v, do, out, lse.bfloat16())
    with pytest.raises(Undefined):  # a head-broadcast LSE: B * S floats where the kernel reads B * H * S
        sdpa_flash_grads(q, k, v, do, out, lse[:, :1].contiguous().expand(lse.shape))
    # flash-attn varlen: [H, total_q], given as a transposed [total_q, H]
    q, k, v, do, cu_q, cu_k, mq, mk = varlen_inputs()
    out, lse, _, _ = fa._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, mq, mk, 0.0, 0.3, False, -1, -1, 0.0, None,
                                                   False)
    grads = [[torch.empty_like(x) for x in (q, k, v)] for _ in range(2)]
    for g, l in zip(grads, (lse, lse.t().contiguous().t())):
        fa._flash_attn_varlen_backward(do, q, k, v, out, l, *g, cu_q, cu_k, mq, mk, 0.0, 0.3, False, -1, -1, 0.0,
                                       None, False, None)
    assert not torch.allclose(grads[0][0].float(), grads[1][0].float(), atol=1e-2)


def test_flash_strided_inputs_are_read_through_their_strides():
    q, k, v, do = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in qkv())  # BHSD views of BSHD memory
    ref = [OPS["flash"](*(x.contiguous() for x in (q, k, v)), 0.0, True, False, scale=0.3)[i] for i in (0, 1)]
    got = OPS["flash"](q, k, v, 0.0, True, False, scale=0.3)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    # aten's backward copies grad_out and out contiguous: any strides give the same grads
    g1 = sdpa_flash_grads(q, k, v, do, ref[0], ref[1], True)
    g2 = sdpa_flash_grads(q, k, v, do.contiguous(), ref[0].transpose(1, 2).contiguous().transpose(1, 2), ref[1], True)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    # flash-attn's wrapper copies a strided last dim (maybe_contiguous); aten's op refuses it
    qs, ks, vs, _ = qkv(d=16, layout="bshd")
    wide = [x[..., ::2] for x in (qs, ks, vs)]
    got = fa._flash_attn_forward(*wide, 0.0, 0.3, False, -1, -1, 0.0, None, False)
    want = fa._flash_attn_forward(*(x.contiguous() for x in wide), 0.0, 0.3, False, -1, -1, 0.0, None, False)
    assert torch.equal(got[0], want[0])
    with pytest.raises(KernelError, match="contiguous last dimension"):
        af.flash_attention_forward(*wide, None, None, 5, 5, 0.0, False, False)


def fa_varlen_fwd(q, k, v, cu_q, cu_k, mq, mk, causal, left, right):
    return fa._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, mq, mk, 0.0, 0.3, causal, left, right, 0.0, None,
                                         False)[:2]


def test_flash_window_rules():
    # left >= 0 > right: right becomes max_seqlen_k, not unbounded. Sequence 1 (6 queries, 2 keys, max_k 2):
    # row i sees keys j <= i + 2 - 6 + 2, so rows 0 and 1 see none (LSE +inf, out 0).
    q, k, v, _, cu_q, cu_k, mq, mk = varlen_inputs(lens_q=(2, 6), lens_k=(2, 2))
    out, lse = fa_varlen_fwd(q, k, v, cu_q, cu_k, mq, mk, False, 1, -1)
    rule = varlen_reference(q, k, v, q, cu_q, cu_k, lambda lq, lk: bottom_right(lq, lk, False, 1, mk), 0.3)
    assert torch.isinf(lse[:, 2:4]).all() and (lse[:, 2:4] > 0).all() and (out[2:4] == 0).all()
    finite = torch.isfinite(rule[1])
    assert torch.equal(finite, torch.isfinite(lse)) and torch.allclose(lse[finite], rule[1][finite].float())
    unbounded = varlen_reference(q, k, v, q, cu_q, cu_k, lambda lq, lk: bottom_right(lq, lk, False, 1, None), 0.3)
    assert torch.isfinite(unbounded[1]).all()
    # a window >= seqlen_k is no window; causal forces right to 0; aten's None is -1
    q, k, v, _ = qkv(sq=4, sk=4, layout="bshd")
    fwd = lambda causal, left, right: fa._flash_attn_forward(q, k, v, 0.0, 0.3, causal, left, right, 0.0, None,
                                                             False)[1]
    assert torch.equal(fwd(False, 4, -1), fwd(False, -1, -1)) and torch.equal(fwd(True, -1, 3), fwd(True, -1, -1))
    assert not torch.equal(fwd(False, 1, -1), fwd(False, -1, -1))
    q, k, v, _, cu_q, cu_k, mq, mk = varlen_inputs()
    aten = [OPS["varlen"](q, k, v, cu_q, cu_k, mq, mk, 0.0, True, False, scale=0.3, window_size_left=w)[1]
            for w in (None, -1, 2)]
    assert torch.equal(aten[0], aten[1]) and not torch.equal(aten[0], aten[2])


def test_flash_rows_without_keys_get_lse_plus_inf():
    q, k, v, _ = qkv(sq=4, sk=2)  # causal bottom-right: rows 0 and 1 see no key
    out, lse, *_ = OPS["flash"](q, k, v, 0.0, True, False, scale=0.3)
    assert (lse[..., :2] == INF).all() and (out[:, :, :2] == 0).all() and torch.isfinite(lse[..., 2:]).all()
    out, lse, _, _ = fa._flash_attn_forward(*qkv(sq=4, sk=2, layout="bshd")[:3], 0.0, 0.3, True, -1, -1, 0.0, None,
                                            False)
    assert (lse[..., :2] == INF).all() and (out[:, :2] == 0).all()


def test_flash_causal_is_bottom_right():
    q, k, v, do = qkv(sq=2, sk=4)
    out, lse, *_ = OPS["flash"](q, k, v, 0.0, True, False, scale=0.3)
    close(lse, reference(q, k, v, do, bottom_right(2, 4), 0.3)[1], 1e-5)
    top_left = reference(q, k, v, do, torch.ones(2, 4, dtype=torch.bool).tril(), 0.3)[1]
    assert not torch.allclose(lse.double(), top_left, atol=1e-3)


def test_flash_backward_takes_lse_minus_inf_as_zero():
    q, k, v, do = qkv()
    out, lse, *_ = OPS["flash"](q, k, v, 0.0, False, False, scale=0.3)
    minus_inf, zero = lse.clone(), lse.clone()
    minus_inf[0, 0, 1], zero[0, 0, 1] = -INF, 0.0
    a, b = sdpa_flash_grads(q, k, v, do, out, minus_inf), sdpa_flash_grads(q, k, v, do, out, zero)
    assert all(torch.equal(x, y) and torch.isfinite(x.float()).all() for x, y in zip(a, b))


def test_output_layouts():
    q, k, v, _ = qkv(sq=5, sk=3)
    out, lse, cq, ck, mq, mk, rng, unused, debug = OPS["flash"](q, k, v, 0.0, False, False, scale=0.3)
    assert out.shape == q.shape and out.dtype == BF16 and lse.shape == (2, 4, 5) and lse.dtype == F32
    assert (cq, ck, mq, mk) == (None, None, 5, 3) and rng.dtype == unused.dtype == torch.uint64
    assert rng.shape == (2,) and unused.shape == () and debug.numel() == 0
    vq, vk, vv, _, cu_q, cu_k, mq, mk = varlen_inputs()
    assert OPS["varlen"](vq, vk, vv, cu_q, cu_k, mq, mk, 0.0, False, False)[1].shape == (4, 8)
    assert fa_varlen_fwd(vq, vk, vv, cu_q, cu_k, mq, mk, False, -1, -1)[1].shape == (4, 8)
    f_out, f_lse, p, f_rng = fa._flash_attn_forward(*qkv(layout="bshd")[:3], 0.0, 0.3, False, -1, -1, 0.0, None, False)
    assert f_lse.shape == (2, 4, 5) and f_lse.dtype == F32 and p.numel() == 0 and f_rng.dtype == torch.int64
    q, k, v, _ = qkv(h=2, sq=33, sk=3)
    out, lse, seed, offset = OPS["efficient"](q, k, v, None, True, 0.0, False, scale=0.3)
    assert lse.shape == (2, 2, 64) and (lse[..., 33:] == INF).all() and torch.isfinite(lse[..., :33]).all()
    assert out.dtype == BF16 and out.shape == q.shape and out.transpose(1, 2).is_contiguous()  # BMHK memory
    assert OPS["efficient"](q, k, v, None, False, 0.0, False)[1].shape == (2, 2, 0)


def test_varlen_memory_outside_the_sequences_is_unwritten():
    q, k, v, _, _, _, _, mk = varlen_inputs(lens_q=(3, 5))  # 8 query tokens
    cu_q, cu_k = torch.tensor([0, 3, 6], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    out, lse, *_ = OPS["varlen"](q, k, v, cu_q, cu_k, 3, mk, 0.0, False, False)
    assert torch.isnan(out[6:]).all() and torch.isnan(lse[:, 6:]).all() and not torch.isnan(out[:6]).any()
    out, lse, *_ = OPS["varlen"](q, k, v, cu_q, cu_k, 2, mk, 0.0, False, False)  # max_q 2: row 2 of each skipped
    assert torch.isnan(lse[:, [2, 5]]).all() and not torch.isnan(lse[:, [0, 1, 3, 4]]).any()


def test_efficient_reads_other_dtypes_as_the_querys():
    with pytest.raises(Undefined):
        eff_call(k=rnd(2, 2, 4, 8, dtype=F16))
    q, k, v, do = qkv(h=2, sq=4, sk=4, dtype=F32)
    out, lse, s, o = OPS["efficient"](q, k, v, None, True, 0.0, False, scale=0.3)
    a = OPS["efficient_backward"](do, q, k, v, None, out, lse, s, o, 0.0, MASK, False, scale=0.3)
    b = OPS["efficient_backward"](do, q, k, v, None, out.bfloat16(), lse, s, o, 0.0, MASK, False, scale=0.3)
    assert all(torch.allclose(x, y, atol=1e-2) for x, y in zip(a[:3], b[:3]))  # fp32: out.to(float) in torch ops
    q, k, v, do = qkv(h=2, sq=4, sk=4)
    with pytest.raises(Undefined):  # fp16/bf16: the kernel reads out's bytes as the query's dtype
        OPS["efficient_backward"](do, q, k, v, None, out, lse, s, o, 0.0, MASK, False, scale=0.3)


def eff_grads(q, k, v, do, out, lse, bias=None, causal=False):
    return OPS["efficient_backward"](do, q, k, v, bias, out, lse, OFFSET, OFFSET, 0.0, MASK, causal, scale=0.3)


def test_efficient_backward_reads_out_rows_at_heads_times_dim():
    for dtype in (BF16, F32):
        q, k, v, do = qkv(h=2, hk=2, sq=4, sk=4, dtype=dtype)
        out, lse, *_ = OPS["efficient"](q, k, v, None, True, 0.0, False, scale=0.3)  # BMHK memory, as the op returns
        right = eff_grads(q, k, v, do, out, lse)
        check_all((out, lse[..., :4], *right[:3]), reference(q, k, v, do, torch.ones(4, 4, dtype=torch.bool), 0.3),
                  dtype)
        full = torch.zeros(2, 4, 6, 8, dtype=dtype)  # BHSD memory, sliced as the ring slices heads and rows
        full[:, :2, 1:5] = out
        view = full[:, :2, 1:5]
        got = eff_grads(q, k, v, do, view, lse)
        if dtype == F32:  # delta from torch ops, through the tensor's own strides
            assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got[:3], right[:3]))
            continue
        read = torch.as_strided(view, view.shape, (view.stride(0), view.stride(1), 2 * 8, 1), view.storage_offset())
        read_bmhk = torch.empty(2, 4, 2, 8, dtype=dtype).transpose(1, 2).copy_(read)  # a layout read as it is
        assert all(torch.equal(a, b) for a, b in zip(got[:3], eff_grads(q, k, v, do, read_bmhk, lse)[:3]))
        assert not torch.allclose(got[0].float(), right[0].float(), atol=5e-2)
        with pytest.raises(Undefined):  # BHSD-contiguous out: rows at stride 16 run past its end
            eff_grads(q, k, v, do, out.contiguous(), lse)


def test_efficient_backward_reads_lse_padding():
    q, k, v, do = qkv(h=2, hk=2, sq=5, sk=5)
    out, lse, *_ = OPS["efficient"](q, k, v, None, True, 0.0, False, scale=0.3)
    base = eff_grads(q, k, v, do, out, lse)
    assert all(torch.isfinite(g.float()).all() for g in base[:3])
    zero = lse.clone()
    zero[..., 5:] = 0.0
    assert all(torch.equal(a, b) for a, b in zip(eff_grads(q, k, v, do, out, zero)[:3], base[:3]))
    for bad in (float("nan"), -INF):
        poisoned = lse.clone()
        poisoned[0, 1, 7] = bad
        dq, dk, dv, _ = eff_grads(q, k, v, do, out, poisoned)
        assert torch.isnan(dk[0, 1]).all() and torch.isnan(dv[0, 1]).all() and torch.equal(dq, base[0])
        assert torch.equal(dk[1], base[1][1]) and torch.equal(dk[0, 0], base[1][0, 0])
    with pytest.raises(KernelError, match=r"LSE is not correctly aligned \(strideH\)"):  # unpadded: stride 5
        eff_grads(q, k, v, do, out, lse[..., :5].contiguous())
    q1, k1, v1, do1 = (x[:1, :1] for x in (q, k, v, do))
    with pytest.raises(Undefined):  # one (b, h): no stride check, but 32 rows are read from a 5-float LSE
        eff_grads(q1, k1, v1, do1, out[:1, :1], torch.tensor(lse[:1, :1, :5].tolist()))


def test_efficient_rows_without_keys_get_lse_zero():
    q, k, v, _ = qkv(h=2, hk=2, sq=4, sk=4)
    bias = torch.zeros(2, 2, 4, 8, dtype=BF16)[..., :4]
    bias[0, 1, 2] = -INF
    out, lse, *_ = OPS["efficient"](q, k, v, bias, True, 0.0, False, scale=0.3)
    assert lse[0, 1, 2] == 0 and (out[0, 1, 2] == 0).all() and (lse[..., :4] != 0).sum() == 2 * 2 * 4 - 1


def test_efficient_causal_is_top_left():
    q, k, v, do = qkv(h=2, hk=2, sq=2, sk=4, dtype=F32)
    out, lse, *_ = OPS["efficient"](q, k, v, None, True, 0.0, True, scale=0.3)
    close(lse[..., :2], reference(q, k, v, do, torch.ones(2, 4, dtype=torch.bool).tril(), 0.3)[1], 1e-6)
    assert not torch.allclose(lse[..., :2].double(), reference(q, k, v, do, bottom_right(2, 4), 0.3)[1], atol=1e-3)


def test_efficient_bias_may_be_an_expanded_view():
    q, k, v, do = qkv(h=2, hk=2, sq=4, sk=4)
    shared = torch.zeros(2, 1, 4, 8, dtype=BF16)[..., :4].copy_(rnd(2, 1, 4, 4, seed=5))
    expanded = shared.expand(2, 2, 4, 4)  # stride 0 over heads: only sizes are checked
    materialized = torch.zeros(2, 2, 4, 8, dtype=BF16)[..., :4].copy_(expanded)
    a = OPS["efficient"](q, k, v, expanded, True, 0.0, False, scale=0.3)
    b = OPS["efficient"](q, k, v, materialized, True, 0.0, False, scale=0.3)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    ga, gb = eff_grads(q, k, v, do, a[0], a[1], expanded), eff_grads(q, k, v, do, b[0], b[1], materialized)
    assert all(torch.equal(x, y) for x, y in zip(ga[:3], gb[:3]))
    with pytest.raises(KernelError, match=r"wrong shape \(head dimension\)"):  # [B, 1, M, N] is not broadcast
        OPS["efficient"](q, k, v, shared, True, 0.0, False, scale=0.3)


def test_flash_attn_backward_writes_into_the_given_buffers():
    q, k, v, do = qkv(sq=5, sk=5, layout="bshd")  # 4 query heads, 2 kv heads
    out, lse, _, _ = fa._flash_attn_forward(q, k, v, 0.0, 0.3, True, -1, -1, 0.0, None, False)
    big = torch.full((2, 7, 4, 8), 7.0, dtype=BF16)
    dq, dk, dv = big[:, 1:6], torch.empty_like(k), torch.empty_like(v)
    softmax_d = fa._flash_attn_backward(do, q, k, v, out, lse, dq, dk, dv, 0.0, 0.3, True, -1, -1, 0.0, None, False)
    assert (big[:, 0] == 7).all() and (big[:, 6] == 7).all()
    assert softmax_d.shape == (2, 4, 128) and softmax_d.dtype == F32
    ref = reference(*(x.transpose(1, 2) for x in (q, k, v, do)), bottom_right(5, 5), 0.3)
    for got, want in zip((dq, dk, dv), ref[2:]):
        close(got.transpose(1, 2), want, TOL[BF16])
    # GQA: dk is the group's sum of per-query-head grads, as an MHA call with k/v repeated gives them
    kr, vr = k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)
    dkr, dvr = torch.empty_like(kr), torch.empty_like(vr)
    fa._flash_attn_backward(do, q, kr, vr, out, lse, torch.empty_like(q), dkr, dvr, 0.0, 0.3, True, -1, -1, 0.0, None,
                            False)
    assert torch.equal(dk, dkr.float().unflatten(2, (2, 2)).sum(3).to(BF16))


def test_counted_counts_per_key():
    ops = Counted()
    q, k, v, _ = qkv()
    ops["flash"](q, k, v, 0.0, True, False, scale=0.3)
    assert ops.calls == {key: int(key == "flash") for key in OPS}
