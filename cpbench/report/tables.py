"""The comparison table users know: rows are sequence lengths, columns are cp sizes (and the backend, style or
any other spec field the sweep varies), cells `<peak>, <median step> ms` (the peaks in one unit per table) with the
parity verdict — or what happened instead (`out of memory`, `timeout`, `error`, `skipped`). The headline memory is
the max over ranks.
"""

from __future__ import annotations

import html

import numpy as np
import pandas as pd

from . import units
from .balance import imbalance_text, slowest_text
from .derive import ordered_configs, with_config
from .runs.match import check_unique

NOT_RUN = "—"  # the sweep has no such point
STATUS_TEXT = {"oom": "out of memory", "timeout": "timeout", "error": "error", "skipped": "skipped"}
PARITY_TEXT = {"pass": "parity ✓", "fail": "parity ✗ FAIL", "reference_oom": "parity: reference out of memory",
               "error": "parity error", "skipped": "parity skipped"}


def cell(row: pd.Series, unit: tuple[int, str] = (units.GIB, "GiB")) -> str:
    """One point as the table shows it, its peak in the table's `unit`. A projected point says so: its peak is a
    projection, its time one on a GPU profile (`estimate --gpu`; none without), and it has no parity."""
    status = row["status"]
    peak = units.in_unit(row["peak_bytes"], unit)
    if row.get("measurement") == "projected":
        step = row.get("projected_step_s")
        if status == "ok":
            return f"{peak}, {units.seconds(step)} projected" if pd.notna(step) else f"{peak} projected"
        if status == "oom" and pd.notna(row["peak_bytes"]):
            return f"out of memory ({peak}{', ' + units.seconds(step) if pd.notna(step) else ''} projected)"
        return STATUS_TEXT.get(status, str(status))
    if status != "ok":
        return STATUS_TEXT.get(status, str(status))
    text = f"{peak}, {units.ms(row['step_time_median_s'])}"
    parity = row["parity_status"]
    if isinstance(parity, str):
        text += f", {PARITY_TEXT.get(parity, 'parity ' + parity)}"
    return text


def comparison(frame: pd.DataFrame) -> pd.DataFrame:
    """The table as a DataFrame of strings: index `seq_len`, one column per configuration."""
    labelled = with_config(frame)
    check_unique(frame, "run")  # one cell per point
    unit = units.byte_unit(frame["peak_bytes"]) if len(frame) else (units.GIB, "GiB")
    cells = labelled.assign(cell=labelled.apply(cell, axis=1, unit=unit) if len(labelled) else [])
    table = cells.pivot(index="seq_len", columns="config", values="cell")
    table = table.reindex(columns=ordered_configs(frame)).sort_index().fillna(NOT_RUN)
    table.columns.name = None
    return table


def points(frame: pd.DataFrame) -> pd.DataFrame:
    """Every point with its details (per-rank peaks, spread of step times, parity errors, why it is not ok); the
    byte columns in one unit, picked from their values."""
    values = [v for c in ("peak_bytes", "activations_bytes", "temporaries_bytes") if c in frame for v in frame[c]]
    unit = units.byte_unit(values)
    rows = [_point_row(row, unit) for _, row in frame.iterrows()]
    host = frame["host_node_peak_bytes"].fillna(0) if "host_node_peak_bytes" in frame else pd.Series(dtype=float)
    if (host > 0).any():  # an offload lever put something on the host: where, and what moved
        host_unit = units.byte_unit(host)
        moved = frame["d2h_bytes"].fillna(0) + frame["h2d_bytes"].fillna(0)
        moved_unit = units.byte_unit(moved)
        for row, (_, r), m in zip(rows, frame.iterrows(), moved):
            row["host per node"] = units.in_unit(r.get("host_node_peak_bytes"), host_unit)
            row["host<->device per step"] = units.in_unit(m if pd.notna(r.get("d2h_bytes")) else None, moved_unit)
    return pd.DataFrame(rows)


def _point_row(row: pd.Series, unit: tuple[int, str]) -> dict:
    per_rank = row["peak_bytes_per_rank"]
    ranks = ", ".join(units.sig(b / unit[0]) for b in per_rank) if _has(per_rank) else "–"
    return {
        "point": row["point_id"],
        "status": row["status"] + (" (projected)" if row.get("measurement") == "projected" else ""),
        "peak (max over ranks)": units.in_unit(row["peak_bytes"], unit),
        f"peak per rank ({unit[1]})": ranks,
        "activations": units.in_unit(row["activations_bytes"], unit),
        "temporaries": units.in_unit(row.get("temporaries_bytes"), unit),
        "step median": _projected_or(row, "step_time_median_s", "projected_step_s", units.ms),
        "step p10–p90": _spread(row),
        "attention imbalance": imbalance_text(row),
        "slowest rank": slowest_text(row),
        "tokens/s per GPU": _projected_or(row, "tokens_per_s", "projected_tokens_per_s",
                                          lambda v: units.sig(v / _ranks(row))),
        "parity": row["parity_status"] if isinstance(row["parity_status"], str) else "–",
        "loss rel err": units.sig(row["loss_rel_err"], 2),
        "grad max rel err": units.sig(row["grad_max_rel_err"], 2),
        "detail": _detail(row),
    }


def _ranks(row: pd.Series) -> int:
    ranks = row.get("world_size")
    return int(ranks) if ranks is not None and pd.notna(ranks) and ranks > 0 else 1


def _projected_or(row: pd.Series, measured: str, projected: str, show) -> str:
    """A measured value, or on a projected row with a time its projected one, said as such."""
    value = row.get(projected)
    if row.get("measurement") == "projected" and value is not None and pd.notna(value):
        return f"{show(value)} projected"
    return show(row[measured])


def _spread(row: pd.Series) -> str:
    low, high = row["step_time_p10_s"], row["step_time_p90_s"]
    return "–" if pd.isna(low) or pd.isna(high) else f"{units.ms(low)} – {units.ms(high)}"


def _detail(row: pd.Series) -> str:
    parts = [row[c] for c in ("status_detail", "parity_detail") if isinstance(row[c], str) and row[c]]
    return "; ".join(parts)


def _has(values) -> bool:
    return values is not None and not (isinstance(values, float) and np.isnan(values)) and len(values) > 0


def to_markdown(table: pd.DataFrame, index_name: str | None = None) -> str:
    """A GitHub Markdown table (no tabulate dependency); the index becomes the first column when named."""
    header = ([index_name] if index_name else []) + [str(c) for c in table.columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for index, values in zip(table.index, table.itertuples(index=False)):
        cells = ([str(index)] if index_name else []) + [_md_escape(v) for v in values]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _md_escape(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def to_html(table: pd.DataFrame, index_name: str | None = None) -> str:
    """The same table as an HTML <table>, cells coloured by outcome."""
    header = ([index_name] if index_name else []) + [str(c) for c in table.columns]
    out = ["<table>", "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>"]
    for index, values in zip(table.index, table.itertuples(index=False)):
        cells = [f"<th>{html.escape(str(index))}</th>"] if index_name else []
        cells += [f'<td class="{_css_class(v)}">{html.escape(str(v))}</td>' for v in values]
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def _css_class(value) -> str:
    text = str(value)
    if "FAIL" in text or text in ("error", "timeout"):
        return "bad"
    if text == "out of memory":
        return "oom"
    if text in ("skipped", NOT_RUN):
        return "none"
    return "ok"


def comparison_markdown(frame: pd.DataFrame) -> str:
    return to_markdown(comparison(frame), index_name="seq len")


def fits(frame: pd.DataFrame) -> pd.DataFrame:
    """Per configuration, the largest length that fits and the shortest that did not, with the device peak at that
    fit and, where anything lives on the host, the host memory of a node."""
    from .derive import largest_fit

    table = largest_fit(frame)
    out = pd.DataFrame({
        "configuration": table["config"],
        "largest ok seq len": table["largest_ok_seq_len"].map(lambda v: "–" if pd.isna(v) else f"{int(v):,}"),
        "first failure at": table["first_failed_seq_len"].map(lambda v: "–" if pd.isna(v) else f"{int(v):,}"),
    })
    device = units.byte_unit(table["peak_bytes"])
    out["peak at the fit"] = [units.in_unit(v if pd.notna(v) else None, device) for v in table["peak_bytes"]]
    host = table["host_node_peak_bytes"]
    if (host.fillna(0) > 0).any():
        unit = units.byte_unit(host)
        out["host per node at the fit"] = [units.in_unit(v if pd.notna(v) else None, unit) for v in host]
    return out
