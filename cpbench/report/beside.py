"""A measured run beside a projection of the same points: step time and peak per point, and the projection's
error (`cpbench report RUN --projected PROJECTED_RUN`). Points are matched on their key columns (match.py); a point
only one of the runs holds is left out."""

from __future__ import annotations

import pandas as pd

from . import units
from .match import match_points, side


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
