"""The time model's schedule (timing.simulate) on hand-built traces: what overlaps what on which stream, the
breakdown, the parts a timer reads, and a kernel slowed by the collectives beside it."""

from __future__ import annotations

import dataclasses

import pytest

from cpbench.harness.project.timing import BREAKDOWN, simulate
from cpbench.harness.project.trace import Op
from tests.timing_fixtures import HW, op


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
