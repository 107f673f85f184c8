"""CudaSdpaKernel (the ring's block kernel for sdpa on CUDA), on CPU, against strict emulations of PyTorch's fused ops.

The emulations take exactly the arguments of `aten._scaled_dot_product_{flash,efficient}_attention` and their
backwards (checked against the ops' own schemas), keep their conventions — out in the query's dtype, LSE fp32,
the efficient kernel's LSE padded to a multiple of 32 (the padding filled with NaN so that a kernel that reads it
as rows fails), equal head counts for q and k/v, an additive bias in the query's dtype, square tiles for causal
— and compute the math in fp32. A glue mistake (a head, a mask, the LSE's layout) fails here, not on the first GPU
run. A last test runs the kernel with the real ops under fake tensors (their meta kernels check the call), as a
projection does.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cpbench.cp.ring_cuda import CudaSdpaKernel
from cpbench.cp.ring_kernels import CpuSdpaKernel, TorchKernel, acc_dtype, select_kernel
from cpbench.cp.ring_masks import CAUSAL, DENSE, FULL, TileMask
from tests.unit.test_ring_flash import B, D, H, Q, SCALE, assert_close, run_kernel, tiles, tolerances

ATEN = {
    "flash": torch.ops.aten._scaled_dot_product_flash_attention.default,
    "flash_backward": torch.ops.aten._scaled_dot_product_flash_attention_backward.default,
    "efficient": torch.ops.aten._scaled_dot_product_efficient_attention.default,
    "efficient_backward": torch.ops.aten._scaled_dot_product_efficient_attention_backward.default,
}


def bind(name: str, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name, as the real op's schema binds them (too many, unknown or missing: an error)."""
    params = ATEN[name]._schema.arguments
    positional = [p for p in params if not p.kwarg_only]
    assert len(args) <= len(positional), f"{name}: {len(args)} positional arguments, the op takes {len(positional)}"
    bound = {p.name: a for p, a in zip(positional, args)}
    for key, value in kwargs.items():
        assert key in {p.name for p in params} and key not in bound, f"{name}: unexpected argument {key!r}"
        bound[key] = value
    missing = [p.name for p in params if p.name not in bound and not p.has_default_value()]
    assert not missing, f"{name}: missing {missing}"
    return bound


def _check(q, k, v, dtypes, gqa=False):
    """gqa: the flash kernel takes fewer kv heads (query head h uses kv head h // (H / Hkv)); the efficient one
    wants equal head counts."""
    assert q.dtype == k.dtype == v.dtype and q.dtype in dtypes, (q.dtype, k.dtype, v.dtype)
    assert k.shape == v.shape and q.shape[0] == k.shape[0] and q.shape[-1] == k.shape[-1], (q.shape, k.shape)
    if gqa:
        assert q.shape[1] % k.shape[1] == 0, f"query heads must be a multiple of kv heads: {q.shape}, {k.shape}"
    else:
        assert q.shape[1] == k.shape[1], f"q/k/v heads must match: {q.shape}, {k.shape}"
    assert all(x.stride(-1) == 1 for x in (q, k, v))


def _repeat(x, heads):
    return x.repeat_interleave(heads // x.shape[1], 1)


def _scores(q, k, scale, causal, bias, dtype):
    s = q.float() @ k.float().transpose(-1, -2) * scale
    if causal:
        assert s.shape[-1] == s.shape[-2], "the ring's causal tiles are square"
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    if bias is not None:
        assert bias.dtype == dtype, f"bias dtype {bias.dtype} != query dtype {dtype}"
        assert bias.stride(-2) % 16 == 0 or bias.shape[-2] == 1, "the bias rows must be 16-element aligned"
        s = s + bias.float()
    return s


def _attend(q, k, v, scale, causal, bias=None):
    k, v = _repeat(k, q.shape[1]), _repeat(v, q.shape[1])
    s = _scores(q, k, scale, causal, bias, q.dtype)
    lse = torch.logsumexp(s, -1)
    out = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0)[..., None]) @ v.float()
    return out.to(q.dtype), lse


def _grads(dout, q, k, v, out, lse, scale, causal, bias=None):
    with torch.enable_grad():  # called from inside the ring's autograd backward
        leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
        kh, vh = _repeat(leaves[1], q.shape[1]), _repeat(leaves[2], q.shape[1])
        p = torch.exp(_scores(leaves[0], kh, scale, causal, bias, q.dtype) - lse[..., None])
        do, o = dout.float(), out.float()
        surrogate = (do * (p @ vh)).sum() - ((do * o).sum(-1, keepdim=True) * p).sum()
        return [g.to(q.dtype) for g in torch.autograd.grad(surrogate, leaves)]


def flash(*args, **kwargs):
    a = bind("flash", args, kwargs)
    q, k, v = a["query"], a["key"], a["value"]
    _check(q, k, v, (torch.float16, torch.bfloat16), gqa=True)
    assert q.shape[-1] <= 256 and a["dropout_p"] == 0.0 and a["return_debug_mask"] is False
    out, lse = _attend(q, k, v, a["scale"], a["is_causal"])
    seed = torch.zeros(2, dtype=torch.int64)
    return out, lse, None, None, q.shape[2], k.shape[2], seed, torch.zeros((), dtype=torch.int64), torch.empty(0)


def flash_backward(*args, **kwargs):
    a = bind("flash_backward", args, kwargs)
    q, k, v, out, lse = a["query"], a["key"], a["value"], a["out"], a["logsumexp"]
    _check(q, k, v, (torch.float16, torch.bfloat16), gqa=True)
    assert a["grad_out"].dtype == out.dtype == q.dtype and lse.dtype == torch.float32
    assert lse.shape == q.shape[:3] and (a["max_q"], a["max_k"]) == (q.shape[2], k.shape[2])
    return tuple(_grads(a["grad_out"], q, k, v, out, lse, a["scale"], a["is_causal"]))


def efficient(*args, **kwargs):
    a = bind("efficient", args, kwargs)
    q, k, v = a["query"], a["key"], a["value"]
    _check(q, k, v, (torch.float16, torch.bfloat16, torch.float32))
    assert a["compute_log_sumexp"] is True and a["dropout_p"] == 0.0
    out, lse = _attend(q, k, v, a["scale"], a["is_causal"], a["attn_bias"])
    padded = torch.full((*lse.shape[:2], -(-lse.shape[2] // 32) * 32), float("nan"))
    padded[..., : lse.shape[2]] = lse
    return out, padded, torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)


def efficient_backward(*args, **kwargs):
    a = bind("efficient_backward", args, kwargs)
    q, k, v, out, lse = a["query"], a["key"], a["value"], a["out"], a["logsumexp"]
    _check(q, k, v, (torch.float16, torch.bfloat16, torch.float32))
    assert lse.dtype == torch.float32 and lse.shape == (*q.shape[:2], -(-q.shape[2] // 32) * 32), lse.shape
    assert list(a["grad_input_mask"]) == [True, True, True, False] and a["dropout_p"] == 0.0
    lse = lse[..., : q.shape[2]]
    return (*_grads(a["grad_out_"], q, k, v, out, lse, a["scale"], a["is_causal"], a["attn_bias"]), None)


class Counted:
    def __init__(self):
        self.calls = {name: 0 for name in ATEN}
        self.fns = {"flash": flash, "flash_backward": flash_backward, "efficient": efficient,
                    "efficient_backward": efficient_backward}

    def __getitem__(self, name):
        def call(*args, **kwargs):
            self.calls[name] += 1
            return self.fns[name](*args, **kwargs)
        return call


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kv_heads", [H, 2])
@pytest.mark.parametrize("name", ["full", "causal", "dense", "dense-in-row-blocks"])
def test_fused_kernels_glue_matches_the_exact_kernel(name, kv_heads, dtype):
    tile = tiles()[name.split("-")[0]]
    g = torch.Generator().manual_seed(1)
    q, dout = (torch.randn(B, H, Q, D, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(B, kv_heads, Q, D, generator=g).to(dtype) for _ in range(2))
    ops = Counted()
    blocks = 1
    if name == "dense-in-row-blocks":  # a bias budget of 4 rows: the 6-row tile runs as rows 0-3, then 4-5
        per_row = B * (Q + 16) * dtype.itemsize
        kernel, blocks = CudaSdpaKernel(ops, bias_block_bytes=4 * per_row), 2
    else:
        kernel = CudaSdpaKernel(ops)
    out, lse, accs = run_kernel(kernel, q, k, v, dout, tile)
    ref_out, ref_lse, ref_accs = run_kernel(TorchKernel(), q, k, v, dout, tile)

    route = "flash" if dtype == torch.bfloat16 and not name.startswith("dense") else "efficient"
    # flash: one call (GQA as it is); efficient: one per kv head and row block
    calls = 1 if route == "flash" else kv_heads * blocks
    assert ops.calls[route] == ops.calls[f"{route}_backward"] == calls
    assert sum(ops.calls.values()) == 2 * calls
    assert out.dtype == lse.dtype == acc_dtype(dtype)
    tol = tolerances(dtype)
    if dtype == torch.bfloat16:  # the fused kernels return bf16 gradients per query head; GQA sums two of them
        tol = {"out": tol["out"], "lse_grads": 2 * tol["lse_grads"]}
    assert_close(out, ref_out, tol["out"], "out")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert_close(lse[finite], ref_lse[finite], 64 * torch.finfo(torch.float32).eps, "lse")
    for got, ref, what in zip(accs, ref_accs, ("dq", "dk", "dv")):
        assert_close(got, ref, tol["lse_grads"], what)


def test_tiles_the_fused_kernels_cannot_take_stay_exact():
    ops = Counted()
    kernel = CudaSdpaKernel(ops)
    q = torch.randn(B, H, Q, D, dtype=torch.float64)
    uniform = TileMask(DENSE, torch.ones(B, 1, Q, Q, dtype=torch.bool), uniform=torch.zeros(B, 1, Q, dtype=torch.bool))
    for x, tile in ((q, TileMask(CAUSAL)), (q.float(), uniform)):  # fp64; eager's fully blocked rows
        assert kernel.route(x, tile) == "torch"
        kernel.forward(x, x, x, tile, SCALE)
    assert kernel.route(torch.randn(1, 1, 2, 320).bfloat16(), TileMask(FULL)) == "efficient"  # head dim > 256
    assert sum(ops.calls.values()) == 0


def test_the_ring_picks_the_fused_kernel_for_cuda_and_keeps_cpu_and_softcap_as_they_were():
    q = torch.zeros(1, 1, 1, 8, dtype=torch.bfloat16)
    for implementation in ("sdpa", "eager", "flash_attention_2"):  # flash_attention_2 without flash-attn here
        assert isinstance(select_kernel(implementation, q, device_type="cuda"), CudaSdpaKernel)
    assert isinstance(select_kernel("sdpa", q, softcap=30.0, device_type="cuda"), TorchKernel)
    assert isinstance(select_kernel("sdpa", q), CpuSdpaKernel)


@pytest.mark.parametrize("name", ["causal", "dense"])
def test_the_real_ops_accept_the_calls_under_fake_tensors(name):
    """What a projection runs: the real ops' meta kernels, which check argument types and shapes."""
    tile = tiles()[name]
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(B, H, 40, D, dtype=torch.bfloat16)
        k = torch.empty(B, 2, 40, D, dtype=torch.bfloat16)
        if name == "dense":
            tile = TileMask(DENSE, torch.ones(B, 1, 40, 40, dtype=torch.bool))
        kernel = CudaSdpaKernel()
        out, lse = kernel.forward(q, k, k, tile, SCALE)
        dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32) for x in (q, k, k))
        kernel.backward(q, q, k, k, out, lse, tile, SCALE, dq, dk, dv)
        assert out.shape == q.shape and lse.shape == q.shape[:3] and dk.shape == k.shape
