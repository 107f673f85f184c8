"""`cpbench calibrate RUN --gpu NAME`: the time model's efficiencies fitted to a measured sweep.

Each measured `ok` point of the run is projected once, keeping its op trace (projection.py); the traces are then
priced again and again (timing.py) while the efficiencies that the traces use, and the per-op overheads, are moved
to make the projected step times meet the measured medians (least squares on log time: a 10 % miss weighs the
same at 10 ms and at 10 s). What a trace does not use is not fitted and keeps the starting profile's value.

Hold-out: `holdout` points are never fitted; the report gives their error separately (`summary`), the only honest
one. The run must have been measured on the profile's GPU (`check_device`): efficiencies fitted to an A100 sweep
are not an H100's. Which ranks share a node (whether a collective crosses nodes) is the run's own: the GPUs it saw
per node, unless given.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from cpbench.harness.project.hardware import Hardware
from cpbench.harness.project.efficiency import efficiency_key
from cpbench.harness.project.timing import simulate

# parameter -> (lowest, highest): efficiencies are fractions of a peak, overheads seconds
BOUNDS = {"efficiency": (0.01, 1.0), "kernel_s": (1e-7, 1e-3), "cpu_op_s": (1e-7, 1e-3)}
OVERHEADS = ("kernel_s", "cpu_op_s")
FACTORS = (0.25, 0.5, 0.7, 0.85, 1.0, 1.18, 1.4, 2.0, 4.0)


@dataclass
class Sample:
    """One measured point: its projected ranks' traces, its dtype, the measured median step time and its GPUs (the
    step runs at the slowest one's pace: Hardware.at_scale)."""

    point_id: str
    traces: list
    dtype: str
    measured_s: float
    gpus: int = 1

    def projected(self, hw: Hardware) -> float:
        paced = hw.at_scale(self.gpus)
        return max(simulate(t, paced, self.dtype)["step_s"] for t in self.traces)


def _used(samples: list[Sample], hw: Hardware) -> list[str]:
    """The parameters the traces exercise: each efficiency a trace's ops price with, and the overheads."""
    kinds = {op.kind for s in samples for t in s.traces for op in t}
    streams = {(op.stream, op.crosses_nodes) for s in samples for t in s.traces for op in t}
    used = [efficiency_key(k, hw) for k in kinds if k.startswith(("gemm", "attention"))]
    if kinds & {"memory", "copy_out", "gemm"} or any(k.startswith("attention") for k in kinds):
        used.append("memory")
    if any(op.strided for s in samples for t in s.traces for op in t):
        used.append("memory_strided")
    if kinds & {"all_gather", "reduce_scatter", "all_to_all", "all_reduce", "p2p"}:
        used += ["intra_node"] if any(not c for _, c in streams) else []
        used += ["inter_node"] if any(c for _, c in streams) else []
    if kinds & {"h2d", "d2h"}:
        used.append("pcie")
    if any(st == "host" for st, _ in streams):
        used.append("host")
    return [f"efficiency.{k}" for k in sorted(set(used))] + list(OVERHEADS)


def _get(hw: Hardware, name: str) -> float:
    if not name.startswith("efficiency."):
        return getattr(hw, name)
    key = name.split(".", 1)[1]
    return hw.memory_efficiency(strided=True) if key == "memory_strided" else hw.efficiency[key]


def _set(hw: Hardware, name: str, value: float) -> Hardware:
    low, high = BOUNDS[name.split(".")[0]]
    value = min(max(value, low), high)
    if name.startswith("efficiency."):
        return hw.with_efficiency(**{name.split(".", 1)[1]: value})
    return replace(hw, **{name: value})


def loss(samples: list[Sample], hw: Hardware) -> float:
    """Mean squared log error of the projected step times."""
    return sum(math.log(s.projected(hw) / s.measured_s) ** 2 for s in samples) / len(samples)


def fit(samples: list[Sample], start: Hardware, rounds: int = 8) -> Hardware:
    """Coordinate descent over the used parameters, each by multiplicative steps that shrink every round."""
    if not samples:
        raise ValueError("nothing to calibrate on: the run has no measured `ok` point with a step time")
    params, hw = _used(samples, start), start
    best = loss(samples, hw)
    for r in range(rounds):
        width = 1.0 / (1 + r)  # the factors' spread (in log) narrows each round
        improved = False
        for name in params:
            value = _get(hw, name)
            for f in FACTORS:
                trial = _set(hw, name, value * math.exp(math.log(f) * width))
                err = loss(samples, trial)
                if err < best - 1e-12:
                    hw, best, improved = trial, err, True
        if not improved and r > 2:
            break
    return hw


def check_device(device_names: set, base: Hardware, any_device: bool = False) -> str | None:
    """Refuses a run measured on another GPU than the profile's (None: it matches, or it was measured on a device no
    shipped profile names, e.g. a CPU: said in the returned note)."""
    from cpbench.harness.project.hardware import for_device

    others = {n: for_device(n) for n in device_names if for_device(n) is not None and n not in base.device_names}
    if others and not any_device:
        named = ", ".join(f"{n!r} (profile {p.name})" for n, p in sorted(others.items()))
        raise ValueError(f"the run was measured on {named}, not on {base.name}'s GPU "
                         f"({', '.join(base.device_names) or 'no device named'}): pass --gpu "
                         f"{next(iter(others.values())).name}, or --any-device to fit this profile to it anyway.")
    unknown = sorted(n for n in device_names if n not in base.device_names and n not in others)
    return (f"measured on {', '.join(map(repr, unknown))}, which no shipped profile names: the fitted profile stands "
            "for that device" if unknown else None)


def samples_of_run(run_dir: Path, gpus_per_node: int | None = None, progress=None, base: Hardware | None = None,
                   any_device: bool = False) -> tuple[list[Sample], str | None]:
    """The run's measured ok points with their projected traces, and a note on the run's device (check_device).
    `gpus_per_node`: default, the GPUs the run saw on its node (its `device_count`), else its world size (a CPU
    run is one machine)."""
    from cpbench.harness.project.projection import project_rank, projected_ranks
    from cpbench.harness.suite.spec import Point
    from cpbench.report.runs import store

    df = store.read_run(run_dir)
    rows = df[(df["measurement"] == "measured") & (df["status"] == "ok") & df["step_time_median_s"].notna()]
    note = check_device(set(rows["device_name"].dropna()), base, any_device) if base is not None else None
    out = []
    for r in rows.to_dict("records"):
        point = Point.from_dict(json.loads(r["spec_json"]))
        if point.level != "model":
            continue
        per_node = gpus_per_node or int(r.get("device_count") or 0) or point.world_size
        traces = [project_rank(point, rank, gpus_per_node=per_node, keep_trace=True)["trace"]
                  for rank in projected_ranks(point)]
        out.append(Sample(r["point_id"], traces, point.dtype, float(r["step_time_median_s"]), point.world_size))
        if progress:
            progress(r["point_id"])
    return out, note


def summary(rows: list[dict]) -> dict:
    """The error of the fitted and of the held-out points apart: their count, mean and largest |error|."""
    out = {}
    for part, held in (("fitted", False), ("held_out", True)):
        errors = [abs(r["after_s"] / r["measured_s"] - 1) for r in rows if r["held_out"] == held]
        out[part] = {"points": len(errors), "mean_abs_error": sum(errors) / len(errors) if errors else None,
                     "max_abs_error": max(errors) if errors else None}
    return out


def calibrate(samples: list[Sample], base: Hardware, name: str, holdout: list[str] = (), run: str = "") -> tuple:
    """Fits on the samples outside `holdout`; returns (the fitted profile, one row per point, the summary)."""
    unknown = set(holdout) - {s.point_id for s in samples}
    if unknown:
        raise ValueError(f"--holdout {sorted(unknown)}: not measured ok points of the run")
    fitted_on = [s for s in samples if s.point_id not in set(holdout)]
    hw = fit(fitted_on, base)
    rms = math.sqrt(loss(fitted_on, hw))
    rows = [{"point_id": s.point_id, "measured_s": s.measured_s, "before_s": s.projected(base),
             "after_s": s.projected(hw), "held_out": s.point_id in set(holdout)} for s in samples]
    errors = summary(rows)
    held = errors["held_out"]
    hw = replace(hw, name=name, title=f"{base.title}, calibrated",
                 sources={**hw.sources, "efficiency": f"fitted by `cpbench calibrate` to {run or 'a measured run'}: "
                          f"{len(fitted_on)} points, rms log error {rms:.3f}"
                          + (f"; {held['points']} held out, mean |error| {100 * held['mean_abs_error']:.1f} %"
                             if held["points"] else "")})
    return hw, rows, errors
