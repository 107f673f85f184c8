"""A step's kernel time by class (project/decompose.py): kernels named as torch.profiler names them fall in the class
the time model prices them in, every projected op with a kernel has a class, and the command's errors and output."""

from __future__ import annotations

import csv

import pytest
import torch

from cpbench.harness.project import decompose, hardware
from cpbench.harness.project.timing import op_seconds
from cpbench.harness.project.trace import Op
from cpbench.harness.suite.spec import load_suite

# Kernel names from published profiles (torch.profiler / nsys), each with the class it falls in
NAMED = {
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<(unsigned long)4096>)": "comm",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
    "cutlass::bfloat16_t>>": "attention",
    "flash::FlashAttentionForwardSm100": "attention",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0": "attention",
    "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel)": "attention",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel":
        "gemm",
    "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "gemm",
    "ampere_bf16_s16816gemm_bf16_128x256_ldg8_f2f_stages_64x3_tn": "gemm",
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false, false>": "gemm",
    "void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, false>": "gemm",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>": "elementwise",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float>>>":
        "elementwise",
    "Memcpy DtoD (Device -> Device)": "elementwise",
    "Memcpy HtoD (Pinned -> Device)": "transfer",
    "Memset (Device)": "elementwise",
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_4x1x1_kernel0_0": "attention",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous "
    "namespace)::LogSoftMaxForwardEpilogue>": "elementwise",
    "void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>": "elementwise",
    "void at::native::(anonymous namespace)::indexing_backward_kernel<c10::BFloat16, 4>": "elementwise",
    "void at::native::multi_tensor_apply_kernel<at::native::TensorListMetadata<4>, ...>": "elementwise",
}


def test_a_kernel_falls_in_the_class_the_model_prices_it_in():
    for name, cls in NAMED.items():
        assert decompose.classify(name) == cls, name
    # the optimizer's window: its kernels are the optimizer's, whatever they are, but NCCL's stay NCCL's
    assert decompose.classify("void at::native::multi_tensor_apply_kernel<...>", "optimizer") == "optimizer"
    assert decompose.classify("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "optimizer") == "optimizer"
    assert decompose.classify("ncclDevKernel_AllGather_RING_LL", "optimizer") == "comm"
    # a projected op's class: NCCL's on their streams, the offload levers' copies, the optimizer's, none for the host's
    op = Op("compute", "memory", "step", 0.0, 1.0, (), ())
    assert decompose.projected_class(op._replace(stream="ag", kind="all_gather")) == "comm"
    assert decompose.projected_class(op._replace(stream="d2h", kind="d2h")) == "transfer"
    assert decompose.projected_class(op._replace(phase="optimizer")) == "optimizer"
    assert decompose.projected_class(op._replace(stream="host")) is None
    assert decompose.projected_class(op._replace(kind="replay")) is None
    got = decompose.bucket([("nvjet_tst_x", 1500.0), ("flash_bwd", 250.0), ("add_kernel", 5.0)])
    assert got["gemm"] == pytest.approx(1.5e-3) and got["attention"] == pytest.approx(2.5e-4)
    assert got["elementwise"] == pytest.approx(5e-6) and got["optimizer"] == got["comm"] == 0.0


def _suite(tmp_path, **fields):
    text = {"name": "'dec'", "model": "'tiny-llama'", "seq_lens": "[128]", "cp_sizes": "[1]", "world_size": "1",
            "attn_implementations": "['sdpa']", "cp_styles": "['cp_ulysses']", "dtype": "'bfloat16'",
            "device": "'cuda'", "parity": "'off'", "warmup_steps": "1", "measured_steps": "1", **fields}
    path = tmp_path / "dec.toml"
    path.write_text("\n".join(f"{k} = {v}" for k, v in text.items()))
    return path


def test_every_projected_kernel_has_a_class_and_the_classes_add_up(tmp_path):
    point = load_suite(_suite(tmp_path, activation_checkpointing="true")).points()[0]
    hw = hardware.load("h100-sxm")
    got, paced = decompose.project(point, hw), hw.at_scale(point.world_size)  # one GPU: one chip's pace
    kernels = [op for op in got["trace"] if op_seconds(op, paced, point.dtype) > 0 and op.stream != "host"]
    assert kernels and all(decompose.projected_class(op) is not None for op in kernels)
    assert sum(got["classes"].values()) == pytest.approx(sum(op_seconds(op, paced, point.dtype) for op in kernels))
    assert all(got["classes"][c] > 0 for c in ("gemm", "attention", "elementwise", "optimizer"))
    assert got["classes"]["comm"] == got["classes"]["transfer"] == 0.0  # one rank, nothing offloaded
    assert got["step_s"] > 0


def test_the_command_prints_and_writes_the_projected_side_and_refuses_what_it_cannot_run(tmp_path, capsys):
    suite, out = _suite(tmp_path), tmp_path / "dec.csv"
    assert decompose.main([str(suite), "--projected", "--gpu", "h100-sxm", "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [r["class"] for r in rows] == ["gemm", "attention", "elementwise", "optimizer", "step"]
    assert all(r["measured_s"] == "" and float(r["projected_s"]) > 0 for r in rows)
    assert "priced as h100-sxm" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        decompose.main([str(suite), "--projected"])  # no profile to price with
    assert "--gpu NAME" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        decompose.main([str(suite), "--projected", "--gpu", "no-such-gpu"])
    assert "not a known GPU" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            decompose.main([str(suite), "--gpu", "h100-sxm"])
        assert "no CUDA device" in capsys.readouterr().err
    wide = _suite(tmp_path, cp_sizes="[2]", world_size="2")
    with pytest.raises(SystemExit):
        decompose.main([str(wide), "--projected", "--gpu", "h100-sxm"])
    assert "world_size = 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="world_size = 2"):
        decompose.measure(load_suite(wide).points()[0])


def test_a_measured_step_is_split_into_its_phases_windows(tmp_path, monkeypatch):
    # on the CPU the profiler gives aten's ops, not kernels: this checks the plumbing (cpbench's own step, its
    # forward and backward in one window, the optimizer in the other), not the classes of the names
    point = load_suite(_suite(tmp_path, device="'cpu'", dtype="'float32'")).points()[0]
    got = decompose.measure(point, steps=1, warmup=1)
    assert got["device"] == "cpu" and got["step_s"] > 0
    assert got["classes"]["attention"] > 0  # aten::_scaled_dot_product_flash_attention_for_cpu
    assert got["classes"]["optimizer"] > 0 and got["classes"]["elementwise"] > 0
    assert got["classes"]["comm"] == got["classes"]["transfer"] == 0.0
    # a profiler that recorded nothing is no data, not a step of no kernels
    monkeypatch.setattr(decompose, "bucket", lambda pairs, phase="step": dict.fromkeys(decompose.CLASSES, 0.0))
    with pytest.raises(RuntimeError, match="recorded no op time"):
        decompose.measure(point, steps=1, warmup=0)


def test_the_gemm_bench_times_the_projected_steps_own_gemms_priced_as_the_decomposition_prices_them(tmp_path):
    # results/gpu/gemm_bench.py on the CPU (its times say nothing of a GPU): its shapes are the projected step's
    # GEMMs, every one, and their prices add up to the GEMM class decompose.py sets beside the measured one
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "results" / "gpu" / "gemm_bench.py"
    spec = importlib.util.spec_from_file_location("gemm_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    suite, out = _suite(tmp_path, device="'cpu'"), tmp_path / "gemm.csv"
    summary = bench.main([str(out), "--suite", str(suite), "--gpu", "h100-sxm", "--device", "cpu",
                          "--seconds", "0.05", "--warmup", "1", "--timed", "2"])
    point, hw = load_suite(suite).points()[0], hardware.load("h100-sxm")
    projected = decompose.project(point, hw)
    gemms = [op for op in projected["trace"] if op.kind == "gemm"]
    rows = list(csv.DictReader(out.open()))
    assert summary == json.loads(Path(f"{out}.json").read_text())
    assert sum(int(r["count"]) for r in rows) == summary["gemms"] == len(gemms) > 0
    assert len({(r["m"], r["n"], r["k"], r["groups"]) for r in rows}) == len(rows) < len(gemms)  # shapes repeat
    assert summary["flops"] == pytest.approx(sum(op.flops for op in gemms))
    assert sum(float(r["gflop"]) * int(r["count"]) for r in rows) * 1e9 == pytest.approx(summary["flops"])
    assert summary["priced_s"] == pytest.approx(projected["classes"]["gemm"])
    assert summary["burst_s"] > 0 and summary["sustained_s"] > 0 and summary["replays"] >= 1
    assert summary["sm_clock_mhz"] is None and "power_limit_w" not in summary  # no NVML device on the CPU
    assert set(summary["jitter"]) == {str(w) for w in bench.WINDOWS}
    # the replay cut into windows of ~w priced seconds, in order, every GEMM in one (but a short tail)
    priced = [0.004, 0.004, 0.004, 0.02, 0.001, 0.001]
    assert bench.windows(priced, 0.01) == [range(0, 3), range(3, 4)]
    # the same window's spread across replays, the first left out: a steady window none, one that wanders its own
    steady = [[1.0, 2.0]] * 4
    wandering = [[9.0, 2.0], [1.0, 2.0], [1.1, 2.0], [0.9, 2.0]]
    assert bench.jitter(steady[1:], [range(0, 1), range(1, 2)]) == 0.0
    assert bench.jitter(wandering[1:], [range(0, 1)]) == pytest.approx(0.1)
    assert bench.jitter(wandering[1:], [range(0, 1), range(1, 2), range(0, 2)]) == pytest.approx(0.1 / 3)
    assert bench.jitter(steady[:2], [range(0, 1)]) is None  # too few replays to say
    a, b = bench.operands((4, 3, 2, 1), torch.float32, "cpu")  # mamf-finder.py's: B an (n, k) matrix transposed
    assert a.shape == (4, 2) and a.is_contiguous() and b.shape == (2, 3) and b.stride() == (1, 2)


def test_the_gpu_checks_fit_a_lent_machines_command_and_bring_back_what_they_measured():
    # a lent GPU machine runs one command for at most 10 minutes and returns only the files under $OUT: the script's
    # steps are each time-limited to within that, with room for the steps it does not limit (imports, the report),
    # and it packs results/gpu into $OUT after every step and on exit, so a run cut short keeps its measurements
    import re
    from pathlib import Path

    script = (Path(__file__).resolve().parents[2] / "results" / "gpu" / "run_gpu_checks.sh").read_text()
    limits = [int(s) for s in re.findall(r"^\s*timeout (\d+) ", script, re.M)]
    assert len(limits) == 5 and sum(limits) <= 540, limits
    assert "trap pack EXIT" in script and script.count("\npack\n") >= 4
    assert 'tar czf "$OUT/gpu.tgz" results/gpu' in script
