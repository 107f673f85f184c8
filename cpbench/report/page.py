"""One report per run, readable without Python: `report.html` (self-contained, images embedded as base64) and
`report.md` (the same content, images beside it in `plots/`), plus `table.md` (the comparison table alone)."""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from . import plots, tables, units
from .compare import beside_projected
from .derive import measurement_note, ratios_vs_cp1
from .load import run_label
from .peers import has_peers, peers_table

CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px}
table{border-collapse:collapse;margin:1em 0;font-size:90%}th,td{border:1px solid #ccc;padding:4px 8px;text-align:left}
td.bad{background:#fdd}td.oom{background:#ffe9c7}td.none{color:#888}img{max-width:100%;margin:1em 0}"""

FIGURE_TITLES = {"memory": "Peak memory per rank", "time": "Step time and throughput",
                 "scaling": "Speed-up and memory against cp=1", "memory_breakdown": "Memory breakdown",
                 "parity": "Parity errors against tolerance", "largest_fit": "Largest sequence length that fits",
                 "peers": "CP implementations side by side"}


@dataclass(frozen=True)
class ReportFiles:
    html: Path
    markdown: Path
    table: Path
    plots: dict[str, Path]


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


def _sections(frame: pd.DataFrame) -> list[tuple[str, pd.DataFrame, str | None]]:
    """(title, table, index name) in page order."""
    fits = tables.fits(frame)
    note = measurement_note(frame)
    peers = []
    if has_peers(frame):
        peers = [("Peers (step time / unsharded step time, peak memory per rank, parity against the unsharded op)",
                  peers_table(frame), "seq len")]
    return [
        ("Comparison (peak memory per rank, max over ranks; median step time; parity)" + note,
         tables.comparison(frame), "seq len"),
        *peers,
        ("Largest sequence length that fits" + note, fits, None),
        ("Against cp=1 (ideal activations ratio: 1/cp)", ratio_table(frame), None),
        ("Points", tables.points(frame), None),
        ("Environment", environment(frame), "field"),
    ]


def write_report(frame: pd.DataFrame, out_dir: str | Path, capacity: float | None = None,
                 projected: pd.DataFrame | None = None) -> ReportFiles:
    """The page, its table and plots; with `projected` (a projection of the same points), a section of each
    point's measured and projected step and peak."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    images = plots.save_all(frame, out_dir / "plots", capacity)
    title = f"cpbench report: {run_label(frame)}{measurement_note(frame)}"
    sections = _sections(frame)
    if projected is not None:
        sections.insert(1, ("Projected beside measured (the projection's error per point)",
                            beside_projected(frame, projected), None))
    table = out_dir / "table.md"
    table.write_text(tables.to_markdown(sections[0][1], "seq len") + "\n")
    markdown = out_dir / "report.md"
    markdown.write_text(_markdown(title, sections, images, out_dir))
    page = out_dir / "report.html"
    page.write_text(_html(title, sections, images))
    return ReportFiles(html=page, markdown=markdown, table=table, plots=images)


def _markdown(title: str, sections, images: dict[str, Path], out_dir: Path) -> str:
    parts = [f"# {title}", ""]
    for heading, table, index_name in sections[:3]:
        parts += [f"## {heading}", "", tables.to_markdown(table, index_name), ""]
    for name, path in images.items():
        parts += [f"## {FIGURE_TITLES[name]}", "", f"![{name}]({path.relative_to(out_dir).as_posix()})", ""]
    for heading, table, index_name in sections[3:]:
        parts += [f"## {heading}", "", tables.to_markdown(table, index_name), ""]
    return "\n".join(parts)


def _html(title: str, sections, images: dict[str, Path]) -> str:
    body = [f"<h1>{html.escape(title)}</h1>"]
    for heading, table, index_name in sections[:3]:
        body += [f"<h2>{html.escape(heading)}</h2>", tables.to_html(table, index_name)]
    for name, path in images.items():
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        body += [f"<h2>{html.escape(FIGURE_TITLES[name])}</h2>", f'<img alt="{name}" src="data:image/png;base64,{data}">']
    for heading, table, index_name in sections[3:]:
        body += [f"<h2>{html.escape(heading)}</h2>", tables.to_html(table, index_name)]
    return (f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{CSS}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n")
