"""SEGMENTS tiles (cp/ring/segments.py): masked ring tiles in flash's varlen form, on CPU, against the
varlen kernels as tests/emulation/ emulates them from their sources (aten's `_flash_attention_forward/_backward` in
aten_flash.py, flash-attn 2.8.3's `_flash_attn_varlen_forward/_backward` in flash_attn.py, both on _flash.py).

1. The derivation: for every tile of packed, padded and sliding-window batches, the mask the segments mean under
   flash's own rules (each segment its own sequence; causal and the window aligned bottom-right; the window as
   `_flash.window` leaves it for the tile's max_seqlen_k, where `(left >= 0, -1)` means right = max_seqlen_k, not
   unbounded) is exactly the tile's dense mask, and every row of a segment sees a key (flash would give it LSE
   +inf). A tile the segments cannot say must stay DENSE.
2. The glue: both kernels' varlen paths (`CudaSdpaKernel` through aten's ops, `FlashAttnKernel` through
   flash-attn's) in bf16 and fp16, compared with the exact kernel on the dense tile: output, LSE (rows outside
   every segment -inf), dq, dk, dv, with GQA and a head dim that needs padding.
3. The real aten ops accept the calls under fake tensors (what a projection runs).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cpbench.cp.ring.cuda import CudaSdpaKernel
from cpbench.cp.ring.flash import FlashAttnKernel
from cpbench.cp.ring.kernels import TorchKernel, acc_dtype
from cpbench.cp.ring.masks import DENSE, SEGMENTS, TileMask, build_ring_masks
from tests.emulation import _flash
from tests.emulation.aten_sdpa import OPS
from tests.unit.test_ring_flash import FLASH_ATTN, HALF, as_ring_output, as_rows, tolerances

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
    # chunks of 11: the tile (11, 0) holds row 0's second document as 11 queries over 1 key (uncut) and row 1's
    # middle one as 8 over 8 (cut): flash's right = max_seqlen_k = 8 beside a left window would hide that key from
    # the first two of the 11 rows
    "window-packed-per-row": (None, _packed((10, 12), (3, 16, 3)), 12, 2),
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
    """The [B, 1, n, n] mask flash computes for the tile's segments: each run its own sequence, the window as
    mha_varlen_fwd/bwd leave it for the call's max_seqlen_k (the longest key run, as ring_segments packs them)."""
    seg = tile.segments
    max_q = max(qe - qs for _, qs, qe, _, _ in seg.runs)
    max_k = max(ke - ks for _, _, _, ks, ke in seg.runs)
    # the forward drops causal when max_seqlen_q == 1 and the backward does not: both must mean the same mask
    fwd = _flash.window(max_k, seg.causal, *seg.window, drop_causal=max_q == 1)
    bwd = _flash.window(max_k, seg.causal, *seg.window)
    out = torch.zeros(batch if seg.rows == 1 else seg.rows, 1, n, n, dtype=torch.bool)
    for row, qs, qe, ks, ke in seg.runs:
        visible = _flash.visible(qe - qs, ke - ks, fwd)
        assert torch.equal(visible, _flash.visible(qe - qs, ke - ks, bwd)), (seg, fwd, bwd)
        assert bool(visible.any(-1).all()), f"a row of run {(row, qs, qe, ks, ke)} sees no key: flash's LSE +inf"
        for r in range(batch) if seg.rows == 1 else (row,):
            out[r, 0, qs:qe, ks:ke] = visible
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


def test_a_window_shorter_than_the_tile_is_computed_as_its_band():
    # queries 20-29 against keys 10-19 with a window of 5: only queries 20-23 see a key, and only keys 16-19 are seen
    # (query q sees k when q - k < 5), so the tile is that 4 x 4 band, query i seeing band keys j >= i: flash's
    # (left 0, right max_seqlen_k) on a square run, where the whole 10 x 10 tile was a dense mask before
    lean = build_ring_masks(None, seq_len=40, padded_len=40, position_ids=None, sliding_window=5, varlen=True)
    dense = build_ring_masks(None, seq_len=40, padded_len=40, position_ids=None, sliding_window=5, varlen=False)
    tile = lean.tile(20, 10, 10)
    assert tile.kind == SEGMENTS and tile.segments.runs == ((0, 0, 4, 6, 10),) and tile.segments.window == (0, -1)
    assert torch.equal(segment_mask(tile, 1, 10), dense.tile(20, 10, 10).allowed)
    assert lean.tile(20, 0, 10).kind == "skip"  # keys 0-9: every one beyond the window of queries 20-29


def test_without_varlen_masked_tiles_stay_dense():
    assert all(lean.kind != SEGMENTS for _, _, _, lean in all_tiles("packed", 6))


# -- the kernels' glue ----------------------------------------------------------------------------------------------


def _segment_tiles(case: str, n: int):
    return [(lean, dense) for _, _, lean, dense in all_tiles(case, n) if lean.kind == SEGMENTS]


def _kernels():
    return {
        "aten": lambda softcap: CudaSdpaKernel(OPS),
        "flash-attn": lambda softcap: FlashAttnKernel(*FLASH_ATTN, softcap=softcap),
    }


def assert_close(got, ref, tol, what):
    """Relative to the reference's largest magnitude, or to 1 where it is smaller: a tile whose queries each see one
    key has dq = dk = 0 exactly (the softmax is constant), and the inputs are O(1)."""
    err = ((got.double() - ref.double()).abs().max() / max(ref.double().abs().max().item(), 1.0)).item()
    assert err <= tol, f"{what}: error {err:.3g} > {tol:.3g}"


def _run(kernel, tile, q, k, v, dout, ref_out, ref_lse):
    """Forward, then backward given the final output in the ring's layout, into views of pre-filled accumulators
    (the ring hands a kernel dq[:, :, rows]); returns the output, the LSE and what the backward added."""
    out, lse = kernel.forward(q, k, v, tile, 0.3)
    accs = [as_rows(torch.randn(x.shape, generator=torch.Generator().manual_seed(i)).to(acc_dtype(q.dtype)), i)
            for i, x in enumerate((q, k, v))]
    start = [whole.clone() for whole, _ in accs]
    kernel.backward(dout, q, k, v, as_ring_output(ref_out.to(q.dtype)), ref_lse, tile, 0.3,
                    *(view for _, view in accs))
    return out, lse, [(whole - s)[:, :, 1:-1] for (whole, _), s in zip(accs, start)]


@pytest.mark.parametrize("dtype", HALF, ids=str)
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
    if kv_heads < heads:  # gradients per query head rounded to the dtype; GQA sums two of them
        tol = {**tol, "lse_grads": 2 * tol["lse_grads"]}
    pairs = _segment_tiles(case, n)
    assert pairs
    for lean, dense in pairs:
        ref_out, ref_lse = exact.forward(q, k, v, dense, 0.3)
        out, lse, grads = _run(_kernels()[kernel](softcap), lean, q, k, v, dout, ref_out, ref_lse)
        _, _, ref_grads = _run(exact, dense, q, k, v, dout, ref_out, ref_lse)
        assert out.dtype == lse.dtype == acc_dtype(dtype) and out.shape == ref_out.shape
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "rows outside every segment: LSE -inf"
        finite = torch.isfinite(ref_lse)
        assert_close(lse[finite], ref_lse[finite], tol["lse"], "lse")
        assert_close(out, ref_out, tol["out"], "out")
        for got, ref, what in zip(grads, ref_grads, ("dq", "dk", "dv")):
            assert_close(got, ref, tol["lse_grads"], what)


def test_kernels_ask_for_segments_only_where_their_varlen_path_runs():
    bf16, fp32 = torch.zeros(1, 1, 1, 8, dtype=torch.bfloat16), torch.zeros(1, 1, 1, 8)
    assert CudaSdpaKernel().takes_segments(bf16) and not CudaSdpaKernel().takes_segments(fp32)
    assert not CudaSdpaKernel().takes_segments(torch.zeros(1, 1, 1, 320, dtype=torch.bfloat16))
    assert FlashAttnKernel(*FLASH_ATTN).takes_segments(bf16)
    assert not FlashAttnKernel(*FLASH_ATTN[:2]).takes_segments(bf16)  # no varlen pair given


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
