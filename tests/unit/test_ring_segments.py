"""SEGMENTS tiles (cpbench/cp/ring_segments.py): masked ring tiles in flash's varlen form, on CPU.

1. The derivation: for every tile of packed, padded and sliding-window batches, the mask the segments mean under
   flash's rules (each segment its own sequence; causal and the window aligned bottom-right; -1 unbounded) is
   exactly the tile's dense mask. A tile the segments cannot say must stay DENSE.
2. The glue: both kernels' varlen paths (aten's `_flash_attention_forward/_backward` with cu_seqlens for sdpa,
   flash-attn's `_flash_attn_varlen_forward/_backward`) against strict emulations of those functions, compared with
   the exact kernel on the dense tile: output, LSE (rows outside every segment -inf), dq, dk, dv, with GQA and a
   head dim that needs padding.
3. The real aten ops accept the calls under fake tensors (what a projection runs).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cpbench.cp.ring_cuda import CudaSdpaKernel
from cpbench.cp.ring_flash import FlashAttnKernel
from cpbench.cp.ring_kernels import TorchKernel, acc_dtype
from cpbench.cp.ring_masks import DENSE, SEGMENTS, TileMask, build_ring_masks
from tests.unit.test_ring_cuda import bind
from tests.unit.test_ring_flash import as_rows, flash_bwd, flash_fwd, tolerances

CPU_STAND_IN = torch.float32  # on CPU for fp16/bf16, which the flash kernels alone take


# -- the emulation: flash's varlen semantics, strictly --------------------------------------------------------------


def _visible(lq: int, lk: int, causal: bool, left: int, right: int) -> torch.Tensor:
    """[lq, lk] bool: query i sees key j when i + lk - lq - left <= j <= i + lk - lq + right (-1: unbounded;
    causal makes right 0), flash's bottom-right alignment."""
    right = 0 if causal else right
    i = torch.arange(lq)[:, None] + lk - lq
    j = torch.arange(lk)[None, :]
    ok = torch.ones(lq, lk, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def _sequences(q, k, cu_q, cu_k, max_q, max_k):
    assert q.dim() == k.dim() == 3 and q.shape[-1] == k.shape[-1] and q.shape[1] % k.shape[1] == 0, (q.shape, k.shape)
    assert q.dtype in (torch.float16, torch.bfloat16, CPU_STAND_IN) and q.dtype == k.dtype
    assert q.shape[-1] % 8 == 0 and q.shape[-1] <= 256, f"head dim {q.shape[-1]}"
    assert all(x.stride(-1) == 1 for x in (q, k))
    for cu, total, longest in ((cu_q, q.shape[0], max_q), (cu_k, k.shape[0], max_k)):
        assert cu.dtype == torch.int32 and cu.dim() == 1 and cu[0] == 0 and cu[-1] == total, cu
        lens = cu.diff()
        assert bool((lens > 0).all()) and int(lens.max()) == longest, (cu, longest)
    assert cu_q.numel() == cu_k.numel()
    return list(zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:]))


def _scores(q, k, scale, softcap, visible):
    """[H, lq, lk] fp32 from [l, H, D] tokens (kv heads repeated), capped, masked."""
    kh = k.float().repeat_interleave(q.shape[1] // k.shape[1], 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kh) * scale
    raw = s
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    return s.masked_fill(~visible, float("-inf")), raw


def emulated_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, left, right, scale, softcap=0.0):
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
    for qa, qb, ka, kb in _sequences(q, k, cu_q, cu_k, max_q, max_k):
        visible = _visible(qb - qa, kb - ka, causal, left, right)
        assert bool(visible.any(-1).all()), "a row sees no key: flash would return LSE +inf for it"
        s, _ = _scores(q[qa:qb], k[ka:kb], scale, softcap, visible)
        lse[:, qa:qb] = torch.logsumexp(s, -1)
        vh = v[ka:kb].float().repeat_interleave(q.shape[1] // v.shape[1], 1)
        out[qa:qb] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vh).to(q.dtype)
    return out, lse


def emulated_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, left, right, scale, softcap=0.0):
    """P from the LSE given (the ring's merged one), as flash's backward does."""
    assert lse.dtype == torch.float32 and lse.shape == (q.shape[1], q.shape[0]) and lse.is_contiguous(), lse.shape
    assert out.dtype == dout.dtype == q.dtype and out.shape == dout.shape == q.shape
    g = q.shape[1] // k.shape[1]
    dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32) for x in (q, k, v))
    for qa, qb, ka, kb in _sequences(q, k, cu_q, cu_k, max_q, max_k):
        s, raw = _scores(q[qa:qb], k[ka:kb], scale, softcap, _visible(qb - qa, kb - ka, causal, left, right))
        p = torch.exp(s - lse[:, qa:qb, None])
        do, o = dout[qa:qb].float(), out[qa:qb].float()
        vh = v[ka:kb].float().repeat_interleave(g, 1)
        kh = k[ka:kb].float().repeat_interleave(g, 1)
        dvh = torch.einsum("hqk,qhd->khd", p, do)
        ds = p * (torch.einsum("qhd,khd->hqk", do, vh) - (do * o).sum(-1).T[:, :, None])
        if softcap:
            ds = ds * (1 - torch.tanh(raw / softcap) ** 2)
        dq[qa:qb] = torch.einsum("hqk,khd->qhd", ds, kh) * scale
        dkh = torch.einsum("hqk,qhd->khd", ds, q[qa:qb].float()) * scale
        dk[ka:kb] = dkh.unflatten(1, (-1, g)).sum(2)
        dv[ka:kb] = dvh.unflatten(1, (-1, g)).sum(2)
    return tuple(x.to(q.dtype) for x in (dq, dk, dv))


def aten_varlen(*args, **kwargs):
    a = bind("varlen", args, kwargs)
    assert a["dropout_p"] == 0.0 and a["return_debug_mask"] is False and a["cum_seq_q"] is not None
    window = [a.get(f"window_size_{side}") for side in ("left", "right")]
    assert all(w is None or (type(w) is int and w >= 0) for w in window), f"aten wants None for unbounded: {window}"
    left, right = (-1 if w is None else w for w in window)
    out, lse = emulated_forward(a["query"], a["key"], a["value"], a["cum_seq_q"], a["cum_seq_k"], a["max_q"],
                                a["max_k"], a["is_causal"], left, right, a["scale"])
    return out, lse, torch.zeros(2, dtype=torch.int64), torch.zeros((), dtype=torch.int64), torch.empty(0)


def aten_varlen_backward(*args, **kwargs):
    a = bind("varlen_backward", args, kwargs)
    assert a["dropout_p"] == 0.0
    left, right = (-1 if a.get(f"window_size_{s}") is None else a[f"window_size_{s}"] for s in ("left", "right"))
    return emulated_backward(a["grad_out"], a["query"], a["key"], a["value"], a["out"], a["logsumexp"],
                             a["cum_seq_q"], a["cum_seq_k"], a["max_q"], a["max_k"], a["is_causal"], left, right,
                             a["scale"])


def flash_attn_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, window_size_left,
                          window_size_right, softcap, alibi_slopes, return_softmax):
    assert dropout_p == 0.0 and alibi_slopes is None and return_softmax is False and type(softcap) is float
    out, lse = emulated_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, window_size_left, window_size_right,
                                softmax_scale, softcap)
    return out, lse, None, None


def flash_attn_varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, dropout_p,
                          softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
                          deterministic, rng_state):
    assert dropout_p == 0.0 and alibi_slopes is None and deterministic is False
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape  # written in place
    grads = emulated_backward(dout, q, k, v, out, softmax_lse, cu_q, cu_k, max_q, max_k, causal, window_size_left,
                              window_size_right, softmax_scale, softcap)
    for buf, g in zip((dq, dk, dv), grads):
        buf.copy_(g)


ATEN_OPS = {"varlen": torch.ops.aten._flash_attention_forward.default,
            "varlen_backward": torch.ops.aten._flash_attention_backward.default}
EMULATED = {"varlen": aten_varlen, "varlen_backward": aten_varlen_backward}


@pytest.fixture(autouse=True)
def _aten_schemas(monkeypatch):
    from tests.unit import test_ring_cuda

    monkeypatch.setitem(test_ring_cuda.ATEN, "varlen", ATEN_OPS["varlen"])
    monkeypatch.setitem(test_ring_cuda.ATEN, "varlen_backward", ATEN_OPS["varlen_backward"])


# -- batches and their tiles ----------------------------------------------------------------------------------------

S = 22


def _packed(*lengths_per_row):
    return torch.tensor([[p for n in row for p in range(n)] for row in lengths_per_row])


def _padding(*spans):
    """2-D masks: per row, (left pad, right pad)."""
    return torch.tensor([[0] * a + [1] * (S - a - b) + [0] * b for a, b in spans])


CASES = {  # name: (attention_mask, position_ids, sliding window, batch)
    "packed": (None, _packed((5, 9, 3, 5)), None, 2),  # one row of documents, broadcast over the batch
    "packed-per-row": (None, _packed((5, 9, 3, 5), (12, 10)), None, 2),
    "left-padded": (_padding((3, 0), (7, 0)), None, None, 2),
    "right-padded": (_padding((0, 4), (0, 0)), None, None, 2),
    "window": (None, None, 5, 2),
    "wide-window": (None, None, 9, 1),
    "window-packed": (None, _packed((5, 9, 3, 5)), 4, 1),
}


def masks_of(case: str, padded_len: int, varlen: bool):
    mask, positions, window, _ = CASES[case]
    return build_ring_masks(mask, seq_len=S, padded_len=padded_len, position_ids=positions, sliding_window=window,
                            varlen=varlen)


def all_tiles(case: str, n: int):
    """(q0, k0, SEGMENTS-or-not tile, dense tile) for every chunk pair of a layout with chunks of n tokens."""
    padded = -(-S // n) * n
    lean, dense = masks_of(case, padded, True), masks_of(case, padded, False)
    for q0 in range(0, padded, n):
        for k0 in range(0, padded, n):
            yield q0, k0, lean.tile(q0, k0, n), dense.tile(q0, k0, n)


def segment_mask(tile: TileMask, batch: int, n: int) -> torch.Tensor:
    seg = tile.segments
    out = torch.zeros(batch if seg.rows == 1 else seg.rows, 1, n, n, dtype=torch.bool)
    for row, qs, qe, ks, ke in seg.runs:
        rows = range(batch) if seg.rows == 1 else (row,)
        for r in rows:
            out[r, 0, qs:qe, ks:ke] = _visible(qe - qs, ke - ks, seg.causal, *seg.window)
    return out


@pytest.mark.parametrize("n", [4, 6, 11])
@pytest.mark.parametrize("case", sorted(CASES))
def test_segments_mean_exactly_the_dense_mask(case, n):
    batch = CASES[case][3]
    kinds = []
    for q0, k0, lean, dense in all_tiles(case, n):
        if dense.kind != DENSE:
            assert lean.kind == dense.kind, (q0, k0)  # only masked tiles change form
            continue
        kinds.append(lean.kind)
        if lean.kind == SEGMENTS:
            want = dense.allowed.expand(batch, 1, n, n)
            assert torch.equal(segment_mask(lean, batch, n), want), (case, n, q0, k0, lean.segments)
        else:
            assert lean.kind == DENSE and lean.segments is None
    if (case, n) == ("right-padded", 11):  # its one masked tile is diagonal with queries past the last valid key
        assert kinds == [DENSE]
    else:
        assert SEGMENTS in kinds, f"{case}: no masked tile became segments: {kinds}"
    if case == "window-packed" and n == 6:  # a window cutting a packed tile has no single flash window
        assert DENSE in kinds


def test_without_varlen_masked_tiles_stay_dense():
    assert all(lean.kind != SEGMENTS for _, _, _, lean in all_tiles("packed", 6))


# -- the kernels' glue ----------------------------------------------------------------------------------------------


def _segment_tiles(case: str, n: int):
    return [(lean, dense) for _, _, lean, dense in all_tiles(case, n) if lean.kind == SEGMENTS]


def _kernels():
    return {
        "aten": lambda softcap: CudaSdpaKernel(EMULATED),
        "flash-attn": lambda softcap: FlashAttnKernel(flash_fwd, flash_bwd, flash_attn_varlen_fwd,
                                                      flash_attn_varlen_bwd, softcap=softcap),
    }


def assert_close(got, ref, tol, what):
    """Relative to the reference's largest magnitude, or to 1 where it is smaller: a tile whose queries each see one
    key has dq = dk = 0 exactly (the softmax is constant), and the inputs are O(1)."""
    err = ((got.double() - ref.double()).abs().max() / max(ref.double().abs().max().item(), 1.0)).item()
    assert err <= tol, f"{what}: error {err:.3g} > {tol:.3g}"


def _run(kernel, tile, q, k, v, dout, ref_out, ref_lse):
    """Forward, then backward into views of pre-filled accumulators (the ring hands a kernel dq[:, :, rows]);
    returns the output, the LSE and what the backward added."""
    out, lse = kernel.forward(q, k, v, tile, 0.3)
    accs = [as_rows(torch.randn(x.shape, generator=torch.Generator().manual_seed(i)).to(acc_dtype(q.dtype)), i)
            for i, x in enumerate((q, k, v))]
    start = [whole.clone() for whole, _ in accs]
    kernel.backward(dout, q, k, v, ref_out.to(q.dtype), ref_lse, tile, 0.3, *(view for _, view in accs))
    return out, lse, [(whole - s)[:, :, 1:-1] for (whole, _), s in zip(accs, start)]


@pytest.mark.parametrize("dtype", [CPU_STAND_IN, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kernel", ["aten", "flash-attn"])
@pytest.mark.parametrize("case,kv_heads,head_dim,softcap", [
    ("packed-per-row", 2, 8, None), ("left-padded", 4, 12, None), ("window", 2, 8, None), ("packed", 2, 8, 2.0),
])
def test_varlen_glue_matches_the_exact_kernel_on_the_dense_tile(case, kv_heads, head_dim, softcap, kernel, dtype):
    if kernel == "aten" and softcap:
        pytest.skip("soft-capped models never reach the sdpa kernel (the selector sends them to TorchKernel)")
    batch, heads, n = CASES[case][3], 4, 6
    g = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(batch, heads, n, head_dim, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(batch, kv_heads, n, head_dim, generator=g).to(dtype) for _ in range(2))
    exact = TorchKernel(softcap)
    tol = tolerances(dtype)
    if dtype == torch.bfloat16:  # bf16 gradients per query head; GQA sums two of them
        tol = {"out": tol["out"], "lse_grads": 2 * tol["lse_grads"]}
    pairs = _segment_tiles(case, n)
    assert pairs
    for lean, dense in pairs:
        ref_out, ref_lse = exact.forward(q, k, v, dense, 0.3)
        out, lse, grads = _run(_kernels()[kernel](softcap), lean, q, k, v, dout, ref_out, ref_lse)
        _, _, ref_grads = _run(exact, dense, q, k, v, dout, ref_out, ref_lse)
        assert out.dtype == lse.dtype == acc_dtype(dtype) and out.shape == ref_out.shape
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "rows outside every segment: LSE -inf"
        finite = torch.isfinite(ref_lse)
        assert_close(lse[finite], ref_lse[finite], 64 * torch.finfo(torch.float32).eps, "lse")
        assert_close(out, ref_out, tol["out"], "out")
        for got, ref, what in zip(grads, ref_grads, ("dq", "dk", "dv")):
            assert_close(got, ref, tol["lse_grads"], what)


def test_kernels_ask_for_segments_only_where_their_varlen_path_runs():
    bf16, fp32 = torch.zeros(1, 1, 1, 8, dtype=torch.bfloat16), torch.zeros(1, 1, 1, 8)
    assert CudaSdpaKernel.takes_segments(bf16) and not CudaSdpaKernel.takes_segments(fp32)
    assert not CudaSdpaKernel.takes_segments(torch.zeros(1, 1, 1, 320, dtype=torch.bfloat16))
    assert FlashAttnKernel(flash_fwd, flash_bwd, flash_attn_varlen_fwd, flash_attn_varlen_bwd).takes_segments(bf16)
    assert not FlashAttnKernel(flash_fwd, flash_bwd).takes_segments(bf16)  # no varlen pair given


def test_the_real_aten_ops_accept_the_varlen_calls_under_fake_tensors():
    (lean, _), *_ = _segment_tiles("packed-per-row", 6)
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(2, 4, 6, 12, dtype=torch.bfloat16)
        k = torch.empty(2, 2, 6, 12, dtype=torch.bfloat16)
        kernel = CudaSdpaKernel()
        out, lse = kernel.forward(q, k, k, lean, 0.3)
        dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32) for x in (q, k, k))
        kernel.backward(q, q, k, k, out, lse, lean, 0.3, dq, dk, dv)
        assert out.shape == q.shape and lse.shape == q.shape[:3] and dk.shape == k.shape
