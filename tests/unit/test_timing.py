"""The time model's prices (timing.py) on hand-computed ops: GEMMs, attention, collectives, the host's share of a
recomputed layer; the GPU profiles that carry the figures. Every expected time is worked out by hand from the profile."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cpbench.harness.project import hardware
from cpbench.harness.project.flops import causal_pairs
from cpbench.harness.project.timing import collective_seconds, host_seconds, op_seconds, simulate
from tests.timing_fixtures import CPU_CORE, HW, attention_flops, op


def test_a_gemm_costs_its_flops_over_the_efficient_peak_or_its_bytes_whichever_is_longer():
    # 4096 x 4096 x 4096: 2 * 4096^3 = 1.374e11 FLOPs at 50 TFLOP/s = 2.749 ms; 3 x 32 MiB bf16 = 0.1 ms of HBM
    flops, nbytes = 2.0 * 4096 ** 3, 3 * 4096 * 4096 * 2
    assert op_seconds(op("gemm", flops=flops, nbytes=nbytes), HW, "bfloat16") == pytest.approx(flops / 50e12)
    # a skinny one is bound by its bytes: 2e6 FLOPs (40 ns) against 1 GB (1 ms)
    assert op_seconds(op("gemm", flops=2e6, nbytes=1e9), HW, "bfloat16") == pytest.approx(1e-3)
    assert op_seconds(op("memory", nbytes=10.0), HW, "bfloat16") == HW.kernel_s  # never under a kernel's minimum
    assert op_seconds(op("gemm", flops=flops), HW, "float32") == pytest.approx(flops / 5e12)  # the fp32 peak


def test_attention_flops_count_the_pairs_a_causal_kernel_keeps_and_backward_is_two_and_a_half_times():
    q = torch.empty(1, 2, 4, 8, device="meta")  # [batch, heads, seq, head_dim]
    # causal: 4 queries see 1+2+3+4 = 10 keys; 4 FLOPs per pair per head-dim element, 2 heads: 4 * 10 * 2 * 8
    fwd = attention_flops("aten._scaled_dot_product_flash_attention", (q, q, q, 0.0, True))
    assert fwd == 640
    full = attention_flops("aten._scaled_dot_product_flash_attention", (q, q, q, 0.0, False))
    assert full == 4 * 16 * 2 * 8
    grad = (q, q, q, q, q, None, None, None, 4, 4, 0.0, True)
    assert attention_flops("aten._scaled_dot_product_flash_attention_backward", grad) == 2.5 * 640
    assert causal_pairs(2, 4) == 3 and causal_pairs(4, 2) == 3 + 2 * 2  # torch's is_causal: aligned top left
    # the flash kernels align the last query with the last key: 2 queries over 4 keys see 3 and 4
    assert causal_pairs(2, 4, "bottom_right") == 7 and causal_pairs(4, 2, "bottom_right") == 3
    # varlen with known offsets: documents of 3 and 1 tokens -> 6 + 1 causal pairs, [tokens, heads, dim]
    t = torch.empty(4, 2, 8, device="meta")
    offsets = torch.tensor([0, 3, 4])
    varlen = (t, t, t, offsets, offsets, 3, 3, 0.0, True)
    assert attention_flops("aten._flash_attention_forward", varlen) == 4 * 7 * 2 * 8


def test_collectives_cost_their_ring_algorithm_bytes_over_the_link_they_cross():
    mb = 8e6
    # all-to-all of 4 ranks: 3/4 of the input leaves each rank; 6 MB at 100 GB/s = 60 us
    assert collective_seconds("all_to_all", mb, 4, False, HW) == pytest.approx(60e-6)
    # all-gather of a 8 MB shard among 4: 3 shards arrive, 24 MB = 240 us
    assert collective_seconds("all_gather", mb, 4, False, HW) == pytest.approx(240e-6)
    # across nodes: 10 GB/s and 10 us per hop: 6 MB = 600 us + 3 hops
    assert collective_seconds("all_to_all", mb, 4, True, HW) == pytest.approx(600e-6 + 30e-6)
    assert collective_seconds("all_reduce", mb, 2, False, HW) == pytest.approx(2 * 4e6 / 100e9)
    assert collective_seconds("p2p", mb, 2, False, HW) == pytest.approx(80e-6)
    assert collective_seconds("all_gather", mb, 1, False, HW) == 0.0  # a group of one moves nothing


def test_a_collective_across_nodes_runs_one_ring_a_gpu_of_the_node_each_through_its_own_link():
    # 16 ranks on 2 nodes of 8, each GPU with its own link (10 us a hop); NVLink 100 GB/s beside it
    mb, slow = 8e6, dataclasses.replace(HW, inter_node_bytes_per_s=1e9)  # 1 GB/s links: the network bounds it
    # all-reduce of 8 MB: a ring moves 2 x 15/16 x 8 MB = 15 MB through each of its links; 8 rings share it, each
    # leaving a node through another GPU's link: 1.875 MB a link = 1.875 ms, + 2 x 15 hops
    assert collective_seconds("all_reduce", mb, 16, True, slow, nodes=2) == pytest.approx(1.875e-3 + 30e-5)
    # with 10 GB/s links: 187.5 us and 30 hops of 10 us, longer than the ring's 15 MB over NVLink (150 us); with
    # 20 GB/s links and no hop latency, NVLink's 150 us bounds it
    assert collective_seconds("all_reduce", mb, 16, True, HW, nodes=2) == pytest.approx(187.5e-6 + 30e-5)
    fast = dataclasses.replace(HW, inter_node_latency_s=0.0, inter_node_bytes_per_s=20e9)
    assert collective_seconds("all_reduce", mb, 16, True, fast, nodes=2) == pytest.approx(150e-6)  # NVLink's
    # all-gather of 1 MB shards over 4 nodes of 4: 15 MB through a ring's links over 4 rings; a reduce-scatter of
    # 16 MB: 15/16 of it, over 4
    assert collective_seconds("all_gather", 1e6, 16, True, slow, nodes=4) == pytest.approx(15e-3 / 4 + 15e-5)
    assert collective_seconds("reduce_scatter", 16e6, 16, True, slow, nodes=4) == pytest.approx(15e-3 / 4 + 15e-5)
    # all-to-all: what goes to the other nodes' 12 ranks leaves through the rank's own link
    assert collective_seconds("all_to_all", 8e6, 16, True, slow, nodes=4) == pytest.approx(6e-3 + 15e-5)
    # a group spread unevenly (2 and 4 ranks): the node with 2 has 2 links for the rings
    assert collective_seconds("all_gather", 1e6, 6, True, slow, nodes=2, fewest=2) == pytest.approx(5e-3 / 2 + 5e-5)
    assert collective_seconds("all_to_all", 6e6, 6, True, slow, nodes=2, fewest=2) == pytest.approx(4e-3 + 5e-5)
    # the nodes unknown: one rank a node, the whole ring through each link
    assert collective_seconds("all_reduce", mb, 16, True, slow) == pytest.approx(2 * 15 / 16 * 8e-3 + 30e-5)


def test_the_b200_profile_prices_the_cross_node_all_reduces_its_network_figure_was_read_from():
    """ml-engineering network/README.md, 4 nodes of 8 B200 over EFA v4: all_reduce busbw by payload, from which the
    profile's `inter_node` (47.2 GB/s of each GPU's 50) was read; the payloads an FSDP step's collectives move
    (128 MiB and up) are priced within 10 % (the hops' assumed latency makes 16 MiB slow)."""
    hw = hardware.load("b200")
    for payload, busbw in {128 << 20: 197.94, 1 << 30: 361.99, 4 << 30: 377.34, 16 << 30: 381.80}.items():
        measured = payload * 2 * 31 / 32 / (busbw * 1e9)
        assert collective_seconds("all_reduce", payload, 32, True, hw, nodes=4) == pytest.approx(measured, rel=0.1)


def test_every_shipped_profile_loads_and_a_written_profile_reads_back(tmp_path):
    profiles = hardware.builtin()
    assert {"h100-sxm", "h100-pcie", "h200", "a100-sxm", "b200"} <= set(profiles)
    for hw in profiles.values():
        assert hw.sources.get("bf16_tflops") and hw.memory_bytes > 0
        path = tmp_path / f"{hw.name}.toml"
        path.write_text(hw.to_toml())
        assert hardware.load(str(path)) == hw
    assert hardware.for_device("NVIDIA H100 80GB HBM3").name == "h100-sxm"


def test_a_bad_profile_names_the_field_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match="not a known GPU .*h100-sxm"):
        hardware.load("h900")
    text = hardware.builtin()["a100-sxm"].to_toml().replace("gemm = 0.827", "gemm = 1.7")
    (tmp_path / "bad.toml").write_text(text)
    with pytest.raises(ValueError, match=r"efficiency.gemm = 1.7: give a fraction"):
        hardware.load(str(tmp_path / "bad.toml"))
    (tmp_path / "short.toml").write_text("[mine]\nbf16_tflops = 100\n")
    with pytest.raises(ValueError, match="missing .*hbm_tb_s"):
        hardware.load(str(tmp_path / "short.toml"))


def test_a_models_own_sdpa_call_is_priced_as_the_kernel_sdpa_picks_on_the_gpu():
    cudnn = dataclasses.replace(HW.with_efficiency(attention_cudnn_forward=0.8), sdpa_kernel="cudnn")
    sdpa = op("attention_sdpa_forward", flops=40e12 * 1e-3)  # 1 ms at the flash efficiency (0.4 of 100 TFLOP/s)
    assert op_seconds(sdpa, HW, "bfloat16") == pytest.approx(1e-3)  # HW: flash
    assert op_seconds(sdpa, cudnn, "bfloat16") == pytest.approx(0.5e-3)
    ring_tile = op("attention_forward", flops=40e12 * 1e-3)  # an explicit flash call stays flash
    assert op_seconds(ring_tile, cudnn, "bfloat16") == pytest.approx(1e-3)
    shipped = hardware.builtin()
    assert shipped["h100-sxm"].sdpa_kernel == "cudnn" and shipped["a100-sxm"].sdpa_kernel == "flash"


def test_every_attention_kind_the_trace_makes_has_an_efficiency_on_every_sdpa_kernel():
    from cpbench.harness.project.efficiency import efficiency_key
    from cpbench.harness.project.flops import ATTENTION

    kinds = {f"attention{spec.family}_{spec.direction}" for spec in ATTENTION.values()}
    kinds |= {f"attention_sdpa_{d}" for d in ("forward", "backward")}
    for kernel in hardware.SDPA_KERNELS:
        hw = dataclasses.replace(HW, sdpa_kernel=kernel)
        assert {efficiency_key(k, hw) for k in kinds} <= set(hardware.EFFICIENCIES), kernel


def test_a_recomputed_layer_costs_the_host_its_checkpoint_and_the_gpu_nothing():
    host = dataclasses.replace(HW, cpu_op_s=1e-5, cpu_recompute_layer_s=1e-3, cpu_recompute_replay_s=3e-3)
    mark, replay = op("checkpoint"), op("replay")
    assert host_seconds(mark, host) == 1e-3 and op_seconds(mark, host, "bfloat16") == 0.0
    assert host_seconds(replay, host) == 3e-3 and op_seconds(replay, host, "bfloat16") == 0.0
    kernels = [op("memory", nbytes=1e6)] * 3  # 1 us each, issued 10 us apart: the host leads
    plain, marked = (simulate(t, host, "bfloat16") for t in (kernels, [kernels[0], mark, kernels[1], replay,
                                                                      kernels[2]]))
    assert marked["step_s"] == pytest.approx(plain["step_s"] + 4e-3)
    assert marked["overhead_s"] == pytest.approx(plain["overhead_s"] + 4e-3)  # the GPU waits for the host
    assert marked["compute_s"] == plain["compute_s"]


def test_an_op_under_op_recompute_costs_the_host_its_modes_and_the_gpu_nothing_more():
    host = dataclasses.replace(HW, cpu_op_s=1e-5, cpu_selective_op_s=2e-5)
    plain = op("memory", nbytes=1e6)
    under = plain._replace(selective=True)
    assert host_seconds(under, host) == pytest.approx(host_seconds(plain, host) + 2e-5)
    assert op_seconds(under, host, "bfloat16") == op_seconds(plain, host, "bfloat16")
    assert hardware.load("h100-sxm").cpu_selective_op_s > 0  # measured here (dispatch.py), in every profile


def test_a_profile_written_before_the_recompute_and_ramp_figures_loads_and_a_negative_time_is_refused(tmp_path):
    # a file `cpbench calibrate` wrote before cpu_recompute_layer_s and memory_ramp_s: what the model assumed then (0)
    old = tmp_path / "old.toml"
    old.write_text(CPU_CORE.replace("cpu_recompute_layer_s = 0.0\n", ""))
    hw = hardware.load(str(old))
    assert (hw.cpu_recompute_layer_s, hw.cpu_recompute_replay_s, hw.memory_ramp_s, hw.cpu_selective_op_s) == \
        (0.0, 0.0, 0.0, 0.0)
    assert "memory_ramp_s" in hw.to_toml() and hardware.load(str(old)) == hw
    # one written before the replay's figure (CPU_CORE has none): the layer's whole figure stays at its forward
    last = tmp_path / "last.toml"
    last.write_text(CPU_CORE.replace("cpu_recompute_layer_s = 0.0\n", "cpu_recompute_layer_s = 1e-3\n"))
    assert (hardware.load(str(last)).cpu_recompute_layer_s, hardware.load(str(last)).cpu_recompute_replay_s) == \
        (1e-3, 0.0)
    assert "cpu_recompute_replay_s = 0.0" in hardware.load(str(last)).to_toml()
    bad = tmp_path / "bad.toml"
    bad.write_text(CPU_CORE.replace("cpu_recompute_layer_s = 0.0\n", "cpu_recompute_layer_s = -1e-3\n"))
    with pytest.raises(ValueError, match=r"cpu_recompute_layer_s = -0.001: give a time of 0 or more"):
        hardware.load(str(bad))
