"""The summary table printed at the end of a sweep (plain text; the report area renders the full tables).
Numbers are rendered by `cpbench.report.units`, the one place that turns bytes and seconds into text."""

from __future__ import annotations

import json

from cpbench.report.units import byte_unit, in_unit, ms, seconds, sig


def overrides_lines(df) -> list[str]:
    """Each model's overrides, once (a point's model names them by a short hash: `qwen3-0.6b+3f2a1c`)."""
    seen = {}
    for r in df.to_dict("records"):
        text = r.get("spec_json")
        spec = json.loads(text) if isinstance(text, str) else {}  # a row without a spec (NaN in a frame) has none
        if spec.get("model_overrides"):
            seen[r["model"]] = json.dumps(spec["model_overrides"], sort_keys=True)
    return [f"{model}: model_overrides = {text}" for model, text in sorted(seen.items())]


def summary_table(df) -> str:
    """One line per point: what fits, how fast, and whether it matches the unsharded run; each model's overrides
    listed once above it."""
    notes = "\n".join(overrides_lines(df)) if len(df) and "spec_json" in df else ""
    table = _table(df)
    return f"{notes}\n{table}" if notes else table


def _table(df) -> str:
    if len(df) and "measurement" in df and (df["measurement"] == "projected").all():
        return projected_table(df)
    header = ["point", "status", "peak/rank", "activations", "RSS", "step (p50)", "tok/s/GPU", "parity"]
    records = df.to_dict("records")
    notes = _Notes()
    byte_cols = ("peak_bytes", "activations_bytes", "rss_peak_bytes")
    unit = {c: byte_unit(r.get(c) for r in records) for c in byte_cols}
    lines = []
    for r in records:
        status = r["status"] if r["status"] == "ok" else notes.mark(r["status"], r.get("status_detail"))
        lines.append([
            r["point_id"], status, *(in_unit(r.get(c), unit[c]) for c in byte_cols), ms(r.get("step_time_median_s")),
            sig(_per_gpu(r.get("tokens_per_s"), r.get("world_size"))), r.get("parity_status") or "",
        ])
    return notes.below(_render(header, lines))


def _per_gpu(tokens_per_s, world_size):
    """The global batch's tokens/s over the ranks, as every table and figure has it."""
    return None if tokens_per_s is None or not world_size else tokens_per_s / world_size


def projected_table(df) -> str:
    """A projected run: what fits, the peak's breakdown, and what one step sends (no time, no parity); where an
    offload lever put anything on the host, the host memory of a node and the bytes one rank copies between host and
    device per step. Each byte column in one unit; a point that is not ok is marked, its whole reason (which side
    ran out, by how much) below the table."""
    header = ["point (projected)", "status", "peak/rank", "params", "grads", "optimizer", "activations",
              "temporaries", "sent/step"]
    records = df.to_dict("records")
    for r in records:
        r["sent"] = sum(r.get(c) or 0 for c in r if c.startswith("comm_") and c.endswith("_bytes"))
        r["moved"] = (r.get("d2h_bytes") or 0) + (r.get("h2d_bytes") or 0)
    byte_cols = ["peak_bytes", "params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
                 "temporaries_bytes", "sent"]
    if any((r.get("host_node_peak_bytes") or 0) > 0 for r in records):
        header += ["host/node", "host<->device/step"]
        byte_cols += ["host_node_peak_bytes", "moved"]
    unit = {c: byte_unit(r.get(c) for r in records) for c in byte_cols}
    timed = any(_number(r.get("projected_step_s")) for r in records)
    if timed:
        header += ["step", "compute", "comm exp.", "xfer exp.", "optim.", "fwd | bwd", "tok/s/GPU", "MFU"]
    notes, lines = _Notes(), []
    for r in records:
        status = r["status"] if r["status"] == "ok" else notes.mark(r["status"], r.get("status_detail"))
        if r["status"] not in ("ok", "oom"):
            r["sent"] = r["moved"] = None
        line = [r["point_id"], status, *(in_unit(r.get(c), unit[c]) for c in byte_cols)]
        if timed:
            line += _time_cells(r)
        lines.append(line)
    table = _render(header, lines)
    if timed:
        gpus = sorted({r["gpu_profile"] for r in records if isinstance(r.get("gpu_profile"), str)})
        table += (f"\ntime projected on {', '.join(gpus)} (timing.py): step = compute + exposed communication + "
                  "exposed host<->device copies + optimizer + host overhead; fwd | bwd: what a timer around the "
                  "forward (with the loss) and around the backward (with the wait for its last gradient reduction) "
                  "reads; optim. is the optimizer's busy time, not the rest of the step")
    return notes.below(table)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and value == value  # not None, not NaN


def _time_cells(r: dict) -> list[str]:
    step = r.get("projected_step_s")
    if not _number(step):
        return [""] * 8
    parts = [seconds(r.get(f"projected_{k}_s")) for k in ("compute", "comm_exposed", "transfer_exposed", "optimizer")]
    forward, backward = r.get("projected_forward_s"), r.get("projected_backward_s")
    split = f"{seconds(forward)} | {seconds(backward)}" if _number(forward) and _number(backward) else "-"
    per_gpu = r["projected_tokens_per_s"] / r["world_size"]
    return [seconds(step), *parts, split, sig(per_gpu), f"{100 * r['projected_mfu']:.1f}%"]


class _Notes:
    """A point's reason as a mark in its status cell (`skipped [1]`), the whole text once below the table: a cut
    reason (`status: reason...`) told half of it."""

    def __init__(self):
        self.texts: list[str] = []

    def mark(self, status: str, detail) -> str:
        if not isinstance(detail, str) or not detail:  # None, or NaN in a frame
            return status
        text = str(detail)
        if text not in self.texts:
            self.texts.append(text)
        return f"{status} [{self.texts.index(text) + 1}]"

    def below(self, table: str) -> str:
        return "\n".join([table, *(f"[{i}] {text}" for i, text in enumerate(self.texts, 1))])


def _render(header: list[str], lines: list[list]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*(str(x).replace("\n", " ") for x in line)) for line in lines]
    return "\n".join(out)
