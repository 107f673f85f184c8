"""What the time model's tests share (tests/unit/test_timing*.py, test_calibrate.py): a GPU profile of round figures,
an op builder, and a profile of one CPU core for ranking a measured CPU sweep."""

from __future__ import annotations

from cpbench.harness.project import hardware
from cpbench.harness.project.flops import attention
from cpbench.harness.project.trace import Op


def attention_flops(name, args):
    return attention(name, args)[0]


# A profile with round figures: 100 TFLOP/s bf16, 1 TB/s HBM, 100 GB/s NVLink, 10 GB/s network, 10 GB/s PCIe.
HW = hardware.Hardware(
    name="round", title="round figures", memory_bytes=80 << 30, peak_flops={"bfloat16": 100e12, "float32": 10e12},
    hbm_bytes_per_s=1e12, intra_node_bytes_per_s=100e9, inter_node_bytes_per_s=10e9, pcie_bytes_per_s=10e9,
    host_bytes_per_s=50e9, kernel_s=1e-6, cpu_op_s=0.0, cuda_launch_s=0.0, cpu_fsdp_collective_s=0.0, cpu_optimizer_tensor_s=0.0,
    intra_node_latency_s=0.0, inter_node_latency_s=1e-5, sms=100, gemm_best_shape=None, intra_node_half_bytes=0.0,
    inter_node_half_bytes=0.0, nccl_sm_fraction=0.0,
    efficiency={**dict.fromkeys(hardware.EFFICIENCIES, 1.0), "gemm": 0.5, "attention_forward": 0.4,
                "attention_backward": 0.25},
)


def op(kind="memory", stream="compute", flops=0.0, nbytes=0.0, reads=(), writes=(), group=1, phase="step",
       crosses=False, backward=False):
    return Op(stream, kind, phase, flops, nbytes, tuple(reads), tuple(writes), group, crosses, backward=backward)


# Rough figures of one core of a 2-core CPU, each rank of a cp 2 run having one (the profile format; what matters
# for ranking is that work, bytes, collectives and ops are all priced, not the absolute times).
CPU_CORE = """[cpu-core]
title = "one CPU core, gloo on loopback"
memory = "12GiB"
bf16_tflops = 0.02
fp32_tflops = 0.05
hbm_tb_s = 0.005
nvlink_gb_s = 2
network_gb_s = 1
pcie_gb_s = 10
host_gb_s = 5
kernel_s = 5e-6
cpu_op_s = 3e-5
cuda_launch_s = 0.0
cpu_fsdp_collective_s = 0.0
cpu_optimizer_tensor_s = 0.0
cpu_recompute_layer_s = 0.0
intra_node_latency_s = 5e-5
inter_node_latency_s = 5e-5
sms = 1
intra_node_half_mib = 0
inter_node_half_mib = 0
nccl_sm_fraction = 0.0
[cpu-core.efficiency]
gemm = 0.5
attention_forward = 0.3
attention_backward = 0.3
attention_cudnn_forward = 0.3
attention_cudnn_backward = 0.3
attention_efficient_forward = 0.3
attention_efficient_backward = 0.3
memory = 0.5
intra_node = 0.5
inter_node = 0.5
pcie = 0.5
host = 0.5
"""
