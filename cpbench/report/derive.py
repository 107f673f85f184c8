"""Quantities derived from a run's rows: how points group into configurations, ratios against cp=1, and the
largest sequence length that fits. Plain DataFrames in, plain DataFrames out (tables and plots draw them)."""

from __future__ import annotations

import pandas as pd

from .runs.schema import KEY_COLUMNS

SEPARATOR = " · "  # between the parts of a configuration's label (axes.wrap breaks long labels there)

# The key columns a comparison column is made of, in label order (cp size first, as users read it).
CONFIG_ORDER = ("cp_size", "attn_implementation", "cp_style") + tuple(
    c for c in KEY_COLUMNS if c not in ("seq_len", "cp_size", "attn_implementation", "cp_style")
)


def varying(frame: pd.DataFrame) -> list[str]:
    """The configuration columns that take more than one value in this run; cp_size always."""
    return [c for c in CONFIG_ORDER if c == "cp_size" or frame[c].nunique(dropna=False) > 1]


def config_labels(frame: pd.DataFrame) -> pd.Series:
    """One label per row naming its configuration (everything but seq_len), e.g. `cp 2 · sdpa · cp_ring`."""
    dims = varying(frame)
    return frame.apply(lambda row: _label(row, dims), axis=1).astype(str) if len(frame) else pd.Series(dtype=str)


def _label(row: pd.Series, dims: list[str]) -> str:
    parts = []
    for dim in dims:
        value = row[dim]
        if dim == "cp_size":
            parts.append(f"cp {int(value)}")
        elif dim == "cp_style" and value == "none":
            continue  # cp 1 has no style: 'cp 1 · sdpa' reads better than 'cp 1 · sdpa · none'
        elif dim in ("attn_implementation", "cp_style", "implementation", "level"):
            parts.append(str(value))
        else:
            parts.append(f"{dim}={value}")
    return SEPARATOR.join(parts)


def ordered_configs(frame: pd.DataFrame) -> list[str]:
    """Configuration labels sorted by cp size, then the other varying columns. A frame `with_config` already
    labelled (a part of a run: its ok points, say) keeps the run's labels and order, so a figure draws the labels it
    coloured."""
    labelled = with_config(frame)
    return labelled.sort_values("config_order", kind="stable")["config"].drop_duplicates().tolist()


def with_config(frame: pd.DataFrame) -> pd.DataFrame:
    """The frame with `config` (its label) and `config_order` (its place among the run's configurations). Label the
    whole run, then take parts of it: labels made from a part name only what varies within that part."""
    if "config" in frame and "config_order" in frame:
        return frame
    labels = config_labels(frame)
    if not len(frame):
        return frame.assign(config=labels, config_order=pd.Series(dtype=int))
    dims = varying(frame)
    order = frame.assign(config=labels).sort_values(dims, kind="stable")["config"].drop_duplicates().tolist()
    return frame.assign(config=labels, config_order=labels.map({c: i for i, c in enumerate(order)}))


def with_projected_time(frame: pd.DataFrame) -> pd.DataFrame:
    """The frame with each projected row's time where the figures and ratios read a measured one (its step,
    without a spread, and its tokens/s): for drawing only, the file keeps the two apart. A projection without a
    GPU profile has no time and stays without."""
    if "projected_step_s" not in frame or not frame["projected_step_s"].notna().any():
        return frame
    out = frame.copy()
    timed = (out["measurement"] == "projected") & out["projected_step_s"].notna()
    for column in ("step_time_median_s", "step_time_p10_s", "step_time_p90_s"):
        out.loc[timed, column] = out.loc[timed, "projected_step_s"]
    out.loc[timed, "tokens_per_s"] = out.loc[timed, "projected_tokens_per_s"]
    return out


def ratios_vs_cp1(frame: pd.DataFrame) -> pd.DataFrame:
    """For each ok point with cp > 1: speed-up (cp1 median step / its median step) and memory ratios
    (its peak / cp1 peak, and the same for activations) against the cp=1 point of the same other key columns.
    Points without an ok cp=1 counterpart are left out (there is nothing to divide by)."""
    match = [c for c in KEY_COLUMNS if c not in ("cp_size", "cp_style", "implementation")]  # cp 1: unsharded
    labelled = with_config(with_projected_time(frame))  # labels from the whole run, as every other table and figure has them
    ok = labelled[labelled["status"] == "ok"]
    base = ok[ok["cp_size"] == 1][match + ["step_time_median_s", "peak_bytes", "activations_bytes"]]
    base = base.drop_duplicates(match)
    merged = ok[ok["cp_size"] > 1].merge(base, on=match, suffixes=("", "_cp1"))
    merged["speedup"] = merged["step_time_median_s_cp1"] / merged["step_time_median_s"]
    merged["memory_ratio"] = merged["peak_bytes"] / merged["peak_bytes_cp1"]
    merged["activations_ratio"] = merged["activations_bytes"] / merged["activations_bytes_cp1"]
    return merged[["config", "point_id", "seq_len", "cp_size", "speedup", "memory_ratio", "activations_ratio"]]


def largest_fit(frame: pd.DataFrame) -> pd.DataFrame:
    """Per configuration: the longest seq_len whose point is ok, and the shortest that was not (oom etc.)."""
    labelled = with_config(frame)
    rows = []
    for config in ordered_configs(frame):
        points = labelled[labelled["config"] == config]
        ok = points[points["status"] == "ok"]
        failed = points[points["status"].isin(["oom", "error", "timeout"])]["seq_len"]
        best = ok.loc[ok["seq_len"].idxmax()] if len(ok) else None
        rows.append({"config": config, "largest_ok_seq_len": int(best["seq_len"]) if best is not None else None,
                     "first_failed_seq_len": int(failed.min()) if len(failed) else None,
                     "peak_bytes": best["peak_bytes"] if best is not None else None,
                     "host_node_peak_bytes": best.get("host_node_peak_bytes") if best is not None else None})
    result = pd.DataFrame(rows, columns=FIT_COLUMNS)
    return result.astype({"largest_ok_seq_len": "Int64", "first_failed_seq_len": "Int64", "peak_bytes": "Int64",
                          "host_node_peak_bytes": "Int64"})


# what largest_fit gives per configuration: the device peak and the host memory of a node at the largest fit
FIT_COLUMNS = ["config", "largest_ok_seq_len", "first_failed_seq_len", "peak_bytes", "host_node_peak_bytes"]


def measurement_note(frame: pd.DataFrame) -> str:
    """What a title must say about its numbers: "" for a measured run, " (projected)" when every row is a
    projection (`cpbench estimate`), " (measured and projected)" for a mix."""
    kinds = set(frame["measurement"].dropna()) if "measurement" in frame else set()
    if "projected" not in kinds:
        return ""
    return " (projected)" if kinds == {"projected"} else " (measured and projected)"


def profile_note(frame: pd.DataFrame) -> str | None:
    """The GPU profile (and where it comes from) that a run's projected times are for, or None where none is."""
    if "gpu_profile" not in frame or "projected_step_s" not in frame:
        return None
    timed = frame[frame["projected_step_s"].notna()]
    names = [str(v) for v in timed["gpu_profile"].dropna().unique()]
    if not names:
        return None

    def source(name: str) -> str:
        if name.endswith(".toml") or "/" in name or "\\" in name:
            return f"`{name}`, a profile file (`cpbench calibrate` writes them)"
        return (f"`{name}`, shipped with cpbench (cpbench/harness/project/gpus.toml gives each figure's source; "
                "docs/time.md how far its times are from published steps)")

    return (f"Projected times are priced on the GPU profile {' and '.join(source(n) for n in names)}; measured "
            "times are this run's own." if len(timed) < len(frame) else
            f"Projected times are priced on the GPU profile {' and '.join(source(n) for n in names)}.")
