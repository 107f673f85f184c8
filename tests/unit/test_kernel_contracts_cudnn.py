"""The emulation of aten's cuDNN attention (tests/emulation/aten_cudnn.py): (a) its math equals plain fp64
references, and (b) every contract row holds - a call that violates a "check" row (sdp_utils.cpp's rules, which the
ring keeps as SDPA would) raises PyTorch's message, and each "layout" and "semantics" row has a test below that fails
if the emulation read the tensor otherwise or masked by the obvious semantics (top-left causal, the bias, outputs).
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.emulation import aten_cudnn
from tests.emulation._common import KernelError, Undefined
from tests.unit.test_kernel_emulations import BF16, F16, F32, bottom_right, check_all, qkv, reference, rnd

CONTRACT = aten_cudnn.CONTRACT
SEED = torch.zeros((), dtype=torch.int64)
TOP_LEFT = lambda m, n: torch.ones(m, n, dtype=torch.bool).tril()  # noqa: E731


def cudnn(q, k, v, causal=False, bias=None, scale=0.3):
    out, lse, *rest = aten_cudnn.sdpa_cudnn(q, k, v, bias, True, 0.0, causal, False, scale=scale)
    return out, lse, rest


def cudnn_grads(do, q, k, v, out, lse, causal=False, bias=None, max_q=None, max_k=None):
    return aten_cudnn.sdpa_cudnn_backward(do, q, k, v, out, lse, SEED, SEED, bias, None, None,
                                          max_q or q.shape[2], max_k or k.shape[2], 0.0, causal, scale=0.3)


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("sq,sk,causal", [(5, 5, True), (3, 6, True), (6, 3, True), (5, 4, False)])
def test_cudnn_matches_reference(sq, sk, causal, dtype):
    q, k, v, do = qkv(sq=sq, sk=sk, dtype=dtype)
    out, lse, _ = cudnn(q, k, v, causal)
    grads = cudnn_grads(do, q, k, v, out, lse, causal)
    vis = TOP_LEFT(sq, sk) if causal else torch.ones(sq, sk, dtype=torch.bool)
    check_all((out, lse[..., 0], *grads), reference(q, k, v, do, vis, 0.3), dtype)


def _cudnn_bwd(**change):
    q, k, v, do = qkv(sq=4, sk=4)
    out, lse, _ = cudnn(q, k, v)
    args = {**dict(do=do, q=q, k=k, v=v, out=out, lse=lse), **change}
    return cudnn_grads(args["do"], args["q"], args["k"], args["v"], args["out"], args["lse"])


def _with_flag(flag, call):
    def run():
        before = torch.backends.cuda.cudnn_sdp_enabled()
        torch.backends.cuda.enable_cudnn_sdp(flag)
        try:
            return call()
        finally:
            torch.backends.cuda.enable_cudnn_sdp(before)
    return run


def _deterministic(call):
    def run():
        torch.use_deterministic_algorithms(True)
        try:
            return call()
        finally:
            torch.use_deterministic_algorithms(False)
    return run


def _on_arch(cap, call):
    def run():
        saved = aten_cudnn.TARGET["capability"]
        aten_cudnn.TARGET["capability"] = cap
        try:
            return call()
        finally:
            aten_cudnn.TARGET["capability"] = saved
    return run


def _mq(**kw):
    return qkv(sq=4, sk=4, **kw)[:3]


VIOLATIONS = {
    "aten.cudnn.schema": lambda: aten_cudnn.sdpa_cudnn(*_mq(), None, True, foo=1),
    "aten.cudnn.disabled": _with_flag(False, lambda: cudnn(*_mq())),
    "aten.cudnn.dims": lambda: cudnn(rnd(2, 4, 8), rnd(2, 4, 8), rnd(2, 4, 8)),
    "aten.cudnn.deterministic": _deterministic(lambda: cudnn(*_mq())),
    "aten.cudnn.dtype": lambda: cudnn(*_mq(dtype=F32)),
    "aten.cudnn.bias_grad": lambda: cudnn(*_mq(), bias=torch.zeros(2, 1, 4, 4, dtype=BF16).requires_grad_()),
    "aten.cudnn.bias_shape": lambda: cudnn(*_mq(), bias=torch.zeros(1, 4, 4, dtype=BF16)),
    "aten.cudnn.arch": _on_arch((7, 5), lambda: cudnn(*_mq())),
    "aten.cudnn.nonzero": lambda: cudnn(*qkv(sq=0, sk=4)[:3]),
    "aten.cudnn.last_dim": lambda: cudnn(*(x[..., ::2] for x in qkv(sq=4, sk=4, d=16)[:3])),
    "aten.cudnn.batch": lambda: cudnn(_mq()[0], *qkv(b=1, sq=4, sk=4)[1:3]),
    "aten.cudnn.gqa": lambda: cudnn(*qkv(h=3, hk=2, sq=4, sk=4)[:3]),
    "aten.cudnn.limits": lambda: cudnn(*qkv(b=65536, h=1, hk=1, sq=1, sk=2, d=8)[:3]),
    "aten.cudnn.head_max": lambda: cudnn(*qkv(sq=4, sk=4, d=136)[:3]),
    "aten.cudnn.head_mult8": lambda: cudnn(*qkv(sq=4, sk=4, d=12)[:3]),
    "aten.cudnn.seq_kv_1": lambda: cudnn(*qkv(sq=4, sk=1)[:3]),
    "aten.cudnn.alignment": lambda: cudnn(rnd(2 * 4 * 4 * 8 + 1)[1:].view(2, 4, 4, 8), *_mq()[1:]),
    "aten.cudnn.bwd_lse_shape": lambda: _cudnn_bwd(lse=torch.zeros(2, 4, 4)),
}
CHECKS = [row for row in CONTRACT if row.kind == "check"]


@pytest.mark.parametrize("row", CHECKS, ids=lambda row: row.id)
def test_a_call_violating_a_check_row_raises_its_message(row):
    with pytest.raises(RuntimeError) as info:
        VIOLATIONS[row.id]()
    assert row.message in str(info.value), (row.message, str(info.value))
    assert isinstance(info.value, KernelError) or row.id == "aten.cudnn.schema"


def test_every_row_is_covered():
    ids = [row.id for row in CONTRACT]
    assert len(ids) == len(set(ids))
    assert {row.id for row in CHECKS} == set(VIOLATIONS)
    here = sys.modules[__name__]
    for row in CONTRACT:
        assert row.kind in ("check", "layout", "semantics") and row.source and row.requires, row
        if row.kind != "check":
            assert callable(getattr(here, row.test, None)), f"{row.id}: no test {row.test}"


def test_cudnn_backward_reads_lse_as_fp32_through_its_strides():
    q, k, v, do = qkv()
    out, lse, _ = cudnn(q, k, v)
    right = cudnn_grads(do, q, k, v, out, lse)
    strided = torch.zeros(2, 4, 5, 2)[..., :1]  # the same values at another layout: read through the strides
    strided.copy_(lse)
    assert all(torch.equal(a, b) for a, b in zip(cudnn_grads(do, q, k, v, out, strided), right))
    with pytest.raises(Undefined):
        cudnn_grads(do, q, k, v, out, lse.bfloat16())


def test_cudnn_backward_builds_its_graph_from_max_q_and_max_k():
    q, k, v, do = qkv()
    out, lse, _ = cudnn(q, k, v)
    with pytest.raises(Undefined):
        cudnn_grads(do, q, k, v, out, lse, max_q=4)


def test_cudnn_causal_is_top_left():
    q, k, v, do = qkv(sq=2, sk=4)
    _, lse, _ = cudnn(q, k, v, causal=True)
    assert torch.allclose(lse[..., 0].double(), reference(q, k, v, do, TOP_LEFT(2, 4), 0.3)[1], atol=1e-5)
    assert not torch.allclose(lse[..., 0].double(), reference(q, k, v, do, bottom_right(2, 4), 0.3)[1], atol=1e-3)


def test_cudnn_bias_is_added_after_the_scale_and_all_minus_inf_rows_are_nan():
    q, k, v, do = qkv(sq=4, sk=4)
    bias = rnd(2, 1, 4, 4, seed=7)
    out, lse, _ = cudnn(q, k, v, bias=bias)
    ref = reference(q, k, v, do, torch.ones(4, 4, dtype=torch.bool), 0.3, bias=bias.expand(2, 4, 4, 4))
    check_all((out, lse[..., 0], *cudnn_grads(do, q, k, v, out, lse, bias=bias)), ref, BF16)
    blocked = torch.zeros(2, 1, 4, 4, dtype=BF16)
    blocked[0, 0, 1] = float("-inf")
    assert torch.isnan(cudnn(q, k, v, bias=blocked)[0][0, :, 1]).all()  # hence SDPA's -65504 (and the ring's)
    blocked[0, 0, 1] = -65504.0
    assert torch.isfinite(cudnn(q, k, v, bias=blocked)[0]).all()


def test_cudnn_outputs():
    q, k, v, _ = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in qkv(sq=5, sk=3))  # BSHD memory
    out, lse, (cq, ck, mq, mk, seed, offset, debug) = cudnn(q, k, v)
    assert out.shape == q.shape and out.dtype == BF16 and out.stride() == q.stride()  # q's stride order
    assert lse.shape == (2, 4, 5, 1) and lse.dtype == F32 and lse.is_contiguous()
    assert (cq, ck, mq, mk, debug) == (None, None, 5, 3, None) and seed.shape == offset.shape == ()
    do = torch.randn_like(out.float()).to(BF16)
    grads = cudnn_grads(do, q, k, v, out, lse)
    assert [g.stride() for g in grads] == [x.stride() for x in (q, k, v)]  # empty_like the inputs
