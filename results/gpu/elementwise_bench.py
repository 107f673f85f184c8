"""Times the eager modules of cpbench.harness.project.elementwise on this machine's GPU, at the sizes of the published
H100 rows and of the B200's RoPE and residual add + RMSNorm rows (the Llama-3-8B's own: RoPE's strided kernels set
`memory_strided`), and writes rows of the same form, so that another GPU's element-wise figures are fitted as the
H100's, A100's and B200's were:

    python results/gpu/elementwise_bench.py results/gpu/elementwise-h200.csv
    python -m cpbench.harness.project.elementwise --data results/gpu/elementwise-h200.csv --gpu h200

As triton's do_bench times them (Liger-Kernel's benchmark scripts): the L2 cache cleared before each run (a 256 MB
buffer zeroed, its kernel queued ahead so the host leads the GPU), CUDA events around the run, the median of the runs;
the leaves' gradients cleared between runs. `--device cpu` runs the same loop on the CPU (the times then say nothing
of a GPU: a check of the script).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import time

import torch

from cpbench.harness.project.elementwise import fit as elementwise

FIELDS = ("line", "kernel_name", "kernel_provider", "kernel_operation_mode", "x_name", "x_value", "y_value_50_ms",
          "extra_benchmark_config_str", "gpu_name", "timestamp", "liger_version")


def time_row(row: dict, device: str, reps: int) -> float:
    """The median milliseconds of the row's module, as do_bench times it."""
    cfg = json.loads(row["extra_benchmark_config_str"])
    with torch.device(device):
        forward, backward, leaves = elementwise.MODULES[row["kernel_name"]](row, cfg)
        cache = torch.empty(256 << 20, dtype=torch.int8)

    def run():
        out = forward()
        if row["kernel_operation_mode"] == "full":
            backward(out)

    run()  # warm up: the first call's allocations and kernel loading
    times = []
    for _ in range(reps):
        for leaf in leaves:
            leaf.grad = None
        cache.zero_()
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the CSV to write")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--limit", type=int, default=None, help="time only the first N rows of each mode")
    args = parser.parse_args()
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    rope = elementwise.DATA.with_name("liger_b200_eager.csv")
    rows = [r for mode in ("forward", "full") for r in elementwise.rows(mode)[:args.limit]
            + [r for r in elementwise.rows(mode, rope) if r["kernel_name"] == "rope"][:args.limit]
            + elementwise.rows(mode, elementwise.ADD_NORM_DATA)[:args.limit]]
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS, lineterminator="\n")
        writer.writeheader()
        for r in rows:
            ms = time_row(r, args.device, args.reps)
            writer.writerow({**{k: r[k] for k in FIELDS}, "y_value_50_ms": ms, "gpu_name": name,
                             "kernel_provider": "cpbench", "liger_version": "",
                             "timestamp": time.strftime("%Y-%m-%d %H:%M:%S")})
            f.flush()  # a run cut short keeps the rows it timed
            print(f"{r['kernel_name']} {r['kernel_operation_mode']} {r['x_value']}: {ms * 1e3:.1f} us", flush=True)


if __name__ == "__main__":
    main()
