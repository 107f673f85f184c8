"""The time model's arithmetic (timing.py) on hand-computed traces, and its overlap rules; the op trace (trace.py)
on a tiny projected step. Every expected time below is worked out by hand from the profile's figures."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cpbench.harness.project import hardware
from cpbench.harness.project.timing import BREAKDOWN, collective_seconds, host_seconds, op_seconds, simulate
from cpbench.harness.project.trace import Op
from cpbench.harness.project.flops import attention, causal_pairs


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


def _ring_step(tile_flops: float) -> list[Op]:
    """A ring step: receive the next K/V block (8 MB: 80 us) while the current tile computes, then the next tile
    reads the received block."""
    return [op("p2p", "nccl", nbytes=8e6, writes=[2], group=2),
            op("attention_forward", flops=tile_flops, reads=[1]),
            op("attention_forward", flops=tile_flops, reads=[2])]


def test_a_ring_receive_hides_behind_the_tile_it_overlaps_and_shows_when_the_tile_is_shorter():
    tile = 40e12 * 100e-6  # 100 us at 40 TFLOP/s (attention forward: 0.4 of 100)
    hidden = simulate(_ring_step(tile), HW, "bfloat16")
    assert hidden["step_s"] == pytest.approx(200e-6) and hidden["comm_exposed_s"] == pytest.approx(0.0)
    short = simulate(_ring_step(tile / 4), HW, "bfloat16")  # 25 us tiles: the 80 us receive shows for 55 us
    assert short["step_s"] == pytest.approx(80e-6 + 25e-6)
    assert short["comm_exposed_s"] == pytest.approx(55e-6) and short["compute_s"] == pytest.approx(50e-6)


def test_an_all_to_all_waits_for_the_compute_before_it_and_is_exposed():
    trace = [op("memory", nbytes=1e8, writes=[1]),  # 100 us: q/k/v made
             op("all_to_all", "nccl", nbytes=8e6, reads=[1], writes=[2], group=2),  # 40 us
             op("memory", nbytes=1e8, reads=[2])]  # 100 us: attention's input
    t = simulate(trace, HW, "bfloat16")
    assert t["step_s"] == pytest.approx(240e-6) and t["comm_exposed_s"] == pytest.approx(40e-6)


def test_fsdp_all_gathers_run_one_layer_ahead_of_the_copy_out():
    # layer i's copy-out at 10 us, its compute 1 ms; the next all-gather (500 us) starts after the copy-out, so it
    # hides behind layer i; a third all-gather waits for the next copy-out and shows
    gather = dict(stream="ag", nbytes=50e6 / 1, group=2)  # 50 MB shard among 2: 500 us
    trace = [op("copy_out", nbytes=1e7, writes=[10]),
             op("all_gather", reads=[], writes=[11], **gather),
             op("gemm", flops=50e12 * 1e-3, reads=[10]),
             op("copy_out", nbytes=1e7, reads=[11], writes=[12]),
             op("all_gather", reads=[], writes=[13], **gather),
             op("copy_out", nbytes=1e7, reads=[13])]
    t = simulate(trace, HW, "bfloat16")
    # 10 us copy-out, 1 ms gemm (the gather hides), 10 us copy-out at 1.02 ms, then the gather: 1.02 -> 1.52 ms
    assert t["step_s"] == pytest.approx(10e-6 + 1e-3 + 10e-6 + 500e-6 + 10e-6)
    assert t["comm_exposed_s"] == pytest.approx(500e-6)


def test_the_optimizer_waits_for_the_last_reduce_scatter_and_the_breakdown_sums_to_the_step():
    trace = [op("gemm", flops=50e12 * 1e-3, writes=[1]),  # 1 ms backward
             op("reduce_scatter", "rs", nbytes=400e6, reads=[1], writes=[2], group=2),  # 2 ms after it
             op("memory", nbytes=1e9, reads=[5], phase="optimizer")]  # 1 ms, reads no reduced buffer itself
    t = simulate(trace, HW, "bfloat16")
    assert t["step_s"] == pytest.approx(1e-3 + 2e-3 + 1e-3)
    assert t["optimizer_s"] == pytest.approx(1e-3) and t["comm_exposed_s"] == pytest.approx(2e-3)
    assert sum(t[k] for k in BREAKDOWN) == pytest.approx(t["step_s"])


def test_the_forward_and_backward_times_are_what_timers_around_them_read():
    # forward: 1 ms; backward: 2 ms of kernels, then its gradients' reduce-scatter (2 ms) the optimizer waits for;
    # the optimizer: 1 ms. A timer around the backward (a synchronize after it) reads its kernels and the reduction.
    trace = [op("gemm", flops=50e12 * 1e-3, writes=[1]),
             op("all_gather", "ag", nbytes=1e6, group=2, backward=True),  # prefetched for backward, under the forward
             op("gemm", flops=50e12 * 2e-3, reads=[1], writes=[2], backward=True),
             op("reduce_scatter", "rs", nbytes=400e6, reads=[2], writes=[3], group=2, backward=True),
             op("memory", nbytes=1e9, reads=[5], phase="optimizer")]
    t = simulate(trace, HW, "bfloat16")
    assert t["forward_s"] == pytest.approx(1e-3) and t["backward_s"] == pytest.approx(2e-3 + 2e-3)
    assert t["forward_s"] + t["backward_s"] + t["optimizer_s"] == pytest.approx(t["step_s"])
    # no backward (a forward alone): all of it is the forward's
    alone = simulate(trace[:2], HW, "bfloat16")
    assert alone["forward_s"] == pytest.approx(alone["step_s"]) and alone["backward_s"] == 0.0


def test_the_attention_share_splits_the_step_by_the_gpus_kernel_time_without_collectives():
    # compute: 1 ms gemm, 1 ms attention forward (40 TFLOP/s effective: 100e12 * 0.4), 2 ms gemm; a 1 ms all-gather
    # on its own stream overlaps them (left out, as a profiler's NCCL kernels are); the step is 4 ms
    trace = [op("gemm", flops=50e12 * 1e-3, writes=[1]),
             op("all_gather", "ag", nbytes=100e6, group=2),  # 100 MB at 100 GB/s: 1 ms, hidden under the compute
             op("attention_forward", flops=40e12 * 1e-3, reads=[1], writes=[2]),
             op("gemm", flops=50e12 * 2e-3, reads=[2])]
    t = simulate(trace, HW, "bfloat16")
    assert t["step_s"] == pytest.approx(4e-3) and t["comm_exposed_s"] == pytest.approx(0.0)
    assert t["attention_s"] == pytest.approx(4e-3 * 1 / 4)
    # an exposed collective lengthens the step, and the split carries it by the kernels' shares (one clock)
    slow = simulate([*trace, op("all_reduce", "nccl", nbytes=400e6, reads=[5], group=2)], HW, "bfloat16")
    assert slow["step_s"] > t["step_s"] and slow["attention_s"] == pytest.approx(slow["step_s"] / 4)
    assert simulate(trace[1:2], HW, "bfloat16")["attention_s"] == 0.0  # no kernel but a collective's
    # a copy kernel on a collective's stream (FSDP2's copy-in) and an offload copy on the compute stream are GPU
    # kernels a profiler counts (1 ms each); the host's own optimizer step runs no kernel: 6 ms of kernels, 1 of them
    # attention's
    more = [*trace, op("memory", "ag", nbytes=1e9), op("h2d", nbytes=1e7),
            op("memory", "host", nbytes=1e9, phase="optimizer")]
    t = simulate(more, HW, "bfloat16")
    assert t["attention_s"] == pytest.approx(t["step_s"] / 6)


def test_offload_copies_on_the_compute_stream_are_exposed_and_the_host_overhead_shows_when_it_leads():
    trace = [op("d2h", nbytes=1e8), op("gemm", flops=50e12 * 1e-4)]  # 10 ms over PCIe, then 100 us
    t = simulate(trace, HW, "bfloat16")
    assert t["transfer_exposed_s"] == pytest.approx(1e-2) and t["step_s"] == pytest.approx(1e-2 + 1e-4)
    slow_host = dataclasses.replace(HW, cpu_op_s=1e-3)  # each op dispatched 1 ms after the one before
    t = simulate([op("memory", nbytes=1e6)] * 3, slow_host, "bfloat16")
    assert t["overhead_s"] == pytest.approx(3e-3 - 2e-6) and t["step_s"] == pytest.approx(3e-3 + 1e-6)


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
    text = hardware.builtin()["a100-sxm"].to_toml().replace("gemm = 0.869", "gemm = 1.7")
    (tmp_path / "bad.toml").write_text(text)
    with pytest.raises(ValueError, match=r"efficiency.gemm = 1.7: give a fraction"):
        hardware.load(str(tmp_path / "bad.toml"))
    (tmp_path / "short.toml").write_text("[mine]\nbf16_tflops = 100\n")
    with pytest.raises(ValueError, match="missing .*hbm_tb_s"):
        hardware.load(str(tmp_path / "short.toml"))


def _synthetic_point(seq: int, cp: int) -> list[Op]:
    """A trace shaped like a CP step of `seq` tokens on `cp` ranks: GEMMs, attention tiles beside ring receives,
    element-wise work, a reduce-scatter and the optimizer."""
    tokens = seq // cp
    trace = []
    for layer in range(4):
        trace.append(op("gemm", flops=2.0 * tokens * 4096 * 4096 * 12, nbytes=tokens * 4096 * 2 * 6, writes=[layer]))
        for step in range(cp):
            trace.append(op("p2p", "nccl", nbytes=tokens * 1024 * 2 * 2, writes=[100 + step], group=cp))
            trace.append(op("attention_forward", flops=4.0 * tokens * tokens * 4096, reads=[99 + step]))
            trace.append(op("attention_backward", flops=10.0 * tokens * tokens * 4096, reads=[99 + step]))
        trace.append(op("memory", nbytes=tokens * 4096 * 2 * 20))
    trace.append(op("reduce_scatter", "rs", nbytes=4e8, reads=[0], writes=[7], group=cp))
    trace.append(op("memory", nbytes=6e9 / cp, phase="optimizer"))
    return trace


def test_calibration_recovers_the_step_times_of_a_synthetic_measured_sweep_and_reports_held_out_points():
    from cpbench.harness.project.calibrate import Sample, calibrate

    truth = HW.with_efficiency(gemm=0.72, attention_forward=0.55, attention_backward=0.42, memory=0.6,
                               intra_node=0.7)
    points = [(seq, cp) for seq in (8192, 16384, 32768, 65536) for cp in (2, 4)]
    samples = [Sample(f"s{seq}/cp{cp}", [_synthetic_point(seq, cp)], "bfloat16", 0.0) for seq, cp in points]
    for s in samples:  # "measured": the true profile's times
        s.measured_s = s.projected(truth)
    start = HW  # gemm 0.5, attention 0.4 / 0.25, memory 1.0, intra_node 1.0
    held = ["s65536/cp2", "s8192/cp4"]
    hw, rows, errors = calibrate(samples, start, "fitted", holdout=held, run="synthetic")
    assert errors["held_out"]["points"] == 2 and errors["held_out"]["max_abs_error"] < 0.02
    before = max(abs(r["before_s"] / r["measured_s"] - 1) for r in rows)
    after = max(abs(r["after_s"] / r["measured_s"] - 1) for r in rows)
    assert before > 0.2  # the starting profile is far off
    assert after < 0.02, rows  # every point, the two held out included, within 2 % once fitted
    assert {r["point_id"] for r in rows if r["held_out"]} == set(held)
    assert hw.name == "fitted" and "synthetic" in hw.sources["efficiency"]
    assert abs(hw.efficiency["attention_backward"] / 0.42 - 1) < 0.1  # the dominant class is found, not just a sum
    assert hw.efficiency["attention_cudnn_forward"] == start.efficiency["attention_cudnn_forward"]  # unused: kept


def test_a_projected_step_is_traced_with_its_streams_collectives_transfers_and_host_optimizer():
    from cpbench.harness.project.projection import project_rank
    from cpbench.harness.suite.spec import load_suite

    text = ('name = "t"\nmodel = "tiny-llama"\nseq_lens = [256]\ncp_sizes = [2]\ncp_styles = ["cp_ring"]\n'
            'dtype = "bfloat16"\ndevice = "cuda"\nactivation_checkpointing = true\noffload_activations = true\n'
            'offload_params = true\nwarmup_steps = 1\nmeasured_steps = 1\n')
    point = load_suite("t.toml", text=text).points()[0]
    record = project_rank(point, 0, HW, gpus_per_node=1, keep_trace=True)
    ops = record["trace"]
    kinds = {(o.stream, o.kind) for o in ops}
    # the ring's K/V blocks (point-to-point on NCCL's stream), the CUDA flash tiles, FSDP2's own streams
    assert {("nccl", "p2p"), ("compute", "attention_forward"), ("compute", "attention_backward"),
            ("ag", "all_gather"), ("rs", "reduce_scatter"), ("compute", "gemm")} <= kinds
    assert all(o.group == 2 and o.crosses_nodes for o in ops if o.kind in ("p2p", "all_gather"))  # 1 GPU a node
    # FSDP2 copies a reduce-scatter's input in on the compute stream (foreach_reduce), and reduces it on its own
    assert {o.stream for o in ops if o.name == "fsdp.chunk_cat"} == {"compute"}
    # every byte the host ledger moved is a transfer of the trace: checkpoints on the compute stream, parameters up
    # beside the all-gathers, gradients down beside the reduce-scatters
    for direction in ("d2h", "h2d"):
        assert sum(o.bytes for o in ops if o.kind == direction) == record[f"{direction}_bytes"] > 0
    assert {o.stream for o in ops if o.kind in ("d2h", "h2d")} == {"compute", "ag", "rs"}
    assert any(o.stream == "host" and o.phase == "optimizer" for o in ops)  # AdamW on the host's copies
    t = record["time"]
    assert t["transfer_exposed_s"] > 0 and t["step_s"] == pytest.approx(sum(t[k] for k in BREAKDOWN))
    # the backward's ops (the attention's backward, the reduce-scatters) follow every forward one: the loss is the
    # forward's last work, the optimizer comes after both
    step = [o for o in ops if o.phase == "step" and o.kind not in ("checkpoint", "sync")]
    first = next(i for i, o in enumerate(step) if o.backward)
    assert all(o.backward for o in step[first:] if o.stream == "compute")
    assert not any(o.backward for o in step[:first]) and any(o.kind == "attention_forward" for o in step[:first])
    assert all(o.backward for o in ops if o.kind in ("attention_backward", "reduce_scatter"))
    assert 0 < t["forward_s"] < t["forward_s"] + t["backward_s"] < t["step_s"]
    # across nodes (10 GB/s) the same step is slower than inside one (100 GB/s)
    inside = simulate([o._replace(crosses_nodes=False) for o in ops], HW, "bfloat16")
    assert inside["step_s"] < t["step_s"]


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
CPU_POINTS = ("s512/cp2/eager/cp_ulysses", "s2048/cp2/eager/cp_ulysses", "s512/cp2/sdpa/cp_ulysses",
              "s2048/cp2/sdpa/cp_ulysses", "s2048/cp2/sdpa/cp_ring_zigzag")


def test_projected_times_rank_measured_cpu_points_as_their_measurements_do(tmp_path):
    """Rank agreement with a measured CPU sweep (the default suite's committed baseline), not absolute time: of
    its cp 2 points (ranks that share the machine alike), every pair whose measured steps differ by more than a
    quarter (closer pairs are within a 2-core machine's noise) comes out in the same order projected."""
    import json
    from pathlib import Path

    from cpbench.harness.project.projection import project_rank, projected_ranks
    from cpbench.harness.suite.spec import Point
    from cpbench.report.runs.load import load_run

    (tmp_path / "cpu.toml").write_text(CPU_CORE)
    cpu = hardware.load(str(tmp_path / "cpu.toml"))
    baseline = load_run(Path(__file__).parents[2] / "results" / "baselines" / "smoke.parquet")
    rows = baseline[baseline["point_id"].isin([f"tiny-qwen3/{p}" for p in CPU_POINTS])]
    assert len(rows) == len(CPU_POINTS) and (rows["status"] == "ok").all()
    measured, projected = {}, {}
    for r in rows.to_dict("records"):
        point = Point.from_dict(json.loads(r["spec_json"]))
        projected[r["point_id"]] = max(project_rank(point, rank, cpu, gpus_per_node=2)["time"]["step_s"]
                                       for rank in projected_ranks(point))
        measured[r["point_id"]] = r["step_time_median_s"]
    judged = [(a, b) for a in measured for b in measured if measured[a] > 1.25 * measured[b]]
    assert len(judged) >= 6, measured  # 512 and 2048 tokens, eager and sdpa: clearly different steps
    discordant = [(a, b) for a, b in judged if not projected[a] > projected[b]]
    table = "; ".join(f"{pid.split('/', 1)[1]}: measured {measured[pid]:.4f} s, projected {projected[pid]:.4f} s"
                      for pid in sorted(measured, key=measured.get))
    assert not discordant, table


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


def test_the_trace_says_how_many_nodes_each_collectives_group_spans():
    from cpbench.harness.project.projection import project_rank
    from cpbench.harness.project.timing import COLLECTIVE_KINDS
    from cpbench.harness.suite.spec import load_suite

    text = ('name = "t"\nmodel = "tiny-llama"\nseq_lens = [64]\ncp_sizes = [2]\nworld_size = 4\n'
            'attn_implementations = ["sdpa"]\ncp_styles = ["cp_ulysses"]\ndtype = "bfloat16"\ndevice = "cuda"\n')
    point = load_suite("t.toml", text=text).points()[0]
    for per_node, nodes in ((2, 2), (8, 1)):
        ops = project_rank(point, 0, hardware.load("h100-sxm"), gpus_per_node=per_node, keep_trace=True)["trace"]
        # fsdp 2 x cp 2: FSDP's group holds ranks 0 and 2, the cp group 0 and 1 (rank 0's)
        spans = {(o.group, o.nodes, o.crosses_nodes) for o in ops if o.kind in COLLECTIVE_KINDS and o.group > 1}
        assert spans, "no collective traced"
        assert all(n in (1, nodes) and c == (n > 1) for _, n, c in spans), spans
        assert any(n == nodes for _, n, _ in spans)


def test_a_kernel_beside_a_collective_slows_only_while_the_collective_runs():
    from cpbench.harness.project.timing import _beside_collectives, _union

    # a 100 us kernel; NCCL holds 18 % of the SMs while a collective runs: 0.82 of its speed then, full speed after
    assert _beside_collectives(0.0, 100e-6, [(0.0, 50e-6)], 0.18) == pytest.approx(50e-6 + (100e-6 - 41e-6))
    assert _beside_collectives(0.0, 100e-6, [(0.0, 110e-6)], 0.18) == pytest.approx(110e-6 + (100e-6 - 90.2e-6))
    assert _beside_collectives(0.0, 100e-6, [(0.0, 1.0)], 0.18) == pytest.approx(100e-6 / 0.82)  # throughout
    # two collectives at once count once: 0-20 free, 20-60 at half speed (20 us of work), the rest free
    assert _beside_collectives(0.0, 100e-6, _union([(20e-6, 40e-6), (30e-6, 60e-6)]), 0.5) == pytest.approx(120e-6)
    # from the first span that ends after the kernel starts (the simulation finds it by bisection)
    assert _beside_collectives(50e-6, 100e-6, [(0.0, 10e-6), (60e-6, 80e-6)], 0.5, 1) == pytest.approx(110e-6)
    assert _beside_collectives(0.0, 100e-6, [(200e-6, 300e-6)], 0.5) == pytest.approx(100e-6)  # after it ends
    assert _beside_collectives(0.0, 100e-6, [(0.0, 1.0)], 0.0) == 100e-6


def test_a_kernel_is_slowed_by_a_collective_beside_it_whichever_the_code_issued_first():
    # FSDP2 issues a layer's all-gather after the layer before has dispatched its kernels, which the GPU still runs:
    # the kernel loses NCCL's SMs as much as one issued after the collective
    hw = dataclasses.replace(HW, nccl_sm_fraction=0.2)
    gemm = op("gemm", flops=50e12 * 1e-3)  # 1 ms alone
    gather = op("all_gather", "ag", nbytes=1e9, writes=[9], group=2)  # 10 ms from the start
    before, after = (simulate(trace, hw, "bfloat16")["compute_s"] for trace in ([gather, gemm], [gemm, gather]))
    assert before == pytest.approx(1e-3 / 0.8) and after == pytest.approx(before)


def test_a_layers_gradient_copy_in_waits_for_the_reduce_scatter_before_it():
    # FSDP2 keeps one reduce-scatter input alive (reduce_scatter_max_input_buffers = 1, _fsdp_param_group.py
    # post_backward): the compute stream waits for the previous reduce-scatter before copying the next layer's
    # gradients in (fsdp.chunk_cat), and the kernels after the copy-in wait with it
    def copy_in(reads, writes):
        return Op("compute", "memory", "step", 0.0, 1e6, tuple(reads), tuple(writes), name="fsdp.chunk_cat",
                  backward=True)

    trace = [op("gemm", flops=50e12 * 1e-3, writes=[1], backward=True),  # a layer's backward: 1 ms
             copy_in([1], [2]),  # 1 us
             op("reduce_scatter", "rs", nbytes=800e6, reads=[2], writes=[3], group=2, backward=True),  # 4 ms
             op("gemm", flops=50e12 * 1e-3, writes=[4], backward=True),  # the layer before: 1 ms beside it
             copy_in([4], [5]),  # waits for the first reduce-scatter: 5.001 ms
             op("reduce_scatter", "rs", nbytes=800e6, reads=[5], writes=[6], group=2, backward=True),
             op("gemm", flops=50e12 * 10e-3, backward=True)]  # 10 ms more, after the copy-in
    t = simulate(trace, HW, "bfloat16")
    assert t["step_s"] == pytest.approx(1e-3 + 1e-6 + 4e-3 + 1e-6 + 10e-3)
    assert t["comm_exposed_s"] == pytest.approx(4e-3 - 1e-3)  # the compute stream idled for the reduce-scatter
