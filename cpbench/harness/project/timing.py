"""The time model: an op trace (trace.py) priced for one GPU (hardware.py), and its streams played out.

Each op costs, roofline-style, the larger of its FLOPs over the efficient peak of its class and its bytes over the
efficient HBM bandwidth, and at least one kernel's minimum; a collective costs its bytes over the link its group
crosses (NVLink inside a node, the network across nodes) with the ring algorithms' factors, plus a latency per hop;
an offload copy its bytes over PCIe; an op of the optimizer step on the host its bytes over host memory.

What overlaps what, as the code schedules it (trace.py names the streams):
- the host dispatches ops one after another (`cpu_op_s` each) and runs ahead of the GPU until something syncs it;
- each stream runs its ops in order; an op starts when its stream is free, the host has issued it, and the buffers
  it reads are written (a kernel that reads an all-gathered weight or a received K/V block waits for that transfer);
- NCCL's stream (ring send/receive, Ulysses all-to-all, all-reduce) and FSDP2's reduce-scatter also wait for the
  compute issued before them; FSDP2's all-gather waits only for the previous all-gather's copy-out (one layer ahead);
- the optimizer step waits for every gradient reduction (FSDP2's root waits for its last reduce-scatter).
The step ends when every stream is done. The breakdown: `compute_s` (the compute stream busy with the model),
`optimizer_s`, `comm_exposed_s` (the compute stream idle for a collective, and the tail after it),
`transfer_exposed_s` (offload copies on the compute stream, and waits for them), `overhead_s` (idle for the host).
"""

from __future__ import annotations

from cpbench.harness.project.hardware import Hardware
from cpbench.harness.project.trace import Op

COMM_STREAMS = ("ag", "rs", "nccl")
COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce", "p2p")
BREAKDOWN = ("compute_s", "optimizer_s", "comm_exposed_s", "transfer_exposed_s", "overhead_s")


def collective_seconds(kind: str, nbytes: float, group: int, crosses_nodes: bool, hw: Hardware) -> float:
    """One collective of `group` ranks: `nbytes` is what this rank hands to it (an all-gather's shard, the whole
    input of a reduce-scatter, all-to-all or all-reduce, a received block for point-to-point)."""
    if group <= 1 and kind != "p2p":
        return 0.0
    link, eff, latency = ((hw.inter_node_bytes_per_s, hw.efficiency["inter_node"], hw.inter_node_latency_s)
                          if crosses_nodes else
                          (hw.intra_node_bytes_per_s, hw.efficiency["intra_node"], hw.intra_node_latency_s))
    bw = link * eff
    if kind == "all_gather":  # each rank receives the other n-1 shards
        return nbytes * (group - 1) / bw + latency * (group - 1)
    if kind in ("reduce_scatter", "all_to_all"):  # each rank sends (n-1)/n of its input
        return nbytes * (group - 1) / group / bw + latency * (group - 1)
    if kind == "all_reduce":  # a reduce-scatter and an all-gather
        return 2 * nbytes * (group - 1) / group / bw + 2 * latency * (group - 1)
    if kind == "p2p":
        return nbytes / bw + latency if nbytes else 0.0
    raise ValueError(f"unknown collective kind {kind!r}")


def efficiency_key(kind: str, hw: Hardware) -> str:
    """The efficiency an op's kind is priced at: a model's own SDPA call runs the kernel SDPA picks on the GPU."""
    if kind.startswith("attention_sdpa_"):
        return kind.replace("_sdpa", {"flash": "", "cudnn": "_cudnn", "efficient": "_efficient"}[hw.sdpa_kernel])
    return kind


def op_seconds(op: Op, hw: Hardware, dtype: str) -> float:
    if op.kind == "sync":
        return 0.0
    if op.kind in ("h2d", "d2h"):
        return op.bytes / (hw.pcie_bytes_per_s * hw.efficiency["pcie"])
    if op.kind in COLLECTIVE_KINDS:
        return collective_seconds(op.kind, op.bytes, op.group, op.crosses_nodes, hw)
    if op.stream == "host":
        return op.bytes / (hw.host_bytes_per_s * hw.efficiency["host"])
    memory = op.bytes / (hw.hbm_bytes_per_s * hw.efficiency["memory"])
    if op.flops:
        math = op.flops / (hw.peak(dtype) * hw.efficiency[efficiency_key(op.kind, hw)])
        return max(math, memory, hw.kernel_s)
    return max(memory, hw.kernel_s)


def simulate(ops: list[Op], hw: Hardware, dtype: str) -> dict:
    """Plays the trace out on `hw`: the step's time, its breakdown (BREAKDOWN, which sums to `step_s`), the busy
    time of the collectives (`comm_s`) and the FLOPs the kernels executed (`executed_flops`, recompute included)."""
    clock = {"cpu": 0.0, "compute": 0.0, **dict.fromkeys(COMM_STREAMS, 0.0)}
    ready: dict[int, tuple[float, str]] = {}  # buffer -> (written at, by which kind of work)
    out = dict.fromkeys(BREAKDOWN, 0.0)
    comm_s = flops = 0.0
    ag_gate = 0.0
    in_optimizer = False
    for op in ops:
        if op.kind == "sync":  # the host waits for the GPU
            clock["cpu"] = max(clock["cpu"], clock["compute"])
            continue
        clock["cpu"] += hw.cpu_op_s
        dur = op_seconds(op, hw, dtype)
        flops += op.flops
        dep, why = max(((ready[k][0], ready[k][1]) for k in op.reads if k in ready), default=(0.0, "comm"))
        if op.stream in COMM_STREAMS:
            waits = [clock["cpu"], clock[op.stream], dep] + ([ag_gate] if op.stream == "ag" else [clock["compute"]])
            end = max(waits) + dur
            clock[op.stream] = end
            comm_s += dur if op.kind in COLLECTIVE_KINDS else 0.0
            made_by = "transfer" if op.kind in ("h2d", "d2h") else "comm"
        else:
            if op.phase == "optimizer" and not in_optimizer:  # FSDP2's root waits for the last reduction
                in_optimizer = True
                dep, why = max((dep, why), (max(clock[s] for s in COMM_STREAMS), "comm"))
            start = max(clock["compute"], clock["cpu"], dep)
            gap = start - clock["compute"]
            if gap > 0:
                out["overhead_s" if clock["cpu"] >= dep else f"{why}_exposed_s"] += gap
            end = start + dur
            clock["compute"] = end
            if op.stream == "host":
                clock["cpu"] = end  # the host runs it
            bucket = ("optimizer_s" if op.phase == "optimizer" else
                      "transfer_exposed_s" if op.kind in ("h2d", "d2h") else "compute_s")
            out[bucket] += dur
            made_by = "transfer" if op.kind in ("h2d", "d2h") else "compute"
            if op.kind == "copy_out":
                ag_gate = end
        for key in op.writes:
            ready[key] = (end, made_by)
    end = max(clock[s] for s in ("compute", *COMM_STREAMS))
    out["comm_exposed_s"] += end - clock["compute"]  # the tail: the last reductions after the last kernel
    return {"step_s": end, **out, "comm_s": comm_s, "executed_flops": flops}
