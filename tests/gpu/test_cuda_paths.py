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


def test_a_cuda_point_records_allocator_nvml_and_parity(tmp_path):
    suite = tmp_path / "gpu-smoke.toml"
    suite.write_text(SUITE)
    cmd = [sys.executable, "-m", "cpbench", "sweep", str(suite), "--out", str(tmp_path), "--run-name", "t",
           "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = pd.read_parquet(tmp_path / "gpu-smoke" / "t" / "runs.parquet").iloc[0]
    assert row["status"] == "ok", row["status_detail"]
    assert row["peak_bytes"] > 0 and row["reserved_bytes"] >= row["peak_bytes"]
    assert row["device_peak_bytes"] >= row["reserved_bytes"]  # NVML sees the whole device allocation
    assert row["parity_status"] == "pass", json.dumps(row[["loss", "ref_loss", "grad_max_rel_err"]].to_dict())
    assert row["device"] == "cuda" and row["tflops_per_s"] > 0


def test_ring_block_kernel_on_cuda_matches_plain_attention():
    from cpbench.cp.ring_kernels import TorchKernel
    from cpbench.cp.ring_masks import CAUSAL, TileMask

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 128, 64, device="cuda", dtype=torch.float32) for _ in range(3))
    out, lse = TorchKernel().forward(q, k, v, TileMask(CAUSAL), 64**-0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    # fp32 on both sides; TF32 matmuls (if enabled) round to ~1e-3 relative, hence the tolerance.
    torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=2e-3)
    assert lse.shape == (1, 4, 128)
