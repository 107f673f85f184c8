"""notebooks/analysis.ipynb executes headless (nbclient + ipykernel) against a small run and a baseline."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.report_fixtures import make_run, projected, write_run

NOTEBOOK = Path(__file__).parents[2] / "notebooks" / "analysis.ipynb"


def _with_parameters(nb, **values):
    """Papermill-style: replace the cell tagged `parameters` with these values."""
    (cell,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    cell.source = "from pathlib import Path\n" + "".join(f"{k} = {v!r}\n" for k, v in values.items())
    return nb


@pytest.mark.parametrize("measurement", ["measured", "projected"])
def test_the_analysis_notebook_runs_on_a_small_run(tmp_path, measurement):
    as_run = projected if measurement == "projected" else (lambda frame: frame)
    run = write_run(as_run(make_run(seed=1, run_id="run-b")), tmp_path / "results" / "test-suite" / "run-b")
    baseline = write_run(as_run(make_run(seed=0)), tmp_path / "baselines") / "runs.parquet"
    rules = NOTEBOOK.parents[1] / "results" / "baselines" / "gate-rules.toml"
    nb = _with_parameters(nbformat.read(NOTEBOOK, as_version=4), RUN=str(run), BASELINE=str(baseline),
                          RULES=str(rules), RESULTS=str(tmp_path / "results"))
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()  # raises on any cell error

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    text = "\n".join(str(o.get("text", "")) + str(o.get("data", {}).get("text/markdown", "")) for o in outputs)
    assert "out of memory" in text  # the comparison table
    assert ("projected" in text) == (measurement == "projected")  # every projected number says so
    assert "gate PASS" in text      # the gate's verdict against the baseline
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 7
