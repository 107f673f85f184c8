"""table.md: each published measurement beside cpbench's projection of the same configuration, and the error; the
mean absolute error over the judged rows, all of them and the short regime (<= 64k tokens per GPU) apart. Where a
source publishes its peak memory per GPU too (`peak_gb`, in GB as published), a second table sets the projected peak
beside it; where it times parts of the step (`parts`), a third sets the projected parts beside them; a fourth says,
for each side-by-side comparison of orderings.toml, whether the projections come out in the order measured.
Beside table.md it writes the judged rows' step-time errors into the package (cpbench/harness/project/record.json),
from which `cpbench estimate` tells a point's regime's record."""

import json
import tomllib
from pathlib import Path

import pandas as pd

from cpbench.harness.project import record as record_
from cpbench.report.runs import store

HERE = Path(__file__).parent
RECORD = HERE.parents[1] / "cpbench" / "harness" / "project" / "record.json"
SHORT = record_.SHORT  # tokens per GPU: the short regime (the same bound `cpbench estimate` tells regimes by)


def _row(name: str):
    runs = list((HERE / "runs").glob(f"*/{name}/runs.parquet"))
    return store.read_run(runs[0]).iloc[0] if runs else None


def projected(row, unit: str):
    """A run's value in the measurement's unit and the note beside it (None and why where it has none)."""
    if row is None:
        return None, "not projected"
    if row["status"] not in ("ok", "oom") or row["projected_step_s"] != row["projected_step_s"]:
        return None, f"{row['status']}: {row['status_detail']}"
    value = row["projected_step_s"] if unit == "s" else row["projected_tokens_per_s"] / row["world_size"]
    note = f"{row['gpu_profile']}, peak {row['peak_bytes'] / 2**30:.1f} GiB, MFU {100 * row['projected_mfu']:.1f} %"
    if row["status"] == "oom":
        note += f" (projected over the card: {row['status_detail']})"
    return value, note


def _cell(value: float, unit: str) -> str:
    if unit == "s" and value < 10:
        return f"{value:.3g} s"
    return f"{value:,.0f} {unit}"


def render() -> str:
    """table.md's text from the committed runs and measurements.toml (main writes it)."""
    lines = ["| measurement | configuration | tokens/GPU | measured | projected | error | notes |",
             "|---|---|---|---|---|---|---|"]
    judged = []  # (|error|, short)
    measurements = tomllib.loads((HERE / "measurements.toml").read_text())
    for name, m in measurements.items():
        value, note = projected(_row(name), m["unit"])
        cell = _cell(value, m["unit"]) if value is not None else "-"
        error = f"{100 * (value / m['measured'] - 1):+.0f} %" if value is not None else "-"
        if value is not None and m.get("judged", True):
            judged.append((abs(value / m["measured"] - 1), m["tokens_per_gpu"] <= SHORT))
        if not m.get("judged", True):
            error += " (not judged)"
        notes = "; ".join(filter(None, [note, m.get("differs")]))
        lines.append(f"| {m['source']} | {m['config']} | {m['tokens_per_gpu']:,} | {_cell(m['measured'], m['unit'])} "
                     f"| {cell} | {error} | {notes} |")
    if judged:
        errors = [e for e, _ in judged]
        short = [e for e, s in judged if s]
        long = [e for e, s in judged if not s]
        lines.append(f"\nMean absolute error {100 * sum(errors) / len(errors):.1f} % over the {len(errors)} judged "
                     f"measurements (largest {100 * max(errors):.0f} %); {100 * sum(short) / len(short):.1f} % over the "
                     f"{len(short)} of them at <= 64k tokens per GPU, {100 * sum(long) / len(long):.1f} % over the "
                     f"{len(long)} above.")
    lines += peaks(measurements) + parts(measurements) + orderings()
    return "\n".join(lines) + "\n"


def record() -> str:
    """record.json's text: each judged row's projected step against its measured one (`step_error`: projected over
    measured, less one; below zero the projection ran short, i.e. fast), with the regime it stands for."""
    rows = []
    for name, m in tomllib.loads((HERE / "measurements.toml").read_text()).items():
        row = _row(name)
        value, _ = projected(row, m["unit"])
        if value is None or not m.get("judged", True):
            continue
        ratio = value / m["measured"] if m["unit"] == "s" else m["measured"] / value  # a rate: the step is its inverse
        rows.append({"name": name, "tokens_per_gpu": m["tokens_per_gpu"], "gpus": int(row["world_size"]),
                     "cp": int(row["cp_size"]), "step_error": round(ratio - 1, 4)})
    body = ",\n".join(f"  {json.dumps(r)}" for r in rows)  # a row a line: a re-projection reads as a small diff
    return f'{{"source": "results/published/table.md (python results/published/table.py)", "rows": [\n{body}\n]}}\n'


def main() -> None:
    text = render()
    (HERE / "table.md").write_text(text)
    RECORD.write_text(record())
    print(text, end="")


def peaks(measurements: dict) -> list[str]:
    """The peak-memory table: the published peak (GB = 1e9 B, as the sources write it) beside the projected one."""
    lines = ["\n| measurement | published peak | projected peak | error | judged |", "|---|---|---|---|---|"]
    judged = []
    for name, m in measurements.items():
        if "peak_gb" not in m:
            continue
        row = _row(name)
        value = row["peak_bytes"] / 1e9 if row is not None and row["peak_bytes"] == row["peak_bytes"] else None
        error = value / m["peak_gb"] - 1 if value is not None else None
        if error is not None and "peak_not_judged" not in m:
            judged.append(abs(error))
        shown = f"{value:.1f} GB | {100 * error:+.0f} %" if value is not None else "- | -"
        verdict = "no: " + m["peak_not_judged"] if "peak_not_judged" in m else "yes"
        lines.append(f"| {name} | {m['peak_gb']:.1f} GB | {shown} | {verdict} |")
    if judged:
        lines.append(f"\nPeak memory: mean absolute error {100 * sum(judged) / len(judged):.1f} % over the "
                     f"{len(judged)} judged peaks (largest {100 * max(judged):.0f} %).")
    return lines if len(lines) > 2 else []


PARTS = {"forward_s": "forward", "forward_backward_s": "forward + backward", "optimizer_s": "optimizer step",
         "attention_s": "attention kernels (share of one clock)", "rest_s": "everything else (share of one clock)"}


def projected_parts(row) -> dict:
    """A projected row's parts as timers around them read them (timing.simulate: `forward_s`, `backward_s`), and
    the step split by its attention kernels' share of the GPU's kernel time (`attention_s`) as a profiler splits
    one; none for a row projected before they were recorded (older schemas: null)."""
    out = {}
    forward, backward = row.get("projected_forward_s"), row.get("projected_backward_s")
    if not (pd.isna(forward) or pd.isna(backward)):
        out.update(forward_s=forward, forward_backward_s=forward + backward,
                   optimizer_s=row["projected_step_s"] - forward - backward)
    attention = row.get("projected_attention_s")
    if not pd.isna(attention):
        out.update(attention_s=attention, rest_s=row["projected_step_s"] - attention)
    return out


def parts(measurements: dict) -> list[str]:
    """The parts of a step a source times apart (`parts`), beside the projection's: where a step's error sits."""
    lines = ["\n| measurement | part | measured | projected | error |", "|---|---|---|---|---|"]
    for name, m in measurements.items():
        unknown = sorted(set(m.get("parts", {})) - set(PARTS))
        if unknown:
            raise ValueError(f"measurements.toml [{name}] parts: {unknown} is not a part this table knows; use "
                             f"{sorted(PARTS)} (seconds)")
        row = _row(name) if "parts" in m else None
        projected_ = projected_parts(row) if row is not None else {}
        for part, measured in m.get("parts", {}).items():
            value = projected_.get(part)
            shown = f"{1e3 * value:.1f} ms | {100 * (value / measured - 1):+.0f} %" if value is not None else "- | -"
            lines.append(f"| {name} | {PARTS[part]} | {1e3 * measured:.1f} ms | {shown} |")
    return lines if len(lines) > 2 else []


METRICS = {"step_s": (1, " s"), "tokens_per_s_per_gpu": (1, " tok/s/GPU"), "tflops": (1e12, " TFLOPS")}  # shown as


def metric(row, name: str) -> float:
    """A projected run's side of a comparison, larger is faster (a step is negated); tests/unit/test_published.py
    holds the judged comparisons by it."""
    if name not in METRICS:
        raise ValueError(f"orderings.toml: metric = {name!r} is not one of {', '.join(METRICS)}")
    if name == "step_s":
        return -row["projected_step_s"]
    if name == "tokens_per_s_per_gpu":
        return row["projected_tokens_per_s"] / row["world_size"]
    return row["flops_per_step"] / row["world_size"] / row["projected_step_s"]


def orderings() -> list[str]:
    """Each comparison whose runs are listed fastest first: the projected figures in that order, and whether they
    come out so (judged ones are held by the test; a not-judged one says why beside it)."""
    lines = ["", "| comparison | measured, fastest first | projected, in the same order | same order | judged |",
             "|---|---|---|---|---|"]
    for name, spec in tomllib.loads((HERE / "orderings.toml").read_text()).items():
        rows = [_row(run) for run in spec.get("fastest_first", ())]
        if not rows or any(r is None for r in rows):
            continue
        values = [metric(r, spec["metric"]) for r in rows]
        scale, suffix = METRICS[spec["metric"]]
        shown = ", ".join(f"{abs(v) / scale:,.4g}{suffix}" for v in values)
        same = "yes" if values == sorted(values, reverse=True) else "no"
        if spec.get("judged", True):  # a judged one may say what differs from the source beside it
            judged = "yes" + (f": {spec['differs']}" if spec.get("differs") else "")
        else:
            judged = f"no: {spec['differs']}"
        lines.append(f"| {name} ({spec['metric']}) | {spec['source']} | {shown} | {same} | {judged} |")
    return lines


if __name__ == "__main__":
    main()
