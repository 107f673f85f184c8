"""The op trace (trace.py) of a tiny projected step: its streams, collectives, transfers and host optimizer, the
nodes a group spans; and projected times ranking a measured CPU sweep's points as their measurements do."""

from __future__ import annotations

import pytest

from cpbench.harness.project import hardware
from cpbench.harness.project.timing import BREAKDOWN, simulate
from tests.timing_fixtures import CPU_CORE, HW


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
