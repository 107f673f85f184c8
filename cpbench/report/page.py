"""One report per run, readable without Python: `report.html` (self-contained, images embedded as base64) and
`report.md` (the same content, images beside it in `plots/`), plus `table.md` (the comparison table alone)."""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from . import axes, balance, plots, tables, units
from .compare import beside_projected
from .derive import measurement_note, profile_note, ratios_vs_cp1
from .runs.load import run_label
from .peers import has_peers, peers_figure, peers_table

CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px}
table{border-collapse:collapse;margin:1em 0;font-size:90%}th,td{border:1px solid #ccc;padding:4px 8px;text-align:left}
td.bad{background:#fdd}td.oom{background:#ffe9c7}td.none{color:#888}img{max-width:100%;margin:1em 0}"""

FIGURE_TITLES = {"memory": "Peak memory per rank", "time": "Step time and throughput",
                 "scaling": "Speed-up and memory against cp=1", "memory_breakdown": "Memory breakdown",
                 "parity": "Parity errors against tolerance", "largest_fit": "Largest sequence length that fits",
                 "peers": "CP implementations side by side",
                 "balance": "Attention work per cp rank on packed points"}


# The report's figures: each is drawn when the run has something for it to show, else listed with why (the peers
# figure, for peer runs only, comes beside them).
FIGURES = {**plots.FIGURES, "balance": balance.balance_figure}


@dataclass(frozen=True)
class ReportFiles:
    html: Path
    markdown: Path
    table: Path
    plots: dict[str, Path]
    omitted: dict[str, str]  # figure -> why it was not drawn (nothing to show)


def save_figures(frame: pd.DataFrame, out_dir: str | Path, capacity: float | None = None
                 ) -> tuple[dict[str, Path], dict[str, str]]:
    """Every figure that has something to show as `<out_dir>/<name>.png` (name -> path), and why each other one was
    not drawn (name -> reason)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths, omitted = {}, {}
    for name, draw in FIGURES.items():
        fig = draw(frame, capacity) if name == "memory" else draw(frame)
        why = plots.nothing_to_show(fig)
        if why is not None:
            omitted[name] = why
            continue
        paths[name] = out_dir / f"{name}.png"
        axes.save(fig, paths[name], dpi=100)
    if has_peers(frame):
        paths["peers"] = out_dir / "peers.png"
        axes.save(peers_figure(frame), paths["peers"], dpi=100)
    return paths, omitted


def environment(frame: pd.DataFrame) -> pd.DataFrame:
    """What the run ran on and with (every distinct value, should a run mix them)."""
    fields = ("suite", "run_id", "model", "device", "hardware_id", "device_name", "torch_version",
              "transformers_version", "cpbench_version", "cuda_version", "git_commit", "git_dirty", "host", "cpu_count")
    rows = {f: ", ".join(str(v) for v in frame[f].dropna().unique()) or "–" for f in fields}
    stamps = frame["timestamp"].dropna()
    rows["finished"] = f"{stamps.min()} – {stamps.max()}" if len(stamps) else "–"
    rows["points"] = ", ".join(f"{n} {s}" for s, n in frame["status"].value_counts().items())
    return pd.DataFrame({"value": rows})


def ratio_table(frame: pd.DataFrame) -> pd.DataFrame:
    ratios = ratios_vs_cp1(frame)
    return pd.DataFrame({
        "configuration": ratios["config"], "seq len": ratios["seq_len"],
        "speed-up": ratios["speedup"].map(lambda v: f"×{units.sig(v)}"),
        "peak memory ratio": ratios["memory_ratio"].map(units.sig),
        "activations ratio": ratios["activations_ratio"].map(units.sig),
    })


def _sections(frame: pd.DataFrame, projected: pd.DataFrame | None, omitted: dict[str, str]):
    """(before the figures, after them): lists of (title, table, index name) in page order."""
    note = measurement_note(frame)
    before = [("Comparison (peak memory per rank, max over ranks; median step time; parity)" + note,
               tables.comparison(frame), "seq len")]
    if frame.attrs.get("notes"):  # what load_run could not read, or recovered (a damaged table)
        before.insert(0, ("Read with notes (what could not be read, and what was recovered)",
                          pd.DataFrame({"note": frame.attrs["notes"]}), None))
    if projected is not None:
        before.append(("Projected beside measured (the projection's error per point)",
                       beside_projected(frame, projected), None))
    if has_peers(frame):
        before.append(("Peers (step time / unsharded step time, peak memory per rank, parity against the unsharded "
                       "op)", peers_table(frame), "seq len"))
    before.append(("Largest sequence length that fits" + note, tables.fits(frame), None))
    after = [("Against cp=1 (ideal activations ratio: 1/cp)", ratio_table(frame), None),
             ("Points", tables.points(frame), None), ("Environment", environment(frame), "field")]
    if omitted:
        after.insert(0, ("Figures not drawn (nothing to show)", pd.DataFrame(
            {"figure": [FIGURE_TITLES[n] for n in omitted], "why": list(omitted.values())}), None))
    return before, after


def write_report(frame: pd.DataFrame, out_dir: str | Path, capacity: float | None = None,
                 projected: pd.DataFrame | None = None) -> ReportFiles:
    """The page, its table and plots; with `projected` (a projection of the same points), a section of each
    point's measured and projected step and peak. Figures with nothing to show are listed with why."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    images, omitted = save_figures(frame, out_dir / "plots", capacity)
    title = f"cpbench report: {run_label(frame)}{measurement_note(frame)}"
    before, after = _sections(frame, projected, omitted)
    table = out_dir / "table.md"
    table.write_text(tables.comparison_markdown(frame) + "\n")
    markdown = out_dir / "report.md"
    lead = profile_note(frame)
    markdown.write_text(_markdown(title, lead, before, after, images, out_dir))
    page = out_dir / "report.html"
    page.write_text(_html(title, lead, before, after, images))
    return ReportFiles(html=page, markdown=markdown, table=table, plots=images, omitted=omitted)


def _markdown(title: str, lead: str | None, before, after, images: dict[str, Path], out_dir: Path) -> str:
    parts = [f"# {title}", "", *([lead, ""] if lead else [])]
    for heading, table, index_name in before:
        parts += [f"## {heading}", "", tables.to_markdown(table, index_name), ""]
    for name, path in images.items():
        parts += [f"## {FIGURE_TITLES[name]}", "", f"![{name}]({path.relative_to(out_dir).as_posix()})", ""]
    for heading, table, index_name in after:
        parts += [f"## {heading}", "", tables.to_markdown(table, index_name), ""]
    return "\n".join(parts)


def _html(title: str, lead: str | None, before, after, images: dict[str, Path]) -> str:
    body = [f"<h1>{html.escape(title)}</h1>", *([f"<p>{html.escape(lead)}</p>"] if lead else [])]
    for heading, table, index_name in before:
        body += [f"<h2>{html.escape(heading)}</h2>", tables.to_html(table, index_name)]
    for name, path in images.items():
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        body += [f"<h2>{html.escape(FIGURE_TITLES[name])}</h2>", f'<img alt="{name}" src="data:image/png;base64,{data}">']
    for heading, table, index_name in after:
        body += [f"<h2>{html.escape(heading)}</h2>", tables.to_html(table, index_name)]
    return (f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{CSS}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n")
