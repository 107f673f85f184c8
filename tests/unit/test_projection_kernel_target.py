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


@pytest.mark.parametrize("gpu,kernel", [("h100-sxm", "cudnn:"), ("a100-sxm", "flash:")])
def test_the_projected_row_names_the_kernel_its_tiles_were_priced_as(gpu, kernel):
    from cpbench.harness.run.rows import projected_time_columns

    point = _point()
    records = [project_rank(point, 0, load(gpu), gpus_per_node=8)]  # one rank: the row takes the slowest's
    assert projected_time_columns(records, 1e9, point)["attention_kernels"].startswith(kernel)


@pytest.mark.parametrize("backend,kernel", [("flash_attention_2", "attention"), ("flash_attention_3", "attention_fa3"),
                                            ("flash_attention_4", "attention_fa4")])
def test_a_flash_backends_point_projects_as_sdpa_with_its_calls_priced_as_its_own_kernel(backend, kernel):
    from cpbench.harness.run.rows import projected_time_columns

    point = load_suite("t.toml", text=SUITE.replace('["sdpa"]', f'["{backend}"]')).points()[0]
    record = project_rank(point, 0, load("h100-sxm"), gpus_per_node=8, keep_trace=True)
    kinds = {op.kind for op in record["trace"] if op.kind.startswith("attention")}
    assert kinds == {f"{kernel}_forward", f"{kernel}_backward"}, kinds  # every tile, no cuDNN left
    columns = projected_time_columns([record], 1e9, point)
    assert backend in columns["projected_pricing"] and "run as sdpa" in columns["projected_pricing"]
    sdpa = project_rank(_point(), 0, load("h100-sxm"), gpus_per_node=8)
    assert record["peak_bytes"] == sdpa["peak_bytes"]  # the same fused calls: the same memory


def test_a_kernel_the_card_does_not_run_is_an_error_that_names_it():
    point = load_suite("t.toml", text=SUITE.replace('["sdpa"]', '["flash_attention_3"]')).points()[0]
    with pytest.raises(ValueError, match=r"'a100-sxm' has no efficiency\.attention_fa3_forward"):
        project_rank(point, 0, load("a100-sxm"), gpus_per_node=8)
