"""The summary table printed at the end of a sweep (plain text; the report area renders the full tables).
Numbers are rendered by `cpbench.report.units`, the one place that turns bytes and seconds into text."""

from __future__ import annotations

import json

from cpbench.report.units import human_bytes, ms, sig


def overrides_lines(df) -> list[str]:
    """Each model's overrides, once (a point's model names them by a short hash: `qwen3-0.6b+3f2a1c`)."""
    seen = {}
    for r in df.to_dict("records"):
        spec = json.loads(r.get("spec_json") or "{}")
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
    header = ["point", "status", "peak/rank", "activations", "RSS", "step (p50)", "tok/s", "parity"]
    lines = []
    for r in df.to_dict("records"):
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {str(r.get('status_detail'))[:40]}"
        lines.append([
            r["point_id"], status, human_bytes(r.get("peak_bytes")), human_bytes(r.get("activations_bytes")),
            human_bytes(r.get("rss_peak_bytes")), ms(r.get("step_time_median_s")), sig(r.get("tokens_per_s")),
            r.get("parity_status") or "",
        ])
    return _render(header, lines)


def projected_table(df) -> str:
    """A projected run: what fits, the peak's breakdown, and what one step sends (no time, no parity)."""
    header = ["point (projected)", "status", "peak/rank", "params", "grads", "optimizer", "activations",
              "temporaries", "sent/step"]
    lines = []
    for r in df.to_dict("records"):
        status = r["status"] if r["status"] in ("ok", "oom") else f"{r['status']}: {str(r.get('status_detail'))[:40]}"
        sent = sum(r.get(c) or 0 for c in r if c.startswith("comm_") and c.endswith("_bytes"))
        lines.append([r["point_id"], status, *(human_bytes(r.get(c)) for c in (
            "peak_bytes", "params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
            "temporaries_bytes")), human_bytes(sent) if r["status"] in ("ok", "oom") else "–"])
    return _render(header, lines)


def _render(header: list[str], lines: list[list]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*(str(x).replace("\n", " ") for x in line)) for line in lines]
    return "\n".join(out)
