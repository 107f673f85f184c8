"""Two runs side by side, point by point (matched on KEY_COLUMNS), with the change per metric.

`compare(a, b)` is numeric (for notebooks and plots): per point each metric's value in A and B and its
relative change; `render` turns it into the Markdown `python -m cpbench compare` prints. `beside_projected`: a
measured run beside a projection of the same points, and the projection's error (`report RUN --projected PROJ`).
"""

from __future__ import annotations

import pandas as pd

from . import units
from .runs.match import check_unique, match_points, side

METRICS = {  # column -> (heading, renderer)
    "peak_bytes": ("peak / rank", units.human_bytes),
    "activations_bytes": ("activations", units.human_bytes),
    "step_time_median_s": ("step median", units.ms),
    "tokens_per_s": ("tokens/s", units.sig),
    "grad_max_rel_err": ("grad max rel err", lambda v: units.sig(v, 2)),
}
LABELS = ("measurement", "status", "parity_status")


def compare(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """One row per point of either run: `where` (both / only_a / only_b), `<col>_a`, `<col>_b`, `<metric>_change`."""
    check_unique(a, "run A")
    check_unique(b, "run B")
    merged = match_points(a, b, ("_a", "_b"))
    out = pd.DataFrame({
        "point_id": merged["point_id_a"].fillna(merged["point_id_b"]),
        "seq_len": merged["seq_len_a"].fillna(merged["seq_len_b"]).astype("Int64"),
        "where": merged["_merge"].map({"both": "both", "left_only": "only_a", "right_only": "only_b"}).astype(str),
    })
    for column in LABELS:
        out[f"{column}_a"], out[f"{column}_b"] = merged[f"{column}_a"], merged[f"{column}_b"]
    for column in METRICS:
        old, new = merged[f"{column}_a"].astype(float), merged[f"{column}_b"].astype(float)
        out[f"{column}_a"], out[f"{column}_b"] = old, new
        out[f"{column}_change"] = (new - old) / old.abs()
    return out.reset_index(drop=True)


def _cell(old, new, render) -> str:
    if pd.isna(old) and pd.isna(new):
        return "–"
    if old == new:
        return f"{render(new)} (same)"
    return f"{render(old)} → {render(new)} ({units.change(old, new)})"


def _label(old, new) -> str:
    old, new = (v if isinstance(v, str) else "–" for v in (old, new))
    return old if old == new else f"{old} → {new}"


def table(comparison: pd.DataFrame) -> pd.DataFrame:
    """The matched points as strings: `A → B (change)` per metric."""
    both = comparison[comparison["where"] == "both"]
    rows = []
    for _, row in both.iterrows():
        cells = {"point": row["point_id"], "measurement": _label(row["measurement_a"], row["measurement_b"]),
                 "status": _label(row["status_a"], row["status_b"]),
                 "parity": _label(row["parity_status_a"], row["parity_status_b"])}
        for column, (heading, render) in METRICS.items():
            cells[heading] = _cell(row[f"{column}_a"], row[f"{column}_b"], render)
        rows.append(cells)
    return pd.DataFrame(rows, columns=["point", "measurement", "status", "parity"] + [h for h, _ in METRICS.values()])


def render(comparison: pd.DataFrame, label_a: str, label_b: str) -> str:
    from .tables import to_markdown

    lines = [f"# {label_a} (A) → {label_b} (B)", "", to_markdown(table(comparison))]
    for where, title in (("only_a", f"Only in A ({label_a})"), ("only_b", f"Only in B ({label_b})")):
        points = comparison[comparison["where"] == where]["point_id"].tolist()
        if points:
            lines += ["", f"{title}:"] + [f"- {p}" for p in points]
    return "\n".join(lines) + "\n"


def beside_projected(measured: pd.DataFrame, projected: pd.DataFrame) -> pd.DataFrame:
    """One row per point both runs hold ok: measured and projected step and peak, and the projection's errors."""
    pairs = match_points(measured, projected, ("_m", "_p"))
    rows = []
    for _, pair in pairs[pairs["_merge"] == "both"].iterrows():
        m, p = side(pair, "_m"), side(pair, "_p")
        if m["status"] != "ok" or p["status"] not in ("ok", "oom"):
            continue
        step, proj = m["step_time_median_s"], p.get("projected_step_s")
        timed = pd.notna(step) and pd.notna(proj)
        rows.append({
            "point": m["point_id"],
            "measured step": units.seconds(step),
            "projected step": f"{units.seconds(proj)} ({p['gpu_profile']})" if pd.notna(proj) else "no --gpu",
            "step error": f"{100 * (proj / step - 1):+.0f} %" if timed else "",
            "measured peak": units.human_bytes(m["peak_bytes"]),
            "projected peak": units.human_bytes(p["peak_bytes"]),
            "peak error": f"{100 * (p['peak_bytes'] / m['peak_bytes'] - 1):+.1f} %" if m["peak_bytes"] else "",
        })
    return pd.DataFrame(rows, columns=["point", "measured step", "projected step", "step error", "measured peak",
                                       "projected peak", "peak error"])
