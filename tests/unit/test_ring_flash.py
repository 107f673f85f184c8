"""FlashAttnKernel's glue, on CPU, against a strict emulation of flash-attn's private kernels (no GPU needed).

The emulation follows flash-attn >= 2.7's `_flash_attn_forward` / `_flash_attn_backward` (flash_attn_interface.py):
the same positional parameters, q/k/v [B, S, H, D] with fewer kv heads for GQA (query head h uses kv head
h // (H / Hkv)), causal aligned bottom-right, LSE fp32 [B, H, S_q], out/dout in the query's dtype, head dims that
are multiples of 8 up to 256, dq/dk/dv written in place (dk/dv at the kv head count), and a backward that takes
P = exp(S - lse) from the LSE it is given (the ring's merged one). It asserts what flash-attn's C++ checks, so a
glue mistake fails here, not on the first GPU run. fp32/fp64 stand in for fp16/bf16 on CPU.
"""

from __future__ import annotations

import sys
import types
from typing import Optional

import pytest
import torch

from cpbench.cp import ring_flash
from cpbench.cp.ring_flash import FlashAttnKernel, flash_kernel_or_none
from cpbench.cp.ring_cuda import CudaSdpaKernel
from cpbench.cp.ring_kernels import CpuSdpaKernel, TorchKernel, acc_dtype, select_kernel
from cpbench.cp.ring_masks import CAUSAL, DENSE, FULL, TileMask

B, H, Q, D = 2, 4, 6, 8
SCALE = D**-0.5
CPU_STAND_INS = (torch.float32, torch.float64)  # for fp16/bf16, which flash-attn alone takes


def _check_inputs(q, k, v, dropout_p, scale, causal, left, right, softcap, alibi):
    b, _, h, d = q.shape
    assert q.dim() == k.dim() == v.dim() == 4 and k.shape == v.shape, (q.shape, k.shape, v.shape)
    assert k.shape[0] == b and k.shape[3] == d and h % k.shape[2] == 0, (q.shape, k.shape)
    assert q.dtype == k.dtype == v.dtype and q.dtype in (torch.float16, torch.bfloat16, *CPU_STAND_INS), q.dtype
    assert all(x.stride(-1) == 1 for x in (q, k, v)), "flash-attn needs a contiguous last dimension"
    assert d % 8 == 0 and d <= 256, f"flash-attn's kernels take head dims that are multiples of 8 up to 256: {d}"
    assert dropout_p == 0.0 and alibi is None and (left, right) == (-1, -1)
    assert type(scale) is float and type(causal) is bool and type(softcap) is float and softcap >= 0


def _scores(q, k, scale, causal, softcap):
    """[B, H, S_q, S_k] in the compute dtype, from [B, S, H, D] inputs (kv heads repeated for GQA)."""
    c = torch.float64 if q.dtype == torch.float64 else torch.float32
    qh = q.to(c).transpose(1, 2)
    kh = k.to(c).transpose(1, 2).repeat_interleave(q.shape[2] // k.shape[2], 1)
    s = qh @ kh.transpose(-1, -2) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if causal:  # bottom-right aligned: query i sees key j <= i + S_k - S_q
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1), float("-inf"))
    return s


def flash_fwd(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
              alibi_slopes, return_softmax):
    _check_inputs(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                  alibi_slopes)
    assert return_softmax is False
    s = _scores(q, k, softmax_scale, causal, softcap)
    vh = v.to(s.dtype).transpose(1, 2).repeat_interleave(q.shape[2] // k.shape[2], 1)
    out = (torch.softmax(s, -1) @ vh).transpose(1, 2).to(q.dtype).contiguous()
    lse = torch.logsumexp(s, -1).float().contiguous()
    return out, lse, torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64)


def flash_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left,
              window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    _check_inputs(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                  alibi_slopes)
    assert type(deterministic) is bool
    for x in (dout, out):
        assert x.shape == q.shape and x.dtype == q.dtype and x.stride(-1) == 1, (x.shape, x.dtype)
    assert softmax_lse.dtype == torch.float32 and softmax_lse.is_contiguous()
    assert softmax_lse.shape == (q.shape[0], q.shape[2], q.shape[1]), softmax_lse.shape
    for grad, x in ((dq, q), (dk, k), (dv, v)):
        assert grad.shape == x.shape and grad.dtype == q.dtype and grad.stride(-1) == 1, (grad.shape, grad.dtype)
    # Autograd of a surrogate whose gradient is flash-attn's: P = exp(S - lse) with the given lse held fixed, and
    # dS = P * (dout @ v^T - rowsum(dout * out)): d/dP of sum(dout * (P @ v)) - sum(rowsum(dout * out) * P).
    with torch.enable_grad():  # the ring calls kernels from inside its autograd.Function's backward
        leaves = [x.detach().to(torch.float64 if q.dtype == torch.float64 else torch.float32).requires_grad_()
                  for x in (q, k, v)]
        s = _scores(*leaves[:2], softmax_scale, causal, softcap)
        p = torch.exp(s - softmax_lse.to(s.dtype)[..., None])
        do, o = (x.to(s.dtype).transpose(1, 2) for x in (dout, out))
        vh = leaves[2].transpose(1, 2).repeat_interleave(q.shape[2] // k.shape[2], 1)
        surrogate = (do * (p @ vh)).sum() - ((do * o).sum(-1, keepdim=True) * p).sum()
        grads = torch.autograd.grad(surrogate, leaves)
    for grad, g in zip((dq, dk, dv), grads):
        grad.copy_(g)
    return torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)  # softmax_d


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


# Relative to the largest reference magnitude. Both sides compute the same sums over <= Q keys in the compute
# dtype (fp64 for fp64, else fp32), so the error is rounding, a few eps (measured <= 2); 64 eps leaves room while a
# glue mistake (a wrong head, mask or scale) is O(0.1). flash-attn's LSE is fp32 by contract and the backward's
# exp(s - lse) inherits it, so for fp64 the LSE and gradients are held to fp32's eps. bf16: flash-attn returns out
# and dq/dk/dv in the input dtype, one rounding each (measured <= 0.5 eps), so 2 bf16 eps.
def tolerances(dtype):
    if dtype == torch.bfloat16:
        return {"out": 2 * torch.finfo(dtype).eps, "lse_grads": 2 * torch.finfo(dtype).eps}
    return {"out": 64 * torch.finfo(dtype).eps, "lse_grads": 64 * torch.finfo(torch.float32).eps}


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


def run_kernel(kernel, q, k, v, dout, tile):
    """Forward, then backward given the exact kernel's final out (in the query's dtype, as the ring keeps it) and
    LSE, adding into views of pre-filled accumulators. Returns out, LSE and the accumulators' whole tensors."""
    inputs = [as_rows(x)[1] for x in (q, k, v)]
    out, lse = kernel.forward(*inputs, tile, SCALE)
    ref_out, ref_lse = TorchKernel(kernel.softcap).forward(q, k, v, tile, SCALE)
    final = [as_rows(x)[1] for x in (dout, *inputs, ref_out.to(q.dtype), ref_lse)]
    accs = [as_rows(torch.randn(x.shape, generator=torch.Generator().manual_seed(i)).to(acc_dtype(q.dtype)), i)
            for i, x in enumerate((q, k, v))]
    kernel.backward(*final, tile, SCALE, *(view for _, view in accs))
    return out, lse, [whole for whole, _ in accs]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("kv_heads", [H, 2])
@pytest.mark.parametrize("name", ["full", "causal", "dense"])
def test_flash_kernel_glue_matches_torch_kernel(name, kv_heads, softcap, dtype):
    flash_serves = name != "dense"  # DENSE tiles go to TorchKernel
    assert check_glue(name, kv_heads, softcap, dtype, D) == ((1, 1) if flash_serves else (0, 0))


def check_glue(name, kv_heads, softcap, dtype, head_dim) -> tuple[int, int]:
    """Asserts FlashAttnKernel's results equal TorchKernel's on one tile; returns the flash-attn calls made."""
    tile = tiles()[name]
    g = torch.Generator().manual_seed(1)
    q, dout = (torch.randn(B, H, Q, head_dim, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(B, kv_heads, Q, head_dim, generator=g).to(dtype) for _ in range(2))
    fwd, bwd = Counted(flash_fwd), Counted(flash_bwd)
    out, lse, accs = run_kernel(FlashAttnKernel(fwd, bwd, softcap=softcap), q, k, v, dout, tile)
    ref_out, ref_lse, ref_accs = run_kernel(TorchKernel(softcap), q, k, v, dout, tile)

    assert out.dtype == lse.dtype == acc_dtype(dtype) and out.shape == ref_out.shape and lse.shape == ref_lse.shape
    tol = tolerances(dtype)
    assert_close(out, ref_out, tol["out"], "out")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert_close(lse[finite], ref_lse[finite], tol["lse_grads"], "lse")
    for got, ref, what in zip(accs, ref_accs, ("dq", "dk", "dv")):
        assert_close(got, ref, tol["lse_grads"], what)  # the rows outside the views stay as they were on both sides
    return fwd.calls, bwd.calls


@pytest.mark.parametrize("head_dim", [6, 264])
def test_head_dims_flash_attn_cannot_take_are_padded_or_left_to_torch(head_dim):
    # 6: zero-padded to 8 and cut back, as flash-attn's own autograd functions do; 264 > 256: TorchKernel.
    assert check_glue("causal", 2, None, torch.float64, head_dim) == ((1, 1) if head_dim <= 256 else (0, 0))


def _fake_flash_attn(monkeypatch, fwd, bwd=flash_bwd):
    package, interface = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.flash_attn_interface")
    interface._flash_attn_forward, interface._flash_attn_backward = fwd, bwd
    interface._flash_attn_varlen_forward, interface._flash_attn_varlen_backward = VARLEN
    package.flash_attn_interface = interface
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)


VARLEN = (object(), object())  # flash-attn's varlen pair: only looked up here (test_ring_segments.py runs them)


def _old_fwd(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax):
    raise AssertionError("never called")  # flash-attn <= 2.6's signature: one window_size tuple


@torch.library.custom_op("cpbench_test::flash_fwd", mutates_args=())
def _custom_op_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float,
                   causal: bool, window_size_left: int, window_size_right: int, softcap: float,
                   alibi_slopes: Optional[torch.Tensor], return_softmax: bool) -> torch.Tensor:
    raise AssertionError("never called")  # how flash-attn >= 2.7 registers its kernels on torch >= 2.4


def test_flash_ops_accepts_flash_attn_2_7_and_refuses_older(monkeypatch):
    for fwd in (flash_fwd, _custom_op_fwd):
        _fake_flash_attn(monkeypatch, fwd)
        assert ring_flash._flash_ops() == (fwd, flash_bwd, *VARLEN)
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
    monkeypatch.setattr(ring_flash, "_flash_ops", lambda: (flash_fwd, flash_bwd, *VARLEN))
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

