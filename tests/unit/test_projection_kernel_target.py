"""A projection chooses the ring's kernels for the GPU its profile names (`estimate --gpu`): the profile's compute
capability and cuDNN decide, as torch decides on that card, so the projected step's tiles call the op the card would
run and the trace prices that op: an H100's sdpa ring tiles are cuDNN's, an A100's the flash kernel's."""

from __future__ import annotations

import pytest

from cpbench.cp.ring.target import KernelTarget
from cpbench.harness.project.hardware import load
from cpbench.harness.project.projection import kernel_target_of, project_rank
from cpbench.harness.suite.spec import load_suite

SUITE = """
name = "t"
model = "tiny-qwen3"
seq_lens = [64]
cp_sizes = [2]
world_size = 2
attn_implementations = ["sdpa"]
cp_styles = ["cp_ring_zigzag"]
dtype = "bfloat16"
device = "cuda"
"""


def _point():
    return load_suite("t.toml", text=SUITE).points()[0]


def test_the_profile_names_the_target():
    point = _point()
    h100 = kernel_target_of(point, load("h100-sxm"))
    assert h100 == KernelTarget(capability=(9, 0), cudnn_version=92000, sdpa_kernel="cudnn")
    assert kernel_target_of(point, load("a100-sxm")).capability == (8, 0)
    assert kernel_target_of(point) == "cuda"  # no profile: CUDA's kernels, as on an A100
    cpu = load_suite("t.toml", text=SUITE.replace('device = "cuda"', 'device = "cpu"')).points()[0]
    assert kernel_target_of(cpu, load("h100-sxm")) == "cpu"


@pytest.mark.parametrize("gpu,kind", [("h100-sxm", "attention_cudnn_forward"), ("a100-sxm", "attention_forward")])
def test_the_projected_ring_tiles_call_the_cards_kernel(gpu, kind):
    ops = project_rank(_point(), 0, load(gpu), gpus_per_node=8, keep_trace=True)["trace"]
    kinds = {op.kind for op in ops if op.kind.startswith("attention")}
    assert kind in kinds and kind.replace("forward", "backward") in kinds, kinds
    assert (gpu == "h100-sxm") == any("cudnn" in k for k in kinds)
