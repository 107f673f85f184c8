"""The time model: an op trace (trace.py) priced for one GPU (hardware.py), and its streams played out.

Each op costs, roofline-style, the larger of its FLOPs over the efficient peak of its class and its bytes over the
efficient HBM bandwidth, and at least one kernel's minimum; a collective costs its bytes over the link its group
crosses (NVLink inside a node, the network across nodes) with the ring algorithms' factors, plus a latency per hop;
an offload copy its bytes over PCIe; an op of the optimizer step on the host its bytes over host memory.

What overlaps what, as the code schedules it (trace.py names the streams):
- the host dispatches ops one after another (`cpu_op_s` each; for each layer that activation checkpointing
  recomputes, `cpu_recompute_layer_s` at its forward and `cpu_recompute_replay_s` at its replay; under op recompute,
  `cpu_selective_op_s` more for each op its modes see) and runs ahead of the GPU until something syncs it;
- each stream runs its ops in order; an op starts when its stream is free, the host has issued it, and the buffers
  it reads are written (a kernel that reads an all-gathered weight or a received K/V block waits for that transfer);
- NCCL's stream (ring send/receive, Ulysses all-to-all, all-reduce) and FSDP2's reduce-scatter also wait for the
  compute issued before them; FSDP2's all-gather waits only for the previous all-gather's copy-out (one layer ahead);
- the optimizer step waits for every gradient reduction (FSDP2's root waits for its last reduce-scatter).
The step ends when every stream is done. The breakdown: `compute_s` (the compute stream busy with the model),
`optimizer_s`, `comm_exposed_s` (the compute stream idle for a collective, and the tail after it),
`transfer_exposed_s` (offload copies on the compute stream, and waits for them), `overhead_s` (idle for the host).
Apart from it, where the step's parts begin on the compute stream, as a timer around each part would read them:
`forward_s` (the step's start to its first backward op: the forward and the loss) and `backward_s` (from there to the
optimizer step's first op: the backward, recomputed layers and the wait for the last gradient reduction included).
The loss's gradient seed (`ones_like`, before autograd's engine starts) counts to the forward: one small kernel.
And `attention_s`: the step's time times the attention kernels' share of the GPU's kernel time, collectives left
out (they overlap): how a profiler splits one measured step into attention and everything else on a single clock
(ml-engineering's insights/when-to-upgrade-gpus/bench_decompose.py), so a published split can be set beside it.
"""

from __future__ import annotations

import bisect

from cpbench.harness.project import efficiency
from cpbench.harness.project.efficiency import efficiency_key, kernel_class
from cpbench.harness.project.hardware import Hardware
from cpbench.harness.project.trace import Op

COMM_STREAMS = ("ag", "rs", "nccl")
COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce", "p2p")
HOST_ONLY = ("sync", "checkpoint", "replay")  # no kernel: a wait for the GPU, the host's work around a recomputed layer
BREAKDOWN = ("compute_s", "optimizer_s", "comm_exposed_s", "transfer_exposed_s", "overhead_s")


def collective_seconds(kind: str, nbytes: float, group: int, crosses_nodes: bool, hw: Hardware,
                       nodes: int | None = None, fewest: int | None = None) -> float:
    """One collective of `group` ranks: `nbytes` is what this rank hands to it (an all-gather's shard, the whole
    input of a reduce-scatter, all-to-all or all-reduce, a received block for point-to-point). NCCL reaches its
    large-message bus bandwidth only on large messages: at `*_half_bytes` (nccl-tests' size: an all-gather's whole
    output, the others' input) it moves at half of it.

    Across nodes (`nodes` of them, `fewest` of the group's ranks on the emptiest), every GPU of an HGX node has a
    network link of its own, and NCCL's ring algorithm runs as many rings (channels) as a node has ranks, each
    leaving the node through another GPU's link: a link carries the ring's bytes over the ranks its node has, not
    the whole ring's (ml-engineering network/README.md: NCCL ran Ring across its 4 H200 nodes; its B200 figure is
    read so, busbw over the node's links), and the same ring's bytes over NVLink bound it where the network is
    fast. An all-to-all sends what goes to other nodes through the rank's own link. `nodes` unknown: one rank a
    node (every ring step crosses a link)."""
    if group <= 1 and kind != "p2p":
        return 0.0
    nvlink = hw.intra_node_bytes_per_s * hw.efficiency["intra_node"]
    if not crosses_nodes:
        return _ring_seconds(kind, nbytes, group, nvlink, hw.intra_node_latency_s, hw.intra_node_half_bytes)
    link = hw.inter_node_bytes_per_s * hw.efficiency["inter_node"]
    if kind == "p2p" or not nodes or nodes >= group:
        return _ring_seconds(kind, nbytes, group, link, hw.inter_node_latency_s, hw.inter_node_half_bytes)
    rings = max(1, min(fewest or group // nodes, group // nodes))
    ring = _ring_seconds(kind, nbytes, group, link, hw.inter_node_latency_s, hw.inter_node_half_bytes)
    latency = hw.inter_node_latency_s * (group - 1) * (2 if kind == "all_reduce" else 1)
    # the share of the whole ring's bytes a link carries: an all-to-all's to the other nodes' ranks, through its own
    share = (group - rings) / (group - 1) if kind == "all_to_all" else 1 / rings
    network = (ring - latency) * share + latency
    return max(network, _ring_seconds(kind, nbytes, group, nvlink, 0.0, hw.intra_node_half_bytes))


def _ring_seconds(kind: str, nbytes: float, group: int, link: float, latency: float, half: float) -> float:
    """A ring collective over one kind of link: each rank's bytes through its own link, one latency a hop."""
    size = nbytes * group if kind == "all_gather" else nbytes
    bw = link * size / (size + half) if size else link
    if kind == "all_gather":  # each rank receives the other n-1 shards
        return nbytes * (group - 1) / bw + latency * (group - 1)
    if kind in ("reduce_scatter", "all_to_all"):  # each rank sends (n-1)/n of its input
        return nbytes * (group - 1) / group / bw + latency * (group - 1)
    if kind == "all_reduce":  # a reduce-scatter and an all-gather
        return 2 * nbytes * (group - 1) / group / bw + 2 * latency * (group - 1)
    if kind == "p2p":
        return nbytes / bw + latency if nbytes else 0.0
    raise ValueError(f"unknown collective kind {kind!r}")


def op_seconds(op: Op, hw: Hardware, dtype: str) -> float:
    if op.kind in HOST_ONLY:
        return 0.0
    if op.kind in ("h2d", "d2h"):
        return op.bytes / (hw.pcie_bytes_per_s * hw.efficiency["pcie"])
    if op.kind in COLLECTIVE_KINDS:
        return collective_seconds(op.kind, op.bytes, op.group, op.crosses_nodes, hw, op.nodes or None,
                                  op.fewest or None)
    if op.stream == "host":
        return op.bytes / (hw.host_bytes_per_s * hw.efficiency["host"])
    if op.kind in ("memory", "copy_out"):  # an element-wise kernel: its ramp too, and a strided one unvectorized
        return max(op.bytes / (hw.hbm_bytes_per_s * hw.memory_efficiency(op.strided)) + hw.memory_ramp_s, hw.kernel_s)
    if op.kind == "gemm":
        return max(efficiency.gemm_seconds(op.flops, op.bytes, op.shape, hw, dtype), hw.kernel_s)
    memory = op.bytes / (hw.hbm_bytes_per_s * hw.efficiency["memory"])
    if op.flops:
        key = efficiency_key(op.kind, hw)
        if key not in hw.efficiency:
            raise ValueError(f"GPU profile {hw.name!r} has no efficiency.{key}: {kernel_class(key)[0]} does not run "
                             f"on it (or give the figure in the profile); price its calls as another kernel.")
        eff = hw.efficiency[key]
        if key.startswith("attention"):
            eff *= efficiency.attention_factor(*kernel_class(key), op.shape, hw)
        return max(op.flops / (hw.peak(dtype) * eff), memory, hw.kernel_s)
    return max(memory, hw.kernel_s)


def host_seconds(op: Op, hw: Hardware) -> float:
    """The host's time to issue `op`: torch's dispatch of an op of the forward and backward, with FSDP2's hooks for
    an all-gather or reduce-scatter, or the optimizer step's ops by the tensors they take (dispatch.py measures
    each), and the driver's launch of its kernel (`cuda_launch_s`); a recomputed layer's checkpoint and replay,
    what torch.utils.checkpoint costs the host around its forward and its replay in backward (`cpu_recompute_layer_s`,
    `cpu_recompute_replay_s`; no kernel); an op that op recompute's selective-checkpoint modes see, their Python
    (`cpu_selective_op_s`)."""
    if op.kind == "checkpoint":
        return hw.cpu_recompute_layer_s
    if op.kind == "replay":
        return hw.cpu_recompute_replay_s
    if op.phase == "optimizer":
        return hw.cpu_optimizer_tensor_s * op.tensors + hw.cuda_launch_s
    if op.stream in ("ag", "rs") and op.kind in COLLECTIVE_KINDS:
        return hw.cpu_op_s + hw.cpu_fsdp_collective_s + hw.cuda_launch_s
    return hw.cpu_op_s + hw.cuda_launch_s + (hw.cpu_selective_op_s if op.selective else 0.0)


def simulate(ops: list[Op], hw: Hardware, dtype: str) -> dict:
    """Plays the trace out on `hw`: the step's time, its breakdown (BREAKDOWN, which sums to `step_s`), the busy
    time of the collectives (`comm_s`) and the FLOPs the kernels executed (`executed_flops`, recompute included).

    Twice: a collective the code issues after a kernel may run beside it on the GPU (FSDP2 issues a layer's
    all-gather in that layer's pre-forward, after the layer before has dispatched its kernels, which the GPU is still
    running), so the second play slows each kernel by every collective the first play ran beside it."""
    first = _play(ops, hw, dtype, None)
    return _play(ops, hw, dtype, _union(sorted(first["spans"])))


def _play(ops: list[Op], hw: Hardware, dtype: str, known: list | None) -> dict:
    """One play of the trace. The first (`known` None) slows a kernel by the collectives issued before it and
    returns the collectives' (start, end) spans; the second slows it by `known`, those spans merged (_Beside)."""
    clock = {"cpu": 0.0, "compute": 0.0, **dict.fromkeys(COMM_STREAMS, 0.0)}
    ready: dict[int, tuple[float, str]] = {}  # buffer -> (written at, by which kind of work)
    out = dict.fromkeys(BREAKDOWN, 0.0)
    comm_s = flops = 0.0
    ag_gate = 0.0
    in_optimizer = False
    beside = _Beside(hw.nccl_sm_fraction, known)
    rs_done = 0.0  # the end of the last reduce-scatter: FSDP2 keeps one reduce-scatter input alive
    began: dict[str, float] = {}  # "backward", "optimizer": when the compute stream's first op of that part starts
    kernels = {"all": 0.0, "attention": 0.0}  # the GPU's kernel time, collectives left out (attention_s)
    for op in ops:
        if op.kind == "sync":  # the host waits for the GPU
            clock["cpu"] = max(clock["cpu"], clock["compute"])
            continue
        if op.kind in ("checkpoint", "replay"):  # host work only: the GPU is not told of it
            clock["cpu"] += host_seconds(op, hw)
            continue
        clock["cpu"] += host_seconds(op, hw)
        dur = op_seconds(op, hw, dtype)
        flops += op.flops
        dep, why = max(((ready[k][0], ready[k][1]) for k in op.reads if k in ready), default=(0.0, "comm"))
        if op.stream in COMM_STREAMS:
            waits = [clock["cpu"], clock[op.stream], dep] + ([ag_gate] if op.stream == "ag" else [clock["compute"]])
            end = max(waits) + dur
            clock[op.stream] = end
            if op.kind in COLLECTIVE_KINDS:
                comm_s += dur
                beside.ran(end - dur, end)
                if op.stream == "rs" and op.kind == "reduce_scatter":
                    rs_done = end
            made_by = "transfer" if op.kind in ("h2d", "d2h") else "comm"
            kernels["all"] += 0.0 if op.kind in COLLECTIVE_KINDS else dur
        else:
            if op.phase == "optimizer" and not in_optimizer:  # FSDP2's root waits for the last reduction
                in_optimizer = True
                dep, why = max((dep, why), (max(clock[s] for s in COMM_STREAMS), "comm"))
            if op.name == "fsdp.chunk_cat":  # a layer's gradients are copied in once the reduce-scatter before is
                # done: FSDP2's post_backward waits for the oldest reduce-scatter input (reduce_scatter_max_input_
                # buffers = 1, _fsdp_param_group.py) before its foreach_reduce
                dep, why = max((dep, why), (rs_done, "comm"))
            start = max(clock["compute"], clock["cpu"], dep)
            if op.stream != "host" and op.kind not in ("h2d", "d2h"):
                dur = beside.kernel(start, dur)
            part = "optimizer" if op.phase == "optimizer" else "backward" if op.backward else None
            if part is not None:
                began.setdefault(part, start)
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
            if op.stream != "host":
                kernels["all"] += dur
                kernels["attention"] += dur if op.kind.startswith("attention") else 0.0
            made_by = "transfer" if op.kind in ("h2d", "d2h") else "compute"
            if op.kind == "copy_out":
                ag_gate = end
        for key in op.writes:
            ready[key] = (end, made_by)
    end = max(clock[s] for s in ("compute", *COMM_STREAMS))
    out["comm_exposed_s"] += end - clock["compute"]  # the tail: the last reductions after the last kernel
    optimizer_at = began.get("optimizer", end)
    backward_at = min(began.get("backward", optimizer_at), optimizer_at)
    attention_s = end * kernels["attention"] / kernels["all"] if kernels["all"] else 0.0
    if known is None:
        return {"spans": beside.played}
    return {"step_s": end, **out, "forward_s": backward_at, "backward_s": optimizer_at - backward_at,
            "attention_s": attention_s, "comm_s": comm_s, "executed_flops": flops,
            "attention_kernels": attention_kernels(ops, hw), "floor_s": floor_seconds(ops, hw, dtype)}


def floor_seconds(ops: list[Op], hw: Hardware, dtype: str) -> float:
    """A time no configuration of the same model, tokens per GPU, kernels and levers can beat: its GEMMs at the main
    loop's full-wave efficiency and its attention at the best its kernel's curves reach, nothing else (element-wise
    work, collectives, the host and every kernel's floor left out). What a cp size changes (the ring's merges and
    steps, short tiles, heads per call) only adds to it, so `cpbench plan` prunes by it."""
    total = 0.0
    for op in ops:
        if op.phase != "step" or not op.flops:
            continue
        if op.kind == "gemm":
            total += op.flops / (hw.peak(dtype) * efficiency.gemm_core(hw, dtype))
        elif op.kind.startswith("attention"):
            key = efficiency_key(op.kind, hw)
            if key in hw.efficiency:
                total += op.flops / (hw.peak(dtype) * hw.efficiency[key] * efficiency.best_factor(*kernel_class(key),
                                                                                                   hw))
    return total


class _Beside:
    """The collectives a kernel may run beside (NCCL's kernels hold `share` of the SMs while they run). The first play
    (`known` None) sees those issued so far, dropping each once a kernel starts after its end (kernels start in
    order); the second sees `known`, every span of the first play merged, found by bisection (sorting every
    collective of the step at each kernel was quadratic). `played`: the spans the first play ran, whole (the
    second, which has them, records none)."""

    def __init__(self, share: float, known: list | None):
        self.share, self.known = share, known
        self.ends = [b for _, b in known or ()]
        self.live: list[tuple[float, float]] = []
        self.played: list[tuple[float, float]] = []

    def ran(self, start: float, end: float) -> None:
        if self.known is None:
            self.live.append((start, end))
            self.played.append((start, end))

    def kernel(self, start: float, dur: float) -> float:
        """The duration of a kernel that starts at `start` and takes `dur` on a GPU of its own."""
        if self.known is not None:
            first = bisect.bisect_right(self.ends, start)
            return _beside_collectives(start, dur, self.known, self.share, first) if self.known else dur
        self.live = [s for s in self.live if s[1] > start]
        return _beside_collectives(start, dur, _union(sorted(self.live)), self.share) if self.live else dur


def _beside_collectives(start: float, dur: float, spans: list, share: float, first: int = 0) -> float:
    """A kernel's duration when NCCL holds `share` of the SMs while a collective runs beside it: it progresses at
    1 - share of its speed while one runs, at full speed otherwise, until its work is done. `spans`: the collectives'
    (start, end), sorted and merged (concurrent ones count once), from `first` on the first that ends after
    `start`."""
    if not share:
        return dur
    t, left = start, dur  # the work left, in seconds at full speed
    for a, b in spans[first:]:
        a = max(a, t)
        if a - t >= left:  # done before this collective starts
            break
        left -= a - t
        if (b - a) * (1 - share) >= left:  # done while it runs
            return a + left / (1 - share) - start
        left -= (b - a) * (1 - share)
        t = b
    return t + left - start


def _union(spans: list) -> list:
    """Sorted (start, end) spans merged where they overlap."""
    out: list = []
    for a, b in spans:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def attention_kernels(ops: list[Op], hw: Hardware) -> str:
    """The attention kernels the step's calls run on `hw`, with their forward call counts: e.g. 'cudnn:576'."""
    counts: dict[str, int] = {}
    for op in ops:
        if op.kind.startswith("attention") and op.kind.endswith("_forward"):
            name = kernel_class(efficiency_key(op.kind, hw))[0]
            counts[name] = counts.get(name, 0) + 1
    return ",".join(f"{k}:{v}" for k, v in sorted(counts.items()))
