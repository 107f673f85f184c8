"""The summary table printed at the end of a sweep (plain text; the report area renders the full tables)."""

from __future__ import annotations

import math

MIB = 2**20


def _mib(v) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v / MIB:.1f}"


def _ms(v) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v * 1e3:.0f}"


def summary_table(df) -> str:
    """One line per point: what fits, how fast, and whether it matches the unsharded run."""
    header = ["point", "status", "peak MiB/rank", "activ. MiB", "RSS MiB", "step ms (p50)", "tok/s", "parity"]
    lines = []
    for r in df.to_dict("records"):
        tok = r.get("tokens_per_s")
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {str(r.get('status_detail'))[:40]}"
        lines.append([
            r["point_id"], status, _mib(r.get("peak_bytes")), _mib(r.get("activations_bytes")),
            _mib(r.get("rss_peak_bytes")), _ms(r.get("step_time_median_s")),
            "" if tok is None or (isinstance(tok, float) and math.isnan(tok)) else f"{tok:.0f}",
            r.get("parity_status") or "",
        ])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*(str(x).replace("\n", " ") for x in line)) for line in lines]
    return "\n".join(out)
