"""A step's GPU kernel time by class, measured beside what the time model prices for each class: where the model is
off, class by class, on the GPU it runs on. The whole-step comparison (results/published) says *that* a short
step is mispriced; this says *which* kernels: GEMMs (the model's shape tables), attention (its curves), the
element-wise kernels (HBM at the profile's `memory` efficiency), the optimizer's, and NCCL's.

Measured: cpbench's own step for a point (measure/step.py: the model, the batch, the levers, the optimizer), its
kernels timed by torch.profiler as ml-engineering's insights/when-to-upgrade-gpus/bench_decompose.py times them
(`key_averages()`, each kernel's `self_device_time_total`), forward and backward in one window and the optimizer
step in another. Projected: the same point's op trace (projection.py), each op priced alone (timing.op_seconds:
its kernel time, without the host or what overlaps it). Both sides are sums of kernel time per step, the same
quantity; the step's wall time is given beside them.

Usage, on a GPU: python -m cpbench.harness.project.decompose SUITE [--gpu NAME] [--out CSV]. The suite's points at
world size 1 are run (several ranks need NCCL and one GPU each; not this tool's job). Without a GPU,
`--projected --gpu NAME` prints the projected side alone.

Read a gap with care: the projection traces the step on the CPU, so copies or fills that a CUDA kernel's own path adds
around it (a layout copy before cuDNN's attention, say) are measured element-wise time with no projected
counterpart: an element-wise gap is not necessarily the `memory` efficiency's.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

from cpbench.harness.project.timing import COLLECTIVE_KINDS, HOST_ONLY, op_seconds

CLASSES = ("gemm", "attention", "elementwise", "optimizer", "comm", "transfer")
# A kernel's class by its name, the first rule that matches (case-insensitive); names as torch.profiler gives them:
# - comm: NCCL's device kernels (ncclDevKernel_AllReduce_Sum_bf16_RING_LL, ncclKernel_*): bench_decompose.py's rule;
# - attention: flash kernels (aten's pytorch_flash::flash_fwd_kernel, FlashAttention-3's flash::FlashAttnFwdSm90,
#   FlashAttention-4's flash::FlashAttentionForwardSm100: bench_decompose.py's "flash"), cuDNN's
#   (cudnn_generated_fort_native_sdpa_sm90_flash_fprop_*) and the memory-efficient kernel's (fmha_cutlassF_*);
# - gemm: cuBLAS's (sm90_xmma_gemm_bf16bf16_*, nvjet_tst_*, nvjet_sm90_*, ampere_bf16_s16816gemm_*,
#   cutlass_80_tensorop_*gemm*, its gemv kernels for skinny shapes, and its split-K reduction splitKreduce_kernel);
# - transfer: the copy engines' host <-> device copies (Memcpy HtoD / DtoH: the offload levers');
# - elementwise: every other kernel, device copies and fills included (what the model prices at HBM speed).
RULES = (
    ("comm", ("nccl",)),
    ("transfer", ("memcpy htod", "memcpy dtoh")),
    ("attention", ("flash", "fmha", "_sdpa_", "attention")),
    ("gemm", ("gemm", "gemv", "nvjet", "xmma", "splitkreduce")),
)


def classify(kernel: str, phase: str = "step") -> str:
    """The class of a kernel by its name; every non-NCCL kernel of the optimizer's window is the optimizer's."""
    name = kernel.lower()
    cls = next((c for c, keys in RULES if any(k in name for k in keys)), "elementwise")
    return "optimizer" if phase == "optimizer" and cls not in ("comm", "transfer") else cls


def bucket(kernels, phase: str = "step") -> dict[str, float]:
    """Seconds per class from (kernel name, device microseconds) pairs."""
    out = dict.fromkeys(CLASSES, 0.0)
    for name, us in kernels:
        out[classify(name, phase)] += us * 1e-6
    return out


def projected_class(op) -> str | None:
    """The class a projected op's kernel falls in (None: no kernel, e.g. the host's own work)."""
    if op.kind in HOST_ONLY or op.stream == "host":
        return None
    if op.kind in COLLECTIVE_KINDS:
        return "comm"
    if op.kind in ("h2d", "d2h"):
        return "transfer"
    if op.phase == "optimizer":
        return "optimizer"
    if op.kind == "gemm":
        return "gemm"
    if op.kind.startswith("attention"):
        return "attention"
    if op.kind in ("memory", "copy_out"):
        return "elementwise"
    return None


def project(point, hw) -> dict:
    """The projected kernel seconds per class of one step of `point` on `hw`, the projected step and its trace."""
    from cpbench.harness.project.projection import project_rank

    rec = project_rank(point, 0, hardware=hw, keep_trace=True)
    if rec.get("status") != "ok":
        raise RuntimeError(f"{point.point_id}: the projection says {rec.get('status')}: {rec.get('error')}")
    out, paced = dict.fromkeys(CLASSES, 0.0), hw.at_scale(point.world_size)  # as the projection priced them
    for op in rec["trace"]:
        cls = projected_class(op)
        if cls is not None:
            out[cls] += op_seconds(op, paced, point.dtype)
    return {"classes": out, "step_s": rec["time"]["step_s"], "trace": rec["trace"]}


def measure(point, steps: int | None = None, warmup: int | None = None) -> dict:
    """The measured kernel seconds per class of one step of `point` on this GPU (the mean of `steps` profiled
    steps, by default the point's measured_steps, after its warmup_steps), and its wall time (the mean of `steps`
    steps without the profiler). A point on the CPU runs the same
    way with the CPU's ops in place of kernels (aten's names: a check of the plumbing, not of the classes)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from cpbench.harness.measure import step

    if point.world_size != 1:
        raise ValueError(f"{point.point_id}: world_size = {point.world_size}: decompose runs one rank; give a "
                         "point at world_size = 1")
    steps = point.measured_steps if steps is None else steps
    warmup = point.warmup_steps if warmup is None else warmup
    cuda = point.device == "cuda"
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU

    def sync():
        if cuda:
            torch.cuda.synchronize()

    model = step.distribute(step.build_model(point, point.device), point)
    batch = step.make_batch(point, model.config.vocab_size, point.device)
    optimizer = step.make_optimizer(model, point)
    for _ in range(warmup):
        step.train_step(model, optimizer, batch, point.keep_outputs)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step.train_step(model, optimizer, batch, point.keep_outputs)
    sync()
    wall = (time.perf_counter() - t0) / steps
    totals = dict.fromkeys(CLASSES, 0.0)
    for _ in range(steps):
        with profile(activities=[activity]) as fwd_bwd:
            step.forward(model, batch).loss.backward()
            sync()
        with profile(activities=[activity]) as opt:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync()
        for prof, phase in ((fwd_bwd, "step"), (opt, "optimizer")):
            pairs = ((e.key, e.self_device_time_total if cuda else e.self_cpu_time_total) for e in prof.key_averages())
            for cls, s in bucket(pairs, phase).items():
                totals[cls] += s / steps
    if not sum(totals.values()):  # CUPTI recorded nothing: no data, not a step of no kernels
        raise RuntimeError(f"{point.point_id}: the profiler recorded no {'kernel' if cuda else 'op'} time in "
                           f"{steps} profiled steps (is CUPTI available to this process?)")
    return {"classes": totals, "step_s": wall, "device": torch.cuda.get_device_name(0) if cuda else "cpu"}


def rows(point, measured: dict | None, projected: dict) -> list[dict]:
    """One row per class (and one for the step): measured and projected seconds, and their ratio."""
    out = []
    for cls in (*CLASSES, "step"):
        p = projected["step_s"] if cls == "step" else projected["classes"][cls]
        m = None if measured is None else (measured["step_s"] if cls == "step" else measured["classes"][cls])
        if not p and not m:
            continue
        out.append({"point_id": point.point_id, "class": cls, "measured_s": m, "projected_s": p,
                    "projected_over_measured": (p / m) if m else None})
    return out


def _format(rows_: list[dict]) -> str:
    lines = [f"{'class':<12} {'measured ms':>12} {'projected ms':>13} {'proj / meas':>12}"]
    for r in rows_:
        m = "-" if r["measured_s"] is None else f"{r['measured_s'] * 1e3:.2f}"
        ratio = "-" if r["projected_over_measured"] is None else f"{r['projected_over_measured']:.3f}"
        lines.append(f"{r['class']:<12} {m:>12} {r['projected_s'] * 1e3:>13.2f} {ratio:>12}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from cpbench.harness.project.hardware import for_device, load
    from cpbench.harness.suite.suites import resolve_suite

    parser = argparse.ArgumentParser(prog="python -m cpbench.harness.project.decompose", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", help="a suite file; its points at world size 1 are decomposed")
    parser.add_argument("--gpu", default=None, help="the profile to price with (default: this GPU's shipped one)")
    parser.add_argument("--projected", action="store_true", help="the projected side only (no GPU needed)")
    parser.add_argument("--steps", type=int, default=None,
                        help="profiled (and timed) steps per point (default: the suite's measured_steps)")
    parser.add_argument("--out", type=Path, default=None, help="also write the rows to this CSV file")
    args = parser.parse_args(argv)
    points = [p for p in resolve_suite(args.suite).points() if p.world_size == 1]
    if not points:
        parser.error(f"{args.suite}: no point at world_size = 1: give the suite cp_sizes = [1] and world_size = 1")
    measuring = not args.projected
    if measuring:
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA device: run this on a GPU, or pass --projected for the projected side alone")
        device = torch.cuda.get_device_name(0)
    if args.gpu is None and (not measuring or for_device(device) is None):
        parser.error("--gpu NAME: " + ("this GPU has no shipped profile" if measuring else "the profile to price with"))
    try:
        hw = load(args.gpu) if args.gpu else for_device(device)
    except (ValueError, OSError) as e:  # an unknown name, an unreadable profile file
        parser.error(str(e))
    table = []
    for point in points:
        measured = measure(point, steps=args.steps) if measuring else None
        got = rows(point, measured, project(point, hw))
        print(f"== {point.point_id} on {measured['device'] if measured else 'no GPU'}, priced as {hw.name}")
        print(_format(got), flush=True)
        table += got
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(table[0]))
            writer.writeheader()
            writer.writerows(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
