"""CUDA paths, opt-in (`python -m pytest -m gpu tests/gpu`): skipped where there is no CUDA device."""

import json
import subprocess
import sys

import pandas as pd
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SUITE = """
name = "gpu-smoke"
model = "tiny-qwen3"
seq_lens = [1024]
cp_sizes = [1]
attn_implementations = ["sdpa"]
cp_styles = ["cp_ulysses"]
dtype = "bfloat16"
device = "cuda"
warmup_steps = 1
measured_steps = 3
parity = "full"
timeout_s = 300
"""


def _sweep_one(tmp_path, text: str, timeout: int = 600):
    """`cpbench sweep` of a one-point suite in a fresh process; its row."""
    suite = tmp_path / "gpu-smoke.toml"
    suite.write_text(text)
    cmd = [sys.executable, "-m", "cpbench", "sweep", str(suite), "--out", str(tmp_path), "--run-name", "t",
           "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return pd.read_parquet(tmp_path / "gpu-smoke" / "t" / "runs.parquet").iloc[0]


def test_a_cuda_point_records_allocator_nvml_and_parity(tmp_path):
    row = _sweep_one(tmp_path, SUITE)
    assert row["status"] == "ok", row["status_detail"]
    assert row["peak_bytes"] > 0 and row["reserved_bytes"] >= row["peak_bytes"]
    assert row["device_peak_bytes"] >= row["reserved_bytes"]  # NVML sees the whole device allocation
    assert row["parity_status"] == "pass", json.dumps(row[["loss", "ref_loss", "grad_max_rel_err"]].to_dict())
    assert row["device"] == "cuda" and row["tflops_per_s"] > 0


@pytest.mark.parametrize("extra", ['loss = "chunked"', "activation_checkpointing = true",
                                   'loss = "chunked"\nactivation_checkpointing = true'])
def test_the_long_context_options_pass_parity_on_cuda(tmp_path, extra):
    """The chunked loss and recompute on the CUDA path (one GPU: cp 1), against the unsharded full-loss run."""
    row = _sweep_one(tmp_path, SUITE + extra + "\n")
    assert row["status"] == "ok" and row["parity_status"] == "pass", row["parity_detail"]


def test_ring_block_kernel_on_cuda_matches_plain_attention():
    from cpbench.cp.ring.kernels import TorchKernel
    from cpbench.cp.ring.masks import CAUSAL, TileMask

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 128, 64, device="cuda", dtype=torch.float32) for _ in range(3))
    out, lse = TorchKernel().forward(q, k, v, TileMask(CAUSAL), 64**-0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    # fp32 on both sides; TF32 matmuls (if enabled) round to ~1e-3 relative, hence the tolerance.
    torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=2e-3)
    assert lse.shape == (1, 4, 128)


@pytest.mark.parametrize("kind", ["full", "causal"])
def test_ring_flash_attn_kernel_matches_the_matmul_kernel(kind):
    """The real flash-attn kernels behind cp_ring (CPU CI checks the glue against an emulation only)."""
    from cpbench.cp.ring.flash import flash_kernel_or_none
    from cpbench.cp.ring.kernels import TorchKernel
    from cpbench.cp.ring.masks import CAUSAL, FULL, TileMask

    torch.manual_seed(0)
    q = torch.randn(1, 8, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=False)
    k, v = (torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))  # GQA 4:1
    kernel = flash_kernel_or_none(q, None)
    if kernel is None:
        pytest.skip("flash-attn is not installed")
    tile, scale = TileMask(CAUSAL if kind == "causal" else FULL), 64**-0.5
    out, lse = kernel.forward(q, k, v, tile, scale)
    ref_out, ref_lse = TorchKernel().forward(q, k, v, tile, scale)
    # bf16 inputs, fp32 accumulation on both sides: the kernels differ in summation order only, well inside
    # bf16's eps (2^-8 ~ 3.9e-3) on O(1) values.
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=4e-3, atol=4e-3)
    torch.testing.assert_close(lse.float(), ref_lse.float(), rtol=4e-3, atol=4e-3)
    dout = torch.randn_like(q)
    grads = [[torch.zeros_like(x, dtype=torch.float32) for x in (q, k, v)] for _ in range(2)]
    for kern, (o, o_lse), acc in ((kernel, (out, lse), grads[0]), (TorchKernel(), (ref_out, ref_lse), grads[1])):
        kern.backward(dout, q, k, v, o.to(q.dtype), o_lse, tile, scale, *acc)
    for got, ref in zip(*grads):
        # Gradients sum 256 bf16 products per entry: allow a few bf16 eps relative to the largest value.
        torch.testing.assert_close(got, ref, rtol=0, atol=8 * 3.9e-3 * ref.abs().max().item())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (one per rank)")
def test_mixed_precision_and_the_sharded_reference_on_two_gpus(tmp_path):
    """cp 2 over NCCL: FSDP2 mixed precision (fp32 masters, bf16 compute), the ring's fused CUDA kernels, and the
    parity verdict from the sharded reference (FSDP over both GPUs, no CP)."""
    text = SUITE.replace("cp_sizes = [1]", "cp_sizes = [2]").replace('cp_styles = ["cp_ulysses"]',
                                                                     'cp_styles = ["cp_ring_zigzag"]')
    row = _sweep_one(tmp_path, text + 'mixed_precision = true\nreference = "sharded"\n', timeout=900)
    assert row["status"] == "ok" and row["parity_status"] == "pass", row["parity_detail"]
    assert row["parity_reference"] == "sharded" and row["mixed_precision"]
