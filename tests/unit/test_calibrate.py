"""`cpbench calibrate` on a measured sweep: the committed CPU baseline of the default suite, fitted on some of its
points and judged on the others; the held-out error reported apart; a run measured on another GPU refused; and the
step times of a synthetic sweep recovered."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpbench.harness.project import hardware
from cpbench.harness.project.calibrate import calibrate, check_device, samples_of_run
from cpbench.harness.project.trace import Op
from cpbench.report.runs import store
from tests.timing_fixtures import CPU_CORE, HW, op

BASELINE = Path(__file__).parents[2] / "results" / "baselines" / "smoke.parquet"
# The cp 2 SDPA points (ranks that share the 2-core machine alike: a cp 1 point has a core to itself, which the
# model does not price). Fitted on four: both lengths, Ulysses and both rings; held out: two styles at the other length.
HELD_OUT = ["tiny-qwen3/s2048/cp2/sdpa/cp_ulysses", "tiny-qwen3/s512/cp2/sdpa/cp_ring_zigzag"]


@pytest.mark.heavy
def test_calibration_on_a_measured_cpu_sweep_judges_the_points_it_was_not_fitted_on(tmp_path):
    run = tmp_path / "sdpa"
    table = store.read_table(BASELINE)
    df = table.to_pandas()
    keep = df["point_id"].str.contains("/cp2/sdpa/")  # 6 points
    store.write_table(run, table.filter(keep.to_numpy()))
    (tmp_path / "cpu.toml").write_text(CPU_CORE)
    start = hardware.load(str(tmp_path / "cpu.toml"))
    samples, note = samples_of_run(run, base=start)
    assert len(samples) == 6 and "which no shipped profile names" in note  # a CPU: the fitted profile is its own
    fitted, rows, errors = calibrate(samples, start, "cpu-fitted", holdout=HELD_OUT, run="smoke (sdpa)")
    held = errors["held_out"]
    assert held["points"] == 2 and errors["fitted"]["points"] == 4
    before = sum(abs(r["before_s"] / r["measured_s"] - 1) for r in rows if r["held_out"]) / 2
    # the fit carries to points it never saw: far better than the rough starting profile (about 50 % off), and
    # within a quarter (12 % when written; a busy 2-core machine moves single points by 10-20 %)
    assert held["mean_abs_error"] < before / 2 and held["mean_abs_error"] < 0.25, rows
    assert "2 held out" in fitted.sources["efficiency"]


def test_a_run_measured_on_another_gpu_is_refused_unless_asked():
    h100, a100 = hardware.load("h100-sxm"), hardware.load("a100-sxm")
    assert check_device({"NVIDIA H100 80GB HBM3"}, h100) is None
    with pytest.raises(ValueError, match=r"'NVIDIA A100-SXM4-80GB' \(profile a100-sxm\).*pass --gpu a100-sxm"):
        check_device({"NVIDIA A100-SXM4-80GB"}, h100)
    assert check_device({"NVIDIA A100-SXM4-80GB"}, h100, any_device=True) is None
    assert "AMD EPYC" in check_device({"AMD EPYC"}, a100)


def test_a_runs_gpus_per_node_decide_which_collectives_cross_nodes(tmp_path, monkeypatch):
    # --gpus-per-node, else the GPUs the run saw on its node (device_count), else its world size: never a fixed 8
    import cpbench.harness.project.projection as projection

    table = store.read_table(BASELINE)
    df = table.to_pandas()
    keep = (df["point_id"] == "tiny-qwen3/s512/cp2/sdpa/cp_ulysses").to_numpy()
    store.write_table(tmp_path / "one", table.filter(keep))
    seen = []

    def project_rank(point, rank, gpus_per_node=8, keep_trace=False):
        seen.append(gpus_per_node)
        return {"trace": []}

    monkeypatch.setattr(projection, "project_rank", project_rank)
    samples_of_run(tmp_path / "one")
    ranks = len(seen)
    samples_of_run(tmp_path / "one", gpus_per_node=1)
    assert set(seen[:ranks]) == {2}  # a CPU run saw no GPUs: one machine of its world size
    assert set(seen[ranks:]) == {1} and len(seen) == 2 * ranks


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
