"""Times the GEMMs of a projected step on this machine's GPU, shape by shape, beside the time model's price of each:
whether a gap in the GEMM class (decompose.py) lies in the shapes (the shape tables, the waves) or in the card's level
under a training step's sustained load (its clock and power limit): the profiles' `gemm` figures are sustained rates
of one best shape (ml-engineering's MSMF), the shapes' spread a burst table's (OpenXLA).

    python results/gpu/gemm_bench.py results/gpu/gemm.csv [--suite suites/decompose-llama3-8b.toml] [--seconds 20]

The shapes are the projection's own: the suite's first point traced as `estimate` traces it, every GEMM kept with
its (m, n, k, groups) and its price on this GPU's profile (efficiency.gemm_seconds, via timing.op_seconds). Two
timings, both of mamf-finder.py's operands in the point's dtype: A (m, k) contiguous, B an (n, k) one transposed
(the trace keeps no operand layout; cuBLAS picks its kernel by layout too, so a step's other layouts may differ):
- burst, per shape: ml-engineering's compute/accelerator/benchmarks/mamf-finder.py (benchmark_mm, before its MSMF),
  by which the burst MAMF table was measured: 50 warm-up and 100 timed products into a preallocated output, each timed
  alone between two CUDA events after a 256 MiB buffer is zeroed (the L2 cleared) and the output re-randomized, the
  mean of the timed ones (the GPU idles its tensor cores in those gaps, as it never does in a step);
- sustained: the step's GEMMs in the trace's order, replayed back to back for --seconds (the load of a training
  step's GEMMs, long enough for the clock to settle at the card's power and thermal limits), each replay timed by
  CUDA events; the SM clock and board power sampled meanwhile (NVML, every 0.1 s), with the card's maximum SM clock
  and enforced power limit beside them; and how much the same stretch of the replay (10 ms, 50 ms: about a layer,
  250 ms: MSMF's sub-window, which 'at the power cap ... jitters by up to ~4 %', ml-engineering mamf-finder's README)
  varies from replay to replay: the wandering a synchronous step on many GPUs waits out at every collective.
Writes one CSV row per distinct shape and a JSON summary beside it (<out>.json): the step's GEMM seconds priced, as
the sum of the bursts, and sustained (the median replay), and the clocks. `--device cpu` runs the same loop on the
CPU (its times say nothing of a GPU: a check of the script).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import threading
import time
from pathlib import Path

import torch

from cpbench.harness.project import decompose, hardware
from cpbench.harness.project.timing import op_seconds
from cpbench.harness.suite.spec import load_suite

SUITE = Path(__file__).resolve().parents[2] / "suites" / "decompose-llama3-8b.toml"
FIELDS = ("m", "n", "k", "groups", "count", "gflop", "priced_ms", "burst_ms", "burst_tflops", "priced_tflops")
WARMUP, TIMED = 50, 100  # mamf-finder.py's defaults (--num_warmup_iterations, --num_iterations)
WINDOWS = (0.01, 0.05, 0.25)  # the jitter's windows, seconds: a few GEMMs, about a layer, MSMF's sub-window


def step_gemms(point, hw) -> list[tuple[tuple, float, float]]:
    """The point's GEMMs in the projected step's order: ((m, n, k, groups), FLOPs, priced seconds) each."""
    trace, one = decompose.project(point, hw)["trace"], hw.at_scale(1)  # one GPU times them: one chip's pace
    return [(tuple(op.shape[:4]), op.flops, op_seconds(op, one, point.dtype))
            for op in trace if op.kind == "gemm" and len(op.shape) >= 4]


def distinct(gemms) -> dict[tuple, dict]:
    """shape -> its count, FLOPs and priced seconds summed over the step (first-seen order)."""
    out: dict[tuple, dict] = {}
    for shape, flops, priced in gemms:
        row = out.setdefault(shape, {"count": 0, "flops": 0.0, "priced_s": 0.0})
        row["count"] += 1
        row["flops"] += flops
        row["priced_s"] += priced
    return out


def operands(shape: tuple, dtype, device: str):
    """mamf-finder.py's: A (m, k) contiguous, B (n, k) contiguous seen transposed (a leading groups dim for a batch)."""
    m, n, k, groups = shape
    lead = (groups,) if groups > 1 else ()
    b = torch.randn(*lead, n, k, dtype=dtype, device=device)
    return torch.randn(*lead, m, k, dtype=dtype, device=device), b.transpose(-1, -2)


def burst(shape: tuple, dtype, device: str, warmup: int = WARMUP, timed: int = TIMED) -> float:
    """The mean seconds of one product of `shape`, as mamf-finder.py's benchmark_mm times it."""
    a, b = operands(shape, dtype, device)
    out = torch.empty(*a.shape[:-1], b.shape[-1], dtype=dtype, device=device)
    fresh = torch.randn(out.shape, device=device).to(dtype)
    cache = torch.empty(256 << 18, dtype=torch.int32, device=device)  # 256 MiB
    mm = torch.bmm if a.dim() == 3 else torch.mm
    cuda, times = device == "cuda", []
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(warmup + timed)] if cuda else []
    for i in range(warmup + timed):  # queued back to back, one synchronization at the end (as benchmark_mm)
        cache.zero_()
        out.copy_(fresh)
        t0 = None if cuda else time.perf_counter()
        if cuda:
            events[i][0].record()
        mm(a, b, out=out)
        if cuda:
            events[i][1].record()
        else:
            times.append(time.perf_counter() - t0)
    if cuda:
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) / 1e3 for start, end in events]
    return statistics.fmean(times[warmup:])


class Sampler(threading.Thread):
    """The SM clock (MHz) and board power (W) of GPU 0 every `every` seconds, through NVML (absent: no samples)."""

    def __init__(self, every: float = 0.1):
        super().__init__(daemon=True)
        self.every, self.clocks, self.watts, self.stop, self.limits = every, [], [], threading.Event(), {}
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
            self.limits = {"max_sm_clock_mhz": pynvml.nvmlDeviceGetMaxClockInfo(self.handle, pynvml.NVML_CLOCK_SM),
                           "power_limit_w": pynvml.nvmlDeviceGetEnforcedPowerLimit(self.handle) / 1e3}
        except Exception:  # no NVML (the CPU, a driver without it): the timings stand without the clocks
            self.nvml = None

    def run(self):
        while self.nvml is not None and not self.stop.wait(self.every):
            self.clocks.append(self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM))
            self.watts.append(self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1e3)


def sustained(gemms, dtype, device: str, seconds: float) -> dict:
    """The step's GEMMs replayed in order for `seconds`: the median replay's seconds, the clocks meanwhile, and how
    much the same GEMMs' time varies from replay to replay (`jitter`, by window: windows())."""
    tensors = {shape: operands(shape, dtype, device) for shape, _, _ in gemms}
    calls = [(torch.bmm if tensors[s][0].dim() == 3 else torch.mm, *tensors[s]) for s, _, _ in gemms]
    cuda = device == "cuda"
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(len(calls) + 1)] if cuda else []

    def replay() -> list[float]:
        """Each GEMM's seconds: CUDA events between them (queued, one synchronization at the end)."""
        stamps = [] if cuda else [time.perf_counter()]
        if cuda:
            marks[0].record()
        for i, (mm, a, b) in enumerate(calls):
            mm(a, b)
            if cuda:
                marks[i + 1].record()
            else:
                stamps.append(time.perf_counter())
        if cuda:
            marks[-1].synchronize()
            return [marks[i].elapsed_time(marks[i + 1]) / 1e3 for i in range(len(calls))]
        return [b - a for a, b in zip(stamps, stamps[1:])]

    sampler, replays = Sampler(), []
    sampler.start()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds or not replays:
        replays.append(replay())
    sampler.stop.set()
    sampler.join()
    times = [sum(r) for r in replays]
    mean = (lambda xs: statistics.fmean(xs) if xs else None)
    return {"sustained_s": statistics.median(times), "replays": len(times), "first_replay_s": times[0],
            "sm_clock_mhz": mean(sampler.clocks), "power_w": mean(sampler.watts), **sampler.limits,
            "jitter": {str(w): jitter(replays[1:], windows([p for _, _, p in gemms], w)) for w in WINDOWS}}


def windows(priced: list[float], width: float) -> list[range]:
    """The replay's GEMMs cut, in order, into runs of about `width` priced seconds (a layer's GEMMs take tens of ms)."""
    out, start, acc = [], 0, 0.0
    for i, p in enumerate(priced):
        acc += p
        if acc >= width:
            out.append(range(start, i + 1))
            start, acc = i + 1, 0.0
    return out


def jitter(replays: list[list[float]], cuts: list[range]) -> float | None:
    """How much the same window of GEMMs varies from replay to replay: each window's standard deviation over its mean
    across the replays (the first left out: the clock settling), the median over the windows. What the clock's
    wandering at the power limit does to a stretch of work that long: a synchronous step on n GPUs waits, at each
    collective, for the slowest GPU's stretch. None: fewer than three replays."""
    if len(replays) < 3 or not cuts:
        return None
    spreads = []
    for cut in cuts:
        seconds = [sum(r[i] for i in cut) for r in replays]
        spreads.append(statistics.stdev(seconds) / statistics.fmean(seconds))
    return statistics.median(spreads)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the CSV to write (and <out>.json, the summary)")
    parser.add_argument("--suite", type=Path, default=SUITE, help="its first point's GEMMs (default: the 8B's)")
    parser.add_argument("--gpu", default=None, help="the profile pricing them (default: this GPU's; else h100-sxm)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--seconds", type=float, default=20.0, help="the sustained replay's length (default 20)")
    parser.add_argument("--warmup", type=int, default=WARMUP)
    parser.add_argument("--timed", type=int, default=TIMED)
    args = parser.parse_args(argv)
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    hw = hardware.load(args.gpu) if args.gpu else (hardware.for_device(name) or hardware.load("h100-sxm"))
    point = load_suite(args.suite).points()[0]
    dtype = getattr(torch, point.dtype)
    gemms = step_gemms(point, hw)
    shapes = distinct(gemms)
    rows = []
    with args.out.open("w", newline="") as f:  # row by row: a run cut short keeps the shapes it timed
        writer = csv.DictWriter(f, FIELDS, lineterminator="\n")
        writer.writeheader()
        for shape, agg in shapes.items():
            b = burst(shape, dtype, args.device, args.warmup, args.timed)
            each = agg["flops"] / agg["count"]
            rows.append({"m": shape[0], "n": shape[1], "k": shape[2], "groups": shape[3], "count": agg["count"],
                         "gflop": each / 1e9, "priced_ms": agg["priced_s"] / agg["count"] * 1e3, "burst_ms": b * 1e3,
                         "burst_tflops": each / b / 1e12, "priced_tflops": agg["flops"] / agg["priced_s"] / 1e12})
            writer.writerow(rows[-1])
            f.flush()
            print(f"{shape}: x{agg['count']}, priced {rows[-1]['priced_tflops']:.0f}, "
                  f"burst {rows[-1]['burst_tflops']:.0f} TFLOP/s", flush=True)
    summary = {"device": name, "profile": hw.name, "suite": str(args.suite), "gemms": len(gemms),
               "flops": sum(f for _, f, _ in gemms), "priced_s": sum(p for _, _, p in gemms),
               "burst_s": sum(r["burst_ms"] / 1e3 * r["count"] for r in rows),
               **sustained(gemms, dtype, args.device, args.seconds)}
    Path(f"{args.out}.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"the step's {summary['gemms']} GEMMs on {name}: priced {summary['priced_s'] * 1e3:.1f} ms "
          f"({hw.name}), bursts {summary['burst_s'] * 1e3:.1f} ms, sustained {summary['sustained_s'] * 1e3:.1f} ms "
          f"(median of {summary['replays']} replays); SM clock {summary['sm_clock_mhz']} of "
          f"{summary.get('max_sm_clock_mhz')} MHz, {summary['power_w']} of {summary.get('power_limit_w')} W; "
          f"replay-to-replay spread of a window (s: std/mean) {summary['jitter']}")
    return summary


if __name__ == "__main__":
    main()
