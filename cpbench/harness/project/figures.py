"""The time model's figures as docs/time.md shows them: the shipped GPU profiles (`profiles_table`) and every
assumed figure (`assumed_table`: a profile figure whose source says "assumed", neither measured nor published) with
what would measure it on a GPU. A test keeps docs/time.md holding both, so a changed figure changes the docs in the
same commit.

    python -m cpbench.harness.project.figures      # prints both tables
"""

from __future__ import annotations

from cpbench.harness.project.hardware import builtin

# figure (or its prefix) -> how a GPU run would measure it. `cpbench calibrate` fits the efficiencies a measured
# sweep's traces use (GEMMs, attention kernels) and the per-op overheads; the rest need a benchmark of their own.
_CALIBRATE = "`cpbench calibrate` on a measured sweep of that GPU (fits it with the other efficiencies the traces use)"
HOW = {
    "gemm": _CALIBRATE,
    "attention": _CALIBRATE + "; or the kernel's own benchmark (flash-attention's benchmarks/, cuDNN's frontend "
                              "samples) at causal, head dim 128, 16k tokens",
    "bf16_tflops": "a best-shape bf16 GEMM sweep on that card (ml-engineering's mamf-finder.py): its peak TFLOP/s",
    "memory": "the eager modules of `python -m cpbench.harness.project.elementwise` (Liger-Kernel's benchmark scripts' "
              "eager references) timed on that GPU by `results/gpu/elementwise_bench.py`, and the same fit",
    "host": "torch's per-tensor AdamW on the host, timed over a model's parameters, against STREAM's triad",
    "host_gb_s": "STREAM (triad) on the GPU node's host with every socket, over the GPUs that share it",
    "inter_node": "nccl-tests all_reduce_perf across two nodes of 8 GPUs at 1-4 GiB: its bus bandwidth over a node's 8 "
                  "links (each link's rate) over a link's peak",
    "intra_node_latency_s": "nccl-tests all_reduce_perf at 8 B inside a node (its time is the latency)",
    "inter_node_latency_s": "nccl-tests all_reduce_perf at 8 B across two nodes",
    "intra_node": "nccl-tests all_reduce_perf over the node's GPUs at 1-4 GiB (bus bandwidth)",
    "chip_spread": "ml-engineering's mamf-finder-all-gpus.py on every node of a job: the standard deviation of all its "
                   "GPUs' MSMF over their median",
}


def how(figure: str) -> str:
    """What would measure `figure` (a profile field or an efficiency key)."""
    if figure in HOW:
        return HOW[figure]
    prefix = next((p for p in sorted(HOW, key=len, reverse=True) if figure.startswith(p)), None)
    if prefix is None:
        raise KeyError(f"assumed.HOW says nothing of {figure!r}: add how a GPU run would measure it.")
    return HOW[prefix]


def source_of(hw, figure: str) -> str | None:
    """Where a profile's figure comes from: its own source, else its block's (gpus.toml gives one source for a
    kernel's forward and backward, and some profiles one for all their attention figures: `attention_forward`)."""
    if figure in hw.sources:
        return hw.sources[figure]
    if figure.startswith("attention"):
        forward = figure.replace("_backward", "_forward")
        return hw.sources.get(forward, hw.sources.get("attention_forward"))
    return None


def figures() -> list[tuple[str, str, str]]:
    """(profiles, figure, its source) of every assumed figure of the shipped profiles: the efficiencies and every
    other figure that has a source; profiles that share a figure and its source are named together."""
    profiles = builtin()
    found: dict[tuple[str, str], list[str]] = {}
    for name, hw in profiles.items():
        for figure in sorted({*hw.sources, *hw.efficiency}):
            source = source_of(hw, figure)
            if source is not None and "assumed" in source.lower():
                found.setdefault((figure, source), []).append(name)
    out = []
    for (figure, source), names in found.items():
        who = "every profile" if len(names) == len(profiles) else ", ".join(names)
        out.append((who, figure, source))
    return sorted(out, key=lambda r: (r[1], r[0]))


def assumed_table() -> str:
    lines = ["| figure | profiles | what it says | what would measure it |", "|---|---|---|---|"]
    for profiles, figure, source in figures():
        lines.append(f"| `{figure}` | {profiles} | {source.replace('|', '/')} | {how(figure)} |")
    return "\n".join(lines) + "\n"


def profiles_table() -> str:
    """Each shipped profile's peak, memory, links and its kernel classes' efficiencies (forward / backward)."""
    lines = ["| profile | bf16 dense | HBM | NVLink / GPU | network / GPU | GEMM | flash (FA2) | cuDNN | FA3 | FA4 | "
             "memory-efficient |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, hw in builtin().items():
        e = hw.efficiency

        def pair(kernel: str) -> str:
            f, b = e.get(f"attention{kernel}_forward"), e.get(f"attention{kernel}_backward")
            return "-" if f is None else f"{f:.3f} / {b:.3f}"

        lines.append(f"| {name} | {hw.peak('bfloat16') / 1e12:,.0f} TFLOP/s | {hw.memory_bytes / 2**30:.0f} GiB, "
                     f"{hw.hbm_bytes_per_s / 1e12:.2f} TB/s | {hw.intra_node_bytes_per_s / 1e9:.0f} GB/s | "
                     f"{hw.inter_node_bytes_per_s / 1e9:.0f} GB/s | {e['gemm']:.3f} | {pair('')} | {pair('_cudnn')} | "
                     f"{pair('_fa3')} | {pair('_fa4')} | {pair('_efficient')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(profiles_table())
    print(assumed_table(), end="")
