"""cpbench/report reads Parquet on a laptop: it never imports the CP core, the harness, the CLI or
torch.distributed (docs/DESIGN.md, "What may import what"). Checked on the source, so a stray import fails here first."""

import ast
from pathlib import Path

REPORT = Path(__file__).parents[2] / "cpbench" / "report"
FORBIDDEN = ("cpbench.cp", "cpbench.harness", "cpbench.cli", "torch", "transformers")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:  # relative ones: see the next test
            names.add(node.module or "")
    return names


def test_report_imports_neither_cp_harness_cli_nor_torch():
    for path in REPORT.rglob("*.py"):
        bad = [n for n in _imports(path) if n == "cpbench" or n.startswith(FORBIDDEN)]
        assert not bad, f"{path.name} imports {bad}; report must work with only pandas/pyarrow/matplotlib"


def test_relative_imports_stay_inside_report():
    for path in REPORT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                depth = len(path.relative_to(REPORT).parts)  # 1 for report/x.py, 2 for report/runs/x.py
                assert node.level <= depth, f"{path.name}: `from {'.' * node.level}{node.module} import ...` leaves report"
