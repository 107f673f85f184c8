"""The slowest chip's pace (hardware.at_scale): chips of one GPU differ, and a synchronous step runs at its slowest
GPU's. Every expected value is worked out by hand from the order statistics of normal draws and the profile."""

from __future__ import annotations

import dataclasses
import math

import pytest

from cpbench.harness.project import hardware
from cpbench.harness.project.calibrate import Sample
from tests.timing_fixtures import CPU_CORE, HW, op


def test_the_slowest_of_n_chips_falls_the_expected_largest_of_n_normal_draws_below_the_median():
    e = hardware.expected_slowest
    assert e(1) == 0.0
    # closed forms: E[max of 2] = 1 / sqrt(pi), E[max of 3] = 3 / (2 sqrt(pi))
    assert e(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-6)
    assert e(3) == pytest.approx(3 / (2 * math.sqrt(math.pi)), abs=1e-6)
    assert e(8) == pytest.approx(1.42360, abs=1e-5)  # Harter's (1961) table of normal order statistics
    assert [e(n) for n in (8, 64, 128, 1024)] == sorted(e(n) for n in (8, 64, 128, 1024))


def test_a_step_over_more_gpus_runs_its_gemms_and_attention_at_the_slowest_ones_pace_and_nothing_else_slower():
    h100 = hardware.load("h100-sxm")  # its gemm figure is a node's slowest of 8; its attention, one chip's
    s = h100.chip_spread
    assert s > 0 and h100.gemm_pace_gpus == 8
    node = h100.at_scale(8)
    assert node.efficiency["gemm"] == pytest.approx(h100.efficiency["gemm"])
    assert node.efficiency["attention_cudnn_forward"] == pytest.approx(
        h100.efficiency["attention_cudnn_forward"] * (1 - s * 1.42360), rel=1e-6)
    big = h100.at_scale(128)
    assert big.efficiency["gemm"] == pytest.approx(
        h100.efficiency["gemm"] * (1 - s * hardware.expected_slowest(128)) / (1 - s * 1.42360), rel=1e-6)
    assert big.efficiency["gemm"] < h100.efficiency["gemm"]
    for key in ("memory", "memory_strided", "intra_node", "inter_node", "pcie", "host"):
        assert big.efficiency[key] == h100.efficiency[key], key
    assert (big.peak_flops, big.hbm_bytes_per_s) == (h100.peak_flops, h100.hbm_bytes_per_s)  # MFU keeps its peak
    # one GPU is the median chip: faster than the node's slowest the figure stands for
    assert h100.at_scale(1).efficiency["gemm"] > h100.efficiency["gemm"]
    a100 = hardware.load("a100-sxm")  # every figure one chip's
    assert a100.gemm_pace_gpus == 1 and a100.at_scale(1) == a100


def test_a_calibrated_sample_is_priced_at_its_own_gpus_pace():
    paced = dataclasses.replace(HW, chip_spread=0.01)
    trace = [op("gemm", flops=1e12), op("memory", nbytes=1e9)]
    one, many = Sample("a", [trace], "bfloat16", 1.0, gpus=1), Sample("b", [trace], "bfloat16", 1.0, gpus=64)
    gemm_s, memory_s = 1e12 / (100e12 * 0.5), 1e9 / 1e12
    assert one.projected(paced) == pytest.approx(gemm_s + memory_s)
    assert many.projected(paced) == pytest.approx(gemm_s / (1 - 0.01 * hardware.expected_slowest(64)) + memory_s)


def test_a_profile_written_before_the_chip_spread_has_none_and_bad_values_name_the_fix(tmp_path):
    old = tmp_path / "old.toml"
    old.write_text(CPU_CORE)  # a file `cpbench calibrate` wrote before the figure
    hw = hardware.load(str(old))
    assert (hw.chip_spread, hw.gemm_pace_gpus) == (0.0, 1) and hw.at_scale(128) == hw
    again = tmp_path / "again.toml"
    again.write_text(hw.to_toml())
    assert "chip_spread = 0.0" in hw.to_toml() and hardware.load(str(again)) == hw
    bad = tmp_path / "bad.toml"
    bad.write_text(hw.to_toml().replace("chip_spread = 0.0", "chip_spread = 0.5"))
    with pytest.raises(ValueError, match=r"chip_spread = 0.5: give the relative standard deviation"):
        hardware.load(str(bad))
    bad.write_text(hw.to_toml().replace("chip_spread = 0.0", "chip_spread = -0.01"))
    with pytest.raises(ValueError, match=r"chip_spread = -0.01: give the relative standard deviation"):
        hardware.load(str(bad))
    bad.write_text(hw.to_toml().replace("chip_spread = 0.0", 'chip_spread = "1 %"'))
    with pytest.raises(ValueError, match=r"chip_spread = '1 %': give a number"):
        hardware.load(str(bad))
    for value in ("0", "true"):
        bad.write_text(hw.to_toml().replace("gemm_pace_gpus = 1", f"gemm_pace_gpus = {value}"))
        with pytest.raises(ValueError, match=r"gemm_pace_gpus = (0|True): give how many GPUs"):
            hardware.load(str(bad))
    with pytest.raises(ValueError, match=r"at_scale\(0\): a step runs on 1 GPU or more"):
        hardware.load("h100-sxm").at_scale(0)
