"""Everything that reads a run, held on runs drawn as the sweep and the projection write them
(`cpbench.report.runs.examples`: any mix of statuses, measured and projected, one or many values in each varying
column, empty columns where a status leaves them, schema versions 7 and 8, one point or a hundred): `report` (tables,
every figure, the page), `compare`, `gate` and the analysis notebook never raise; every figure with something to show
is written, and every other one is listed with why.

The default test command runs a few examples each (the `quick` profile, tests/conftest.py); CI runs the `ci` profile
(`--hypothesis-profile ci`, many more).
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpbench.cli import main
from cpbench.report import derive, page, plots
from cpbench.report.runs import examples, store
from cpbench.report.runs.load import load_run
from cpbench.report.runs.schema import ADDED_SINCE, KEY_COLUMNS, SCHEMA_VERSION

VERSIONS = sorted(ADDED_SINCE) + [SCHEMA_VERSION]  # every version a file can be read at: older ones only add

ROOT = Path(__file__).parents[2]
NOTEBOOK = ROOT / "notebooks" / "analysis.ipynb"
RULES = ROOT / "results" / "baselines" / "gate-rules.toml"
# Runs of up to a hundred and twenty points under the long profile (CI); up to 25 in the default test command, whose
# few examples stay within seconds (a drawn run renders six figures).
MAX_POINTS = 120 if settings().max_examples > 20 else 25
# A figure whose labels or legend leave its axes no room is drawn without its layout (cpbench/report/axes.py sizes
# every figure for them): matplotlib only warns, so any drawn run that collapses a figure fails here.
pytestmark = pytest.mark.filterwarnings(
    "error:constrained_layout not applied because axes sizes collapsed to zero:UserWarning")


def _write(rows: list[dict], run_dir: Path, version: int) -> Path:
    table = store.to_table(rows)
    if version != SCHEMA_VERSION:
        run_dir.mkdir(parents=True, exist_ok=True)
        pq.write_table(examples.older_table(table, version), run_dir / store.RUNS_FILE)
    else:
        store.append_rows(run_dir, rows)  # as the harness writes: journal, then the table
    return run_dir


def expected_figures(frame: pd.DataFrame) -> set[str]:
    """Which figures have something to show, from the rows alone (not from the figures' own code)."""
    ok = frame[frame["status"] == "ok"]
    timed = ok["step_time_median_s"].notna() | ((ok["measurement"] == "projected") & ok["projected_step_s"].notna())
    match = [c for c in KEY_COLUMNS if c not in ("cp_size", "cp_style", "implementation")]
    cp1 = {tuple(r) for r in ok[ok["cp_size"] == 1][match].astype(str).itertuples(index=False)}
    scaled = any(tuple(r) in cp1 for r in ok[ok["cp_size"] > 1][match].astype(str).itertuples(index=False))
    shown = {"memory": len(ok) > 0 or frame["status"].isin(["oom", "error", "timeout"]).any(),
             "time": bool(timed.any()), "scaling": scaled, "memory_breakdown": len(ok) > 0,
             "parity": frame["parity_status"].isin(["pass", "fail"]).any(), "largest_fit": _limited(frame, ok),
             "balance": bool(((ok["cp_size"] > 1) & (ok["batch_kind"] != "plain")
                              & ok["attention_pairs_per_rank"].map(_listed)).any())}
    # Every figure the report knows is judged here (a new one must say when it has something to show); the peers
    # figure belongs to peer runs only (tests/e2e/test_peers.py).
    assert set(shown) == set(page.FIGURES) == set(page.FIGURE_TITLES) - {"peers"}
    return {name for name, yes in shown.items() if yes}


def _limited(frame: pd.DataFrame, ok: pd.DataFrame) -> bool:
    """A largest fit to show: some point ran ok, and a point failed or the configurations' longest ok lengths
    differ (else every configuration ran every length and the figure would say nothing)."""
    from cpbench.report.derive import with_config

    longest = with_config(frame).loc[ok.index].groupby("config")["seq_len"].max()
    return len(ok) > 0 and (frame["status"].isin(["oom", "error", "timeout"]).any() or longest.nunique() > 1)


def _listed(value) -> bool:
    """A per-rank list with something in it (not None, NaN or empty)."""
    return value is not None and not isinstance(value, (float, str)) and len(value) > 0


def _versioned(max_points: int = MAX_POINTS):
    """(version, rows): a run as a writer of any readable schema version (7 to today's) wrote it."""
    return st.sampled_from(VERSIONS).flatmap(
        lambda v: examples.runs(max_points=max_points, schema_version=v).map(lambda rows: (v, rows)))


@given(case=_versioned())
def test_the_report_of_any_run_has_every_figure_with_data_and_says_why_of_the_others(case):
    version, rows = case
    with tempfile.TemporaryDirectory() as tmp:
        run = _write(rows, Path(tmp) / "results" / "s" / "r", version)
        frame = load_run(run)
        files = page.write_report(frame, Path(tmp) / "report")
        assert set(files.plots) - {"peers"} == expected_figures(frame)
        assert set(files.omitted) == set(page.FIGURES) - set(files.plots)
        assert all(why.strip() for why in files.omitted.values())
        text = files.markdown.read_text()
        for name in files.omitted:
            assert page.FIGURE_TITLES[name] in text and files.omitted[name].split(";")[0] in text
        for path in files.plots.values():
            assert path.read_bytes().startswith(b"\x89PNG")


@given(rows=examples.runs(max_points=MAX_POINTS))
def test_a_figure_draws_the_labels_it_coloured(rows):
    frame = store.to_table(rows).to_pandas()
    colors = plots.config_colors(frame)
    assert set(derive.with_config(frame)["config"]) == set(colors)
    for name, draw in page.FIGURES.items():
        fig = draw(frame)
        labels = {h.get_label() for ax in fig.axes for h in ax.get_legend_handles_labels()[0]}
        drawn = {label for label in labels if label in colors}  # a configuration's own line or bars
        assert drawn <= set(colors), name


def _cli(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(list(argv))
    return rc, err.getvalue()


@st.composite
def pairs(draw, max_points: int = MAX_POINTS):
    """A baseline and a run: the same points changed (statuses, metrics, points gone or new), or another run."""
    base = draw(examples.runs(max_points=max_points))
    if draw(st.booleans()):
        return base, draw(examples.runs(max_points=max_points))
    other = draw(examples.runs(max_points=max_points))
    keep = draw(st.lists(st.booleans(), min_size=len(base), max_size=len(base)))
    changed = [dict(row, **{k: other[i % len(other)][k] for k in ("status", "peak_bytes", "step_times_s",
                                                                  "parity_status", "loss_rel_err")})
               for i, (row, kept) in enumerate(zip(base, keep)) if kept]
    taken = {tuple(str(r[k]) for k in KEY_COLUMNS) for r in changed} | {r["point_id"] for r in changed}
    new = [r for r in other[: draw(st.integers(0, 3))]  # points the baseline lacks: a run holds each point once
           if tuple(str(r[k]) for k in KEY_COLUMNS) not in taken and r["point_id"] not in taken]
    return base, changed + new


@given(pair=pairs(), flags=st.lists(st.sampled_from(["--allow-hardware-mismatch", "--allow-measurement-mismatch",
                                                      "--allow-suite-mismatch", "--allow-schema-mismatch"]),
                                    unique=True), version=st.sampled_from(VERSIONS))
def test_compare_and_gate_never_raise_and_refuse_with_a_reason(pair, flags, version):
    with tempfile.TemporaryDirectory() as tmp:
        base = _write(pair[0], Path(tmp) / "base" / "s" / "r", version)
        run = _write(pair[1], Path(tmp) / "run" / "s" / "r", SCHEMA_VERSION)
        rc, err = _cli("compare", str(base), str(run))
        assert rc == 0 or (rc == 2 and err.startswith("cpbench:")), err
        rc, err = _cli("gate", str(run), "--baseline", str(base / "runs.parquet"), "--rules", str(RULES), *flags)
        assert rc in (0, 1) or (rc == 2 and err.startswith("cpbench:")), err


def _notebook_cells() -> list[str]:
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    return [c for c in code if not c.startswith("from pathlib import Path\n\nRUN = ")]  # the parameters cell


@given(pair=pairs())
def test_the_analysis_notebook_runs_on_any_run(pair):
    """Its code cells, as nbclient runs them (tests/e2e/test_notebook.py), in this process with display stubbed."""
    import IPython.display

    with tempfile.TemporaryDirectory() as tmp:
        run = _write(pair[1], Path(tmp) / "results" / "s" / "r", SCHEMA_VERSION)
        base = _write(pair[0], Path(tmp) / "base", SCHEMA_VERSION)
        namespace = {"RUN": str(run), "BASELINE": str(base / "runs.parquet"), "RULES": str(RULES),
                     "RESULTS": Path(tmp) / "results", "Path": Path}
        shown = []
        real = IPython.display.display
        IPython.display.display = lambda *objs, **_: shown.extend(objs)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                for cell in _notebook_cells():
                    exec(compile(cell, "analysis.ipynb", "exec"), namespace)  # noqa: S102 - our own notebook
        finally:
            IPython.display.display = real
        assert shown  # the table and figures reached the display


def _filled(row: dict) -> set[str]:
    return {k for k, v in row.items() if v is not None and not (isinstance(v, float) and v != v)}


def test_the_examples_fill_what_the_writers_fill():
    """The generator is held to the writers: an outcome row (error, timeout, skipped) fills exactly the columns
    `rows.outcome_row` fills, and a finished row can fill every column the committed measured and projected runs
    fill."""
    import numpy as np

    from cpbench.harness.measure.env import fingerprint
    from cpbench.harness.run import rows as writer
    from cpbench.harness.suite.spec import load_suite

    (point,) = load_suite("x", text='name = "x"\nmodel = "tiny-qwen3"\nseq_lens = [64]\ncp_sizes = [2]\n'
                                     'cp_styles = ["cp_ring"]\n').points()
    ctx = {"run_id": "r", "env": fingerprint("cpu"), "budget": None}
    rng, spec = np.random.default_rng(0), {c: getattr(point, c, None) for c in KEY_COLUMNS}
    env = {"suite": "x", "run_id": "r"}
    options = {"memory_budget_bytes", "host_memory_budget_bytes"}  # filled where the sweep was given a capacity
    for status in ("error", "timeout", "skipped"):
        real = _filled(writer.outcome_row(point, status, "why", 1.0, **ctx)) - options
        drawn = _filled(examples.row(rng, 0, spec, status, "measured", env, False)) - options
        assert drawn == real, (status, sorted(drawn ^ real))
    for path, kind in ((ROOT / "results" / "baselines" / "smoke.parquet", "measured"),
                       (ROOT / "results" / "published" / "runs" / "estimate-qwen3-8b" / "trl-qwen3-8b-1m", "projected")):
        real = set().union(*(_filled(r) for r in store.read_run(path).to_dict("records")))
        drawn = set().union(*(_filled(examples.row(rng, i, spec, "ok", kind, env, True)) for i in range(200)))
        assert real <= drawn, (kind, sorted(real - drawn))
