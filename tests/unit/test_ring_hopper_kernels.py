"""The ring's tiles on the GPU a target names (cp/ring/target.py), on CPU through the emulations written from each
kernel's source (tests/emulation/): cuDNN's attention for sdpa models where SDPA itself prefers it (cp/ring/cudnn.py),
FlashAttention-3 (fa3.py) and FlashAttention-4 (fa4.py). Each tile's out, LSE, dq, dk, dv equal the exact
`TorchKernel` on the same tile, with the kernel it ran counted; the selection follows torch's own priority rule
(versions included); DistributedConfig's target fields are validated; the real cuDNN ops accept the calls under fake
tensors, as a projection of an H100 runs them.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cpbench
from cpbench.cp.ring import cudnn
from cpbench.cp.ring import fa3 as ring_fa3
from cpbench.cp.ring.cuda import CudaSdpaKernel
from cpbench.cp.ring.fa3 import FlashAttn3Kernel
from cpbench.cp.ring.fa4 import FlashAttn4Kernel
from cpbench.cp.ring.kernels import TorchKernel
from cpbench.cp.ring.masks import CAUSAL, DENSE, FULL, SEGMENTS, TileMask, build_ring_masks
from cpbench.cp.ring.select import select_kernel
from cpbench.cp.ring.target import KernelTarget, kernel_target, resolve_target, sdpa_prefers_cudnn
from tests.emulation import flash_attn_3 as e3
from tests.emulation import flash_attn_4 as e4
from tests.emulation.aten_sdpa import Counted
from tests.unit.test_ring_flash import HALF, SCALE, check_against_exact, tolerances
from tests.unit.test_ring_sinks_and_mla import _run

H100, A100, B200 = KernelTarget(capability=(9, 0)), KernelTarget(capability=(8, 0)), KernelTarget(capability=(10, 0))
B, H, HKV = 2, 4, 2


def _inputs(n=6, d=16, dtype=torch.bfloat16, d_v=None, kv_heads=HKV, seed=1):
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(B, H, n, d, generator=g).to(dtype) for _ in range(2))
    k = torch.randn(B, kv_heads, n, d, generator=g).to(dtype)
    v = torch.randn(B, kv_heads, n, d_v or d, generator=g).to(dtype)
    if d_v:
        dout = torch.randn(B, H, n, d_v, generator=g).to(dtype)
    return q, k, v, dout


def _tol(dtype):
    tol = tolerances(dtype)
    return {**tol, "lse_grads": 2 * tol["lse_grads"]} if dtype in HALF else tol


def _dense(n=6, batch=B, seed=0):
    allowed = torch.rand(batch, 1, n, n, generator=torch.Generator().manual_seed(seed)) > 0.3
    allowed[0, 0, 1] = False  # a row that sees no key in this tile
    return TileMask(DENSE, allowed)


def _packed_tiles():
    """Sequence 20 in chunks of 10, rows packed differently ([8, 12] and [3, 14, 3]), window 12: (the tile as a
    varlen kernel gets it, the same tile DENSE) for the diagonal tiles and the one below them."""
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in ((8, 12), (3, 14, 3))])
    out = []
    for window in (None, 12):
        lean, dense = (build_ring_masks(None, seq_len=20, padded_len=20, position_ids=pos, sliding_window=window,
                                        varlen=varlen) for varlen in (True, False))
        out += [(lean.tile(q0, k0, 10), dense.tile(q0, k0, 10)) for q0, k0 in ((0, 0), (10, 0), (10, 10))]
    return [(lean, dense) for lean, dense in out if lean.kind == SEGMENTS]


# -- which kernel, on which GPU ------------------------------------------------------------------------------------


def test_sdpa_prefers_cudnn_as_torch_does():
    """sdp_utils.cpp check_prefer_cudnn_attention: cuDNN > 9.15.0, sm9x/sm10x, with CUDA < 13 only minor 0 or 3."""
    assert sdpa_prefers_cudnn(H100) and sdpa_prefers_cudnn(B200)
    assert sdpa_prefers_cudnn(KernelTarget(capability=(10, 3), cuda_version=(12, 9)))
    assert not sdpa_prefers_cudnn(KernelTarget(capability=(10, 1), cuda_version=(12, 9)))
    assert sdpa_prefers_cudnn(KernelTarget(capability=(10, 1), cuda_version=(13, 0)))
    assert not sdpa_prefers_cudnn(A100) and not sdpa_prefers_cudnn(KernelTarget(capability=(12, 0)))
    assert not sdpa_prefers_cudnn(KernelTarget(capability=(9, 0), cudnn_version=91500))
    assert sdpa_prefers_cudnn(KernelTarget(capability=(9, 0), cudnn_version=91501))
    assert not sdpa_prefers_cudnn(KernelTarget(capability=(9, 0), cudnn_version=None))
    assert not sdpa_prefers_cudnn(KernelTarget(capability=(9, 0), cudnn_deprioritized=True))
    assert sdpa_prefers_cudnn(KernelTarget(capability=(8, 0), sdpa_kernel="cudnn"))  # --sdpa-kernel cudnn
    assert not sdpa_prefers_cudnn(KernelTarget(capability=(9, 0), sdpa_kernel="flash"))


def test_a_cpu_run_takes_the_target_it_names():
    q = torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16)
    assert resolve_target(None, q) == KernelTarget(device="cpu")
    assert resolve_target("cuda", q) == A100  # "as on an A100" unless a capability is named
    assert resolve_target(H100, q) is H100
    assert kernel_target(None) is None and kernel_target("cuda", (9, 0)) == H100
    assert resolve_target(kernel_target(None, (9, 0)), q).device == "cpu"  # a GPU named, no cp_kernel_device
    kernel = select_kernel("sdpa", q, device_type=H100)
    assert isinstance(kernel, CudaSdpaKernel) and kernel.cudnn_first
    assert not select_kernel("sdpa", q, device_type=A100).cudnn_first


def test_each_backend_gets_its_own_kernel_where_it_runs(monkeypatch):
    q = torch.zeros(1, H, 4, 16, dtype=torch.bfloat16)
    with e3.installed(), e4.installed():
        assert isinstance(select_kernel("flash_attention_3", q, device_type=H100), FlashAttn3Kernel)
        assert isinstance(select_kernel("flash_attention_3", q, device_type=A100), FlashAttn3Kernel)
        assert isinstance(select_kernel("flash_attention_4", q, device_type=B200), FlashAttn4Kernel)
        assert isinstance(select_kernel("flash_attention_4", q, device_type=A100), CudaSdpaKernel)  # bwd needs 9.x
        capped = select_kernel("flash_attention_3", q, softcap=30.0, device_type=H100)
        assert isinstance(capped, FlashAttn3Kernel) and capped.softcap == 30.0  # FA3 takes soft-capping itself
        mla = torch.zeros(1, H, 4, 128, dtype=torch.bfloat16)
        assert isinstance(select_kernel("flash_attention_3", torch.zeros(1, H, 4, 192, dtype=torch.bfloat16),
                                        device_type=H100, value=mla), FlashAttn3Kernel)  # (192, 128): Hopper's
        assert isinstance(select_kernel("flash_attention_4", torch.zeros(1, H, 4, 160, dtype=torch.bfloat16),
                                        device_type=B200), CudaSdpaKernel)  # 160 is not an sm100 head dim
        assert isinstance(select_kernel("flash_attention_3", q), type(select_kernel("sdpa", q)))  # CPU: CPU kernel
        assert isinstance(select_kernel("flash_attention_3", q.float(), device_type=H100), CudaSdpaKernel)
    monkeypatch.setattr(ring_fa3, "_fa3_ops", lambda: None)  # not installed: sdpa's kernel for the card
    assert isinstance(select_kernel("flash_attention_3", q, device_type=H100), CudaSdpaKernel)


def test_cudnn_routes_as_sdpa_would_call_it():
    ops = Counted()
    h100, a100 = CudaSdpaKernel(ops, target=H100), CudaSdpaKernel(ops, target=A100)
    q = torch.zeros(B, H, 6, 64, dtype=torch.bfloat16)
    assert h100.route(q, TileMask(CAUSAL)) == h100.route(q, _dense()) == "cudnn"
    assert a100.route(q, TileMask(CAUSAL)) == "flash" and a100.route(q, _dense()) == "efficient"
    assert h100.route(q.float(), TileMask(FULL)) == "efficient"  # cuDNN takes no fp32
    assert h100.route(torch.zeros(B, H, 6, 256, dtype=torch.bfloat16), TileMask(FULL)) == "flash"  # d > 128
    assert h100.route(q, TileMask(FULL), torch.zeros(B, HKV, 1, 64, dtype=torch.bfloat16)) == "flash"  # S_kv 1
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        assert CudaSdpaKernel(ops, target=H100).route(q, TileMask(FULL)) == "flash"  # sdpa_kernel(...) excludes it
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
    torch.use_deterministic_algorithms(True)
    try:
        assert CudaSdpaKernel(ops, target=H100).route(q, TileMask(FULL)) == "flash"  # "not deterministic"
    finally:
        torch.use_deterministic_algorithms(False)
    forced = CudaSdpaKernel(ops, target=KernelTarget(capability=(9, 0), sdpa_kernel="efficient"))
    assert forced.route(q, TileMask(CAUSAL)) == "efficient" and not forced.takes_segments(q)
    assert sum(ops.calls.values()) == 0


# -- the tiles equal the exact kernel's ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("name", ["full", "causal", "dense", "dense-in-row-blocks", "head-dim-12", "mqa"])
def test_cudnn_tiles_match_the_exact_kernel(name, dtype):
    q, k, v, dout = _inputs(d=12 if name == "head-dim-12" else 16, dtype=dtype, kv_heads=1 if name == "mqa" else HKV)
    tile = {"full": TileMask(FULL), "causal": TileMask(CAUSAL)}.get(name, _dense())
    ops = Counted()
    blocks = 1
    if name == "dense-in-row-blocks":  # a bias budget of 4 rows: rows 0-3, then 4-5
        kernel, blocks = CudaSdpaKernel(ops, bias_block_bytes=4 * B * (6 + 16) * 2, target=H100), 2
    else:
        kernel = CudaSdpaKernel(ops, target=H100)
    check_against_exact(kernel, q, k, v, dout, tile, _tol(dtype))
    assert ops.calls["cudnn"] == ops.calls["cudnn_backward"] == blocks  # GQA as it is: one call per row block
    assert sum(ops.calls.values()) == 2 * blocks


@pytest.mark.parametrize("runs", [True, False], ids=["cudnn-run-by-run", "flash-varlen"])
def test_packed_tiles_on_hopper_run_by_run_or_varlen(runs, monkeypatch):
    """Where every document run pays for its own call (RUN_MIN_FLOPS: 0 here, a long document in practice) each runs
    on cuDNN; otherwise, and where a window cuts the tile, the tile is one flash varlen call."""
    monkeypatch.setattr(cudnn, "RUN_MIN_FLOPS", 0 if runs else float("inf"))
    q, k, v, dout = _inputs(n=10)
    for lean, dense in _packed_tiles():
        ops = Counted()
        check_against_exact(CudaSdpaKernel(ops, target=H100), q, k, v, dout, lean, _tol(torch.bfloat16),
                            ref_tile=dense)
        cut = lean.segments.window != (-1, -1)
        route = "cudnn" if runs and not cut else "varlen"
        assert ops.calls[route] > 0 and ops.calls[f"{route}_backward"] > 0
        assert sum(n for key, n in ops.calls.items() if not key.startswith(route)) == 0


def _flash_kernel(which, softcap=None, capability=(9, 0)):
    fwd, bwd = (e3._flash_attn_forward, e3._flash_attn_backward) if which == "fa3" else \
        (e4._flash_attn_fwd, e4._flash_attn_bwd)
    calls = {"fwd": 0, "bwd": 0}

    def counted(fn, key):
        def call(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return call

    cls = FlashAttn3Kernel if which == "fa3" else FlashAttn4Kernel
    masked = None if softcap else CudaSdpaKernel(Counted(), target=KernelTarget(capability=capability))
    kernel = cls(counted(fwd, "fwd"), counted(bwd, "bwd"), softcap=softcap, masked=masked, capability=capability)
    kernel._causal = "is_causal" if which == "fa3" else None
    return kernel, calls


@pytest.mark.parametrize("which", ["fa3", "fa4"])
@pytest.mark.parametrize("name", ["full", "causal", "dense", "softcap", "mqa", "head-dim-12"])
def test_flash_3_and_4_tiles_match_the_exact_kernel(which, name):
    q, k, v, dout = _inputs(d=12 if name == "head-dim-12" else 16, kv_heads=1 if name == "mqa" else HKV)
    tile = TileMask(CAUSAL) if name in ("causal", "softcap") else _dense() if name == "dense" else TileMask(FULL)
    kernel, calls = _flash_kernel(which, softcap=2.0 if name == "softcap" else None)
    check_against_exact(kernel, q, k, v, dout, tile, _tol(torch.bfloat16))
    assert calls == ({"fwd": 0, "bwd": 0} if name == "dense" else {"fwd": 1, "bwd": 1})
    if name == "dense":  # DENSE tiles: PyTorch's kernels for the card, cuDNN's on an H100
        assert kernel._fallback.ops.calls["cudnn"] == 1


@pytest.mark.parametrize("which", ["fa3", "fa4"])
def test_flash_3_and_4_packed_and_windowed_tiles_go_varlen(which):
    q, k, v, dout = _inputs(n=10)
    for lean, dense in _packed_tiles():
        kernel, calls = _flash_kernel(which)
        assert kernel.takes_segments(q)
        check_against_exact(kernel, q, k, v, dout, lean, _tol(torch.bfloat16), ref_tile=dense)
        assert calls == {"fwd": 1, "bwd": 1}


@pytest.mark.parametrize("kernel", ["cudnn", "fa3", "fa4"])
def test_a_value_head_dim_other_than_the_querys(kernel):
    """Multi-head latent attention: cuDNN takes d_qk != d_v, FlashAttention-3 (192, 128) on Hopper only, FA4 on sm90
    any pair up to 256; out and dV take v's head dim."""
    q, k, v, dout = _inputs(d=192, d_v=128)
    if kernel == "cudnn":
        ops = Counted()
        kern, calls = CudaSdpaKernel(ops, target=H100), ops.calls
        assert kern.route(q, TileMask(CAUSAL), v) == "cudnn"
    else:
        kern, calls = _flash_kernel(kernel)
        assert kern.head_dims_ok(q, v)
        if kernel == "fa3":
            assert not _flash_kernel("fa3", capability=(8, 0))[0].head_dims_ok(q, v)
    got, ref = _run(kern, q, k, v, dout, TileMask(CAUSAL)), _run(TorchKernel(), q, k, v, dout, TileMask(CAUSAL))
    for a, b, what in zip(got, ref, ("out", "dq", "dk", "dv")):
        err = ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
        assert err <= 4 * torch.finfo(torch.bfloat16).eps, f"{what}: {err:.3g}"
    assert (calls["cudnn"], calls["cudnn_backward"]) == (1, 1) if kernel == "cudnn" else calls == {"fwd": 1, "bwd": 1}


@pytest.mark.parametrize("name", ["causal", "dense"])
def test_the_real_cudnn_ops_accept_the_calls_under_fake_tensors(name):
    """What a projection of an H100 runs: the real ops' meta kernels, which check argument types and shapes."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(B, H, 40, 64, dtype=torch.bfloat16)
        k = torch.empty(B, HKV, 40, 64, dtype=torch.bfloat16)
        tile = _dense(40) if name == "dense" else TileMask(CAUSAL)
        kernel = CudaSdpaKernel(target=H100)
        assert kernel.route(q, tile, k) == "cudnn"
        out, lse = kernel.forward(q, k, k, tile, SCALE)
        dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32) for x in (q, k, k))
        kernel.backward(q, q, k, k, out.to(q.dtype), lse, tile, SCALE, dq, dk, dv)
        assert out.shape == q.shape and lse.shape == q.shape[:3] and dk.shape == k.shape


def test_distributed_config_names_the_target():
    cfg = cpbench.DistributedConfig(cp_size=1, cp_kernel_device="cuda", cp_kernel_capability=[9, 0],
                                    cp_kernel_cudnn_version=92000, cp_sdpa_kernel="cudnn")
    assert cfg.cp_kernel_capability == (9, 0)
    for bad, match in ((dict(cp_kernel_capability=(9,)), "cp_kernel_capability.*\\(9, 0\\) for an H100"),
                       (dict(cp_kernel_cudnn_version="9.20"), "cp_kernel_cudnn_version.*92000"),
                       (dict(cp_sdpa_kernel="math"), "cp_sdpa_kernel.*'math'"),
                       (dict(cp_kernel_device="cpu", cp_kernel_capability=(9, 0)), "cp_kernel_device='cuda'")):
        with pytest.raises(ValueError, match=match):
            cpbench.DistributedConfig(cp_size=1, **bad)
