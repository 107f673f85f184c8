"""FlashAttnKernel's glue (cp/ring/flash.py), on CPU, against flash-attn 2.8.3's private functions as
tests/emulation/flash_attn.py emulates them from the kernels' sources (no GPU needed).

The emulation takes `_flash_attn_forward` / `_flash_attn_backward` exactly as flash-attn registers them (torch custom
ops with the real signatures), makes the C++ host code's checks (fp16/bf16 only, head dims multiples of 8 up to 256,
k/v at the kv head count, dq/dk/dv buffers written in place) and reads the LSE through the layout the kernel assumes;
tests/unit/test_kernel_emulations.py pins it. Here: FULL and CAUSAL tiles through flash-attn and DENSE ones through
the fallback, in bf16 and fp16, equal the exact `TorchKernel` on the same tile (out, LSE, dq, dk, dv), with GQA,
soft-capping and head dims that need padding; the backward gets the final output laid out as the ring keeps it.
Also: which flash-attn versions are taken, and when the ring picks this kernel at all (GPU capability, dtype).

The helpers `run_kernel`, `tiles`, `tolerances`, `assert_close` are shared with test_ring_cuda.py and
test_ring_segments.py.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from cpbench.cp.ring import flash as ring_flash
from cpbench.cp.ring.cuda import CudaSdpaKernel
from cpbench.cp.ring.flash import FlashAttnKernel, flash_kernel_or_none
from cpbench.cp.ring.kernels import CpuSdpaKernel, TorchKernel, acc_dtype
from cpbench.cp.ring.masks import CAUSAL, DENSE, FULL, TileMask
from cpbench.cp.ring.select import select_kernel
from tests.emulation.flash_attn import FUNCTIONS

B, H, Q, D = 2, 4, 6, 8
SCALE = D**-0.5
HALF = (torch.bfloat16, torch.float16)  # the only dtypes flash kernels take
# flash-attn's four private functions, in the order `ring_flash._flash_ops` returns them
FLASH_ATTN = tuple(FUNCTIONS[key] for key in ("fwd", "bwd", "varlen_fwd", "varlen_bwd"))


class Counted:
    """Positional calls only (the glue's argument order must be flash-attn's), counted."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


def tiles():
    allowed = torch.rand(B, 1, Q, Q, generator=torch.Generator().manual_seed(0)) > 0.4
    allowed[0, 0, 2] = False  # a row that sees no key
    return {"full": TileMask(FULL), "causal": TileMask(CAUSAL), "dense": TileMask(DENSE, allowed)}


# Relative to the largest reference magnitude. The reference (TorchKernel) and the emulated kernels both compute in
# fp32 from the same inputs; fp16/bf16 kernels round out and each dq/dk/dv to the input dtype once (<= 0.5 eps of the
# largest value, measured), so 2 eps of the dtype leaves room while a glue mistake (a wrong head, row, mask or scale)
# is O(0.1). The LSE is fp32 by contract on both sides: 64 fp32 eps. fp32 (the efficient kernel's, in
# test_ring_cuda.py): the same sums in another order, 64 fp32 eps.
def tolerances(dtype):
    f32 = torch.finfo(torch.float32).eps
    if dtype in HALF:
        eps = torch.finfo(dtype).eps
        return {"out": 2 * eps, "lse": 64 * f32, "lse_grads": 2 * eps}
    return {"out": 64 * f32, "lse": 64 * f32, "lse_grads": 64 * f32}


def assert_close(got, ref, tol, what):
    err = ((got.double() - ref.double()).abs().max() / ref.double().abs().max()).item()
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"


def as_rows(x, seed=0):
    """(whole, view): `x` as rows 1..n of a tensor two rows longer along dim 2 whose other rows are random, and the
    strided view of those rows, as the ring hands a kernel q[:, :, rows], lse[:, :, rows] and dq[:, :, rows]."""
    whole = torch.randn(*x.shape[:2], x.shape[2] + 2, *x.shape[3:], generator=torch.Generator().manual_seed(seed))
    whole = whole.to(x.dtype)
    whole[:, :, 1:-1] = x
    return whole, whole[:, :, 1:-1]


def as_ring_output(x, seed=0):
    """`x` [B, H, n, D] as the ring hands a kernel's backward its saved output: rows 1..n of a longer sequence in
    [B, S, H, D] memory viewed as [B, H, S, D] (ring._forward allocates it so, for the model's o_proj). A kernel that
    assumes another row stride reads other rows here (see test_ring_contracts.py, bug 1)."""
    whole, _ = as_rows(x, seed)
    return whole.transpose(1, 2).contiguous().transpose(1, 2)[:, :, 1:-1]


def run_kernel(kernel, q, k, v, dout, tile, ref_tile=None):
    """Forward, then backward given the exact kernel's final out (in the query's dtype and the ring's layout) and
    LSE on `ref_tile` (the same mask as `tile` in the form TorchKernel takes; default `tile`), adding into views of
    pre-filled accumulators. Returns out, LSE and the accumulators' whole tensors."""
    inputs = [as_rows(x)[1] for x in (q, k, v)]
    out, lse = kernel.forward(*inputs, tile, SCALE)
    ref_out, ref_lse = TorchKernel(kernel.softcap).forward(q, k, v, ref_tile or tile, SCALE)
    final = as_ring_output(ref_out.to(q.dtype))
    assert final.stride(2) == q.shape[1] * q.shape[-1]  # rows at the stride of all heads, as in the ring
    accs = [as_rows(torch.randn(x.shape, generator=torch.Generator().manual_seed(i)).to(acc_dtype(q.dtype)), i)
            for i, x in enumerate((q, k, v))]
    kernel.backward(as_rows(dout)[1], *inputs, final, as_rows(ref_lse)[1], tile, SCALE, *(view for _, view in accs))
    return out, lse, [whole for whole, _ in accs]


def check_against_exact(kernel, q, k, v, dout, tile, tol, ref_tile=None) -> None:
    """`kernel` on one tile equals TorchKernel on it (on `ref_tile`, the same mask DENSE, where `tile` is SEGMENTS):
    out, LSE (-inf exactly where the reference has it), and the whole accumulators dq, dk, dv (the rows outside the
    views stay as they were on both sides)."""
    ref_tile = ref_tile or tile
    out, lse, accs = run_kernel(kernel, q, k, v, dout, tile, ref_tile)
    ref_out, ref_lse, ref_accs = run_kernel(TorchKernel(kernel.softcap), q, k, v, dout, ref_tile)
    assert out.dtype == lse.dtype == acc_dtype(q.dtype) and out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert_close(out, ref_out, tol["out"], "out")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)) and not lse.isnan().any()
    finite = torch.isfinite(ref_lse)
    assert_close(lse[finite], ref_lse[finite], tol["lse"], "lse")
    for got, ref, what in zip(accs, ref_accs, ("dq", "dk", "dv")):
        assert_close(got, ref, tol["lse_grads"], what)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("kv_heads", [H, 2])
@pytest.mark.parametrize("name", ["full", "causal", "dense"])
def test_flash_kernel_glue_matches_torch_kernel(name, kv_heads, softcap, dtype):
    flash_serves = name != "dense"  # DENSE tiles go to the fallback (TorchKernel here)
    assert check_glue(name, kv_heads, softcap, dtype, D) == ((1, 1) if flash_serves else (0, 0))


def check_glue(name, kv_heads, softcap, dtype, head_dim) -> tuple[int, int]:
    """Asserts FlashAttnKernel's results equal TorchKernel's on one tile; returns the flash-attn calls made."""
    g = torch.Generator().manual_seed(1)
    q, dout = (torch.randn(B, H, Q, head_dim, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(B, kv_heads, Q, head_dim, generator=g).to(dtype) for _ in range(2))
    fwd, bwd = Counted(FUNCTIONS["fwd"]), Counted(FUNCTIONS["bwd"])
    tol = tolerances(dtype)
    if kv_heads < H:  # flash-attn rounds each query head's dk/dv to the dtype, then sums the group and rounds again
        tol = {**tol, "lse_grads": 2 * tol["lse_grads"]}
    check_against_exact(FlashAttnKernel(fwd, bwd, softcap=softcap), q, k, v, dout, tiles()[name], tol)
    return fwd.calls, bwd.calls


@pytest.mark.parametrize("head_dim", [6, 264])
def test_head_dims_flash_attn_cannot_take_are_padded_or_left_to_torch(head_dim):
    # 6: zero-padded to 8 and cut back, as flash-attn's own autograd functions do (its C++ refuses 6); 264 > 256:
    # TorchKernel.
    assert check_glue("causal", 2, None, torch.bfloat16, head_dim) == ((1, 1) if head_dim <= 256 else (0, 0))


# -- which flash-attn is taken, and when -----------------------------------------------------------------------------


def _fake_flash_attn(monkeypatch, fwd):
    """A `flash_attn` package whose interface holds `fwd` and the emulated backward and varlen pair."""
    package, interface = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.flash_attn_interface")
    interface._flash_attn_forward = fwd
    (interface._flash_attn_backward, interface._flash_attn_varlen_forward,
     interface._flash_attn_varlen_backward) = FLASH_ATTN[1:]
    package.flash_attn_interface = interface
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)


def _old_fwd(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax):
    raise AssertionError("never called")  # flash-attn <= 2.6's signature: one window_size tuple


def test_flash_ops_accepts_flash_attn_2_7_and_refuses_older(monkeypatch):
    # flash-attn >= 2.7 registers its functions as torch custom ops on torch >= 2.4 (whose own signature is
    # (*args, **kwargs)) and leaves them plain functions on older torch: both are read for window_size_left.
    for fwd in (FUNCTIONS["fwd"], FUNCTIONS["fwd"]._init_fn):
        _fake_flash_attn(monkeypatch, fwd)
        assert ring_flash._flash_ops() == (fwd, *FLASH_ATTN[1:])
    _fake_flash_attn(monkeypatch, _old_fwd)
    with pytest.raises(ValueError, match=r"flash-attn >= 2\.7.*attn_implementation='sdpa'"):
        ring_flash._flash_ops()


def test_flash_ops_is_none_without_flash_attn(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # a None entry makes the import raise ImportError
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", None)
    assert ring_flash._flash_ops() is None


def query(device, dtype):
    # flash_kernel_or_none reads only the query's device type and dtype: a stand-in reaches its CUDA branches.
    return types.SimpleNamespace(device=torch.device(device), dtype=dtype)


def test_flash_kernel_only_for_cuda_half_precision(monkeypatch):
    monkeypatch.setattr(ring_flash, "_flash_ops", lambda: FLASH_ATTN)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert isinstance(flash_kernel_or_none(query("cuda", torch.bfloat16), 2.0), FlashAttnKernel)
    assert flash_kernel_or_none(query("cuda", torch.bfloat16), 2.0).softcap == 2.0
    # tiles flash-attn cannot take: the fused sdpa kernels, or the exact one under soft-capping
    assert isinstance(flash_kernel_or_none(query("cuda", torch.bfloat16), None)._fallback, CudaSdpaKernel)
    assert isinstance(flash_kernel_or_none(query("cuda", torch.bfloat16), 2.0)._fallback, TorchKernel)
    assert flash_kernel_or_none(query("cuda", torch.float32), None) is None
    assert flash_kernel_or_none(query("cpu", torch.bfloat16), None) is None
    assert flash_kernel_or_none(torch.zeros(1, 1, 1, 8), None) is None
    assert isinstance(select_kernel("flash_attention_2", torch.zeros(1, 1, 1, 8)), CpuSdpaKernel)
    assert isinstance(select_kernel("flash_attention_2", torch.zeros(1, 1, 1, 8), softcap=2.0), TorchKernel)


def test_gpus_below_ampere_get_no_flash_kernel(monkeypatch):
    """flash-attn 2 and PyTorch's flash kernels run on compute capability 8.0 and newer: a T4 (7.5) or V100 (7.0)
    gets the memory-efficient kernel for every tile, in fp16 and fp32, and a clear refusal for bf16."""
    monkeypatch.setattr(ring_flash, "_flash_ops", lambda: FLASH_ATTN)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert flash_kernel_or_none(query("cuda", torch.float16), None) is None
    kernel = CudaSdpaKernel(capability=(7, 5))
    half = torch.zeros(1, 1, 4, 64, dtype=torch.float16)
    assert not kernel.takes_segments(half)
    assert kernel.route(half, TileMask(CAUSAL)) == kernel.route(half, TileMask(FULL)) == "efficient"
    assert kernel.route(half.float(), TileMask(CAUSAL)) == "efficient"
    with pytest.raises(ValueError, match="compute capability 8.0.*sm75.*float16 or float32"):
        kernel.route(half.bfloat16(), TileMask(CAUSAL))
    assert CudaSdpaKernel(capability=(8, 0)).route(half, TileMask(CAUSAL)) == "flash"
