"""The time model's record against the published measurements cpbench's repository holds it to
(results/published/table.md): each judged row's step error (record.json, which results/published/table.py writes
beside the table) and what it says of a regime (at most or over 64k tokens per GPU, on one GPU or several), which
`cpbench estimate` and `cpbench plan` print under their points. Not an error bar for a point: how far the projection
ran from measured steps of its regime, whose rows may differ from it (a model's size, CP or none)."""

from __future__ import annotations

import json
from importlib import resources

SHORT = 65536  # tokens per GPU: the short regime's bound (table.md's mean error splits there too)


def record() -> list[dict]:
    """Each judged published measurement's tokens per GPU, GPUs and `step_error` (the projected step over the
    measured one, less one: below zero the projection ran fast), as results/published/table.py last wrote them."""
    return json.loads(resources.files(__package__).joinpath("record.json").read_text())["rows"]


def regime(tokens_per_gpu: float, gpus: int) -> tuple[bool, bool]:
    """(at most 64k tokens per GPU, on several GPUs): the regimes the record tells apart."""
    return tokens_per_gpu <= SHORT, gpus > 1


def record_lines(points, rows: list[dict] | None = None) -> list[str]:
    """What the record says of each regime among `points` ((tokens per GPU, GPUs) of the projected points): how far
    the projected steps of the published measurements of that regime ran from the measured ones, and their cp sizes
    (a point's regime may be judged by rows unlike it)."""
    rows = record() if rows is None else rows
    out = []
    for short, several in sorted({regime(t, g) for t, g in points}, reverse=True):
        where = f"{'<=' if short else 'over'} 64k tokens per GPU on {'several GPUs' if several else 'one GPU'}"
        mine = [r for r in rows if regime(r["tokens_per_gpu"], r["gpus"]) == (short, several)]
        if not mine:
            out.append(f"{where}: no published measurement of this regime is judged; the step time is unchecked here")
            continue
        errors, cps = [r["step_error"] for r in mine], sorted({r["cp"] for r in mine})
        cp = f"cp {cps[0]}" if len(cps) == 1 else f"cp {cps[0]} to {cps[-1]}"
        out.append(f"{where}: {len(mine)} published measurement{'s' * (len(mine) > 1)} ({cp}), projected steps "
                   f"{_span(min(errors), max(errors))} than measured (mean {_pct(sum(errors) / len(errors))})")
    return out


def record_block(df) -> str:
    """The record's lines for a run's timed rows, under a heading, or nothing where no row is timed."""
    timed = df[df["projected_step_s"].notna()] if "projected_step_s" in df else df.iloc[:0]
    if not len(timed):
        return ""
    points = zip(timed["seq_len"] * timed["batch_size"] / timed["cp_size"], timed["world_size"])
    return ("the step-time model against published steps of these points' regimes (results/published/table.md in "
            "cpbench's repository; docs/time.md says where it errs):\n"
            + "\n".join(f"  {line}" for line in record_lines(points)))


def _pct(error: float) -> str:
    size = 100 * abs(error)  # under 1 %, a decimal: its direction then still means something
    return f"{size:.{1 if size < 1 else 0}f} % {'shorter' if error < 0 else 'longer'}"


def _span(lo: float, hi: float) -> str:
    if round(100 * lo) == round(100 * hi):
        return _pct(lo)
    if hi < 0:
        return f"{-100 * hi:.0f} to {-100 * lo:.0f} % shorter"
    if lo >= 0:
        return f"{100 * lo:.0f} to {100 * hi:.0f} % longer"
    return f"{-100 * lo:.0f} % shorter to {100 * hi:.0f} % longer"
