"""The published rows, their traces priced as a projection prices them, and the fit of `efficiency.memory`,
`efficiency.memory_strided` and `memory_ramp_s` to them (the room's docstring says how; __main__.py runs `report`)."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from pathlib import Path

from cpbench.harness.project.elementwise.modules import MODULES
from cpbench.harness.project.hardware import Hardware, builtin

DATA = Path(__file__).resolve().parents[4] / "results" / "published" / "elementwise" / "liger_h100_eager.csv"
PROFILE = "h100-sxm"  # the benchmark's GPU ("NVIDIA H100 80GB HBM3")
FUSED_DATA = DATA.with_name("liger_a100_fused.csv")  # a fused kernel's rows: priced, never fitted
MLP_DATA = {"a100-sxm": DATA.with_name("liger_a100_mlp.csv"),  # transformers' LlamaMLP: GEMMs and the activation,
            "b200": DATA.with_name("liger_b200_mlp.csv")}        # priced, never fitted
ADD_NORM_DATA = DATA.with_name("liger_b200_add_rms_norm.csv")  # the 8B's residual add + RMSNorm on a B200: priced only
CE_DATA = DATA.with_name("liger_a100_cross_entropy.csv")  # torch's cross-entropy, 16k rows of 4k-131k: priced only
COMPLEX_ROPE_DATA = DATA.with_name("liger_h100_llama4_rope.csv")  # torchtitan's complex RoPE on an H100: priced only


def module(row: dict):
    """The module a row times: its provider's where this file rebuilds that one (Liger's fused kernel), else the
    eager reference of its name."""
    return MODULES.get(f"{row['kernel_name']}/{row['kernel_provider']}") or MODULES[row["kernel_name"]]


def rows(mode: str = "forward", path: Path = DATA) -> list[dict]:
    """The published rows of one mode: "forward" (fitted) or "full", forward and backward (held out)."""
    with open(path) as f:
        found = [r for r in csv.DictReader(f) if r.get("kernel_operation_mode") == mode]
    unknown = sorted({r.get("kernel_name") for r in found} - {name.split("/")[0] for name in MODULES})
    if unknown:
        raise ValueError(f"{path}: kernel_name {unknown}: this fit rebuilds only {sorted(MODULES)}; drop those rows "
                         "or time these modules (results/gpu/elementwise_bench.py).")
    return found


def trace(row: dict) -> list:
    """The ops a projection would price for the row's eager module (fake tensors, so any size is free)."""
    from cpbench.harness.project.projection import fake_tensors
    from cpbench.harness.project.trace import StepTrace

    cfg = json.loads(row["extra_benchmark_config_str"])
    with fake_tensors():
        forward, backward, _ = module(row)(row, cfg)
        with StepTrace() as t:
            out = forward()
            if row["kernel_operation_mode"] == "full":
                backward(out)
    return t.ops


def predicted(ops: list, hw: Hardware) -> float:
    """The kernels back to back on one stream, the host ahead of them (as the benchmark times them): the sum of the
    time model's price of each op (timing.op_seconds), which is what timing.simulate plays out for such a trace. One
    GPU timed them: its GEMMs at one chip's pace (Hardware.at_scale)."""
    from cpbench.harness.project.timing import op_seconds

    one = hw.at_scale(1)
    return sum(op_seconds(o, one, "bfloat16") for o in ops)


def _log_error(traced: list[tuple[dict, list]], hw: Hardware) -> float:
    return sum(math.log(predicted(ops, hw) / (float(r["y_value_50_ms"]) * 1e-3)) ** 2 for r, ops in traced)


def fit(traced: list[tuple[dict, list]], hw: Hardware, keep_ramp: bool = False) -> dict:
    """The figures minimising the squared log error, on a grid no finer than their data (1 % of efficiency, 0.1 us):
    `memory` and `memory_ramp_s` over the rows whose kernels are all contiguous, then `memory_strided` (the same
    ramp) over those with a strided kernel. Each with its RMS log error; a figure at the grid's edge says so.
    `keep_ramp`: the profile's ramp is kept, where every kernel of the rows is too large for them to set one."""
    def strided(ops):
        return any(o.strided for o in ops)

    plain, views = [t for t in traced if not strided(t[1])], [t for t in traced if strided(t[1])]
    efficiencies, ramps = [x / 100 for x in range(5, 101)], [round(x * 1e-7, 12) for x in range(0, 201)]
    if keep_ramp:
        ramps = [hw.memory_ramp_s]
    best = (math.inf, 0.0, 0.0)
    for e in efficiencies:
        for ramp in ramps:
            err = _log_error(plain, dataclasses.replace(hw, memory_ramp_s=ramp).with_efficiency(memory=e))
            best = min(best, (err, e, ramp))
    _, e, ramp = best
    at = dataclasses.replace(hw, memory_ramp_s=ramp).with_efficiency(memory=e)
    strided_grid = efficiencies if views else [hw.efficiency["memory_strided"]]  # no strided rows: the profile's
    err_s, e_s = min((_log_error(views, at.with_efficiency(memory_strided=x)), x) for x in strided_grid)
    edges = [name for name, v, grid in (("memory", e, efficiencies), ("memory_ramp_s", ramp, ramps),
                                        ("memory_strided", e_s, strided_grid))
             if len(grid) > 1 and v in (grid[0], grid[-1])]
    return {"memory": e, "memory_ramp_s": ramp, "memory_strided": e_s, "at_grid_edge": edges,
            "rms_log_error": math.sqrt(best[0] / max(len(plain), 1)),
            "rms_log_error_strided": math.sqrt(err_s / max(len(views), 1)), "rows": (len(plain), len(views))}


def fitted_profile(hw: Hardware, figures: dict) -> Hardware:
    return dataclasses.replace(hw, memory_ramp_s=figures["memory_ramp_s"]).with_efficiency(
        memory=figures["memory"], memory_strided=figures["memory_strided"])


def report(hw: Hardware | None = None, path: Path = DATA, keep_ramp: bool = False) -> str:
    hw = hw or builtin()[PROFILE]
    traced = [(r, trace(r)) for r in rows("forward", path)]
    f = fit(traced, hw, keep_ramp)
    fitted = fitted_profile(hw, f)
    kept = " (kept: the profile's)"
    strided_error = f"{f['rms_log_error_strided']:.3f}" if f["rows"][1] else "n/a"
    lines = [f"fit over {f['rows'][0]} rows of contiguous kernels: efficiency.memory = {f['memory']:.2f}, "
             f"memory_ramp_s = {f['memory_ramp_s'] * 1e6:.1f} us{kept if keep_ramp else ''} (RMS log error "
             f"{f['rms_log_error']:.3f}); over {f['rows'][1]} rows with a strided kernel: efficiency.memory_strided = "
             f"{f['memory_strided']:.2f}{kept if not f['rows'][1] else ''} (RMS log error {strided_error})",
             *([f"at the edge of the fit's grid (not a figure to trust): {', '.join(f['at_grid_edge'])}"]
               if f["at_grid_edge"] else []),
             "line  kernel               size    ops  MB moved  measured  fitted  shipped"]
    held_out = [(r, trace(r)) for r in rows("full", path)]
    for r, ops in traced + held_out:
        if held_out and r is held_out[0][0]:
            err = math.sqrt(_log_error(held_out, fitted) / len(held_out))
            lines.append(f"held out, forward and backward (not fitted): RMS log error {err:.3f}")
        moved = sum(o.bytes for o in ops) / 1e6
        lines.append(f"{r['line']:>4}  {r['kernel_name']:<19} {r['x_value']:>6} {len(ops):>5} {moved:>9.1f} "
                     f"{float(r['y_value_50_ms']) * 1e3:>7.1f}us {predicted(ops, fitted) * 1e6:>6.1f}us "
                     f"{predicted(ops, hw) * 1e6:>6.1f}us")
    return "\n".join(lines)
