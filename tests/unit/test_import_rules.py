"""The house's import rules, checked on the source (docs/DESIGN.md, "What may import what"): no module imports
another in a circle (any import: top-level, lazy inside a function, or under TYPE_CHECKING), and no import crosses a
room's rule. A circle means neither side can be read or tested alone; a crossed rule means a folder no longer tells a
reader what its modules may touch. The report room's own rules (no torch, no cp, no harness) are in
test_report_boundary.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PACKAGE = ROOT / "cpbench"

# room -> the rooms (module-name prefixes) it must not import. A module belongs to the longest room that prefixes it.
FORBIDDEN = {
    "cpbench.cp": ("cpbench.harness", "cpbench.report", "cpbench.cli"),
    "cpbench.cp.ring": ("cpbench.cp.apply", "cpbench.cp.plan", "cpbench.cp.loss", "cpbench.cp.ulysses",
                        "cpbench.cp.usp", "cpbench.cp.split", "cpbench.cp.forward"),
    "cpbench.cp.loss": ("cpbench.cp.ring", "cpbench.cp.apply", "cpbench.cp.plan", "cpbench.cp.ulysses",
                        "cpbench.cp.usp"),
    "cpbench.cp.fused": ("cpbench.cp.ring", "cpbench.cp.apply", "cpbench.cp.plan", "cpbench.cp.loss",
                         "cpbench.cp.ulysses", "cpbench.cp.usp", "cpbench.cp.split", "cpbench.cp.forward"),
    "cpbench.report": ("cpbench.cp", "cpbench.harness", "cpbench.cli"),
    "cpbench.report.runs": ("cpbench.report.tables", "cpbench.report.plots", "cpbench.report.page",
                            "cpbench.report.peers", "cpbench.report.compare", "cpbench.report.gate",
                            "cpbench.report.gate_rules", "cpbench.report.commands", "cpbench.report.derive"),
    "cpbench.harness": ("cpbench.cli",),
    "cpbench.harness.suite": ("cpbench.harness.run", "cpbench.harness.measure", "cpbench.harness.project",
                              "cpbench.harness.peers.adapters", "cpbench.harness.peers.attention_level"),
    "cpbench.harness.measure": ("cpbench.harness.run", "cpbench.harness.project", "cpbench.harness.peers"),
    "cpbench.harness.run": ("cpbench.harness.project",),
    "cpbench.harness.peers": ("cpbench.harness.run", "cpbench.harness.project"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(p): p for p in package.rglob("*.py")}


def _targets(name: str, path: Path, node: ast.AST, known: dict[str, Path]) -> list[str]:
    """The cpbench modules an import statement names (`from pkg import module` names the module)."""
    if isinstance(node, ast.Import):
        candidates = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = name if path.name == "__init__.py" else name.rpartition(".")[0]
            parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join(parts + ([base] if base else []))
        candidates = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    out = []
    for candidate in candidates:
        while candidate and candidate not in known:
            candidate = candidate.rpartition(".")[0]
        if candidate:
            out.append(candidate)
    return out


def import_graph(known: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the cpbench modules it imports anywhere in its source. A module's own ancestors are left out: a
    package's __init__ always runs before its modules, so importing it adds no order between them."""
    graph = {}
    for name, path in known.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= {t for t in _targets(name, path, node, known) if t != name and not name.startswith(t + ".")}
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def room_of(module: str) -> str | None:
    rooms = [room for room in FORBIDDEN if module == room or module.startswith(room + ".")]
    return max(rooms, key=len) if rooms else None


def violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for module, targets in graph.items():
        room = room_of(module)
        # A module obeys its own room's rule and every enclosing room's (cp.ring is inside cp).
        rules = [r for r in FORBIDDEN if room and (room == r or room.startswith(r + "."))]
        for target in sorted(targets):
            for rule in rules:
                if any(target == bad or target.startswith(bad + ".") for bad in FORBIDDEN[rule]):
                    out.append(f"{module} imports {target} ({rule} must not)")
    return sorted(out)


def test_no_module_imports_another_in_a_circle():
    found = cycles(import_graph(modules()))
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_import_crosses_a_rooms_rule():
    bad = violations(import_graph(modules()))
    assert not bad, "\n".join(bad)


def test_no_package_folder_holds_more_than_fifteen_modules():
    for folder in [PACKAGE, *(p for p in PACKAGE.rglob("*") if p.is_dir() and (p / "__init__.py").exists())]:
        count = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
        assert count <= 15, f"{folder.relative_to(ROOT)} holds {count} modules: give its concepts sub-packages"


def test_every_room_says_what_it_owns():
    for init in PACKAGE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 80, f"{init.relative_to(ROOT)} has no docstring saying what the room owns"


# -- the checks themselves catch what they are for, on small made-up trees ----------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return {module_name_in(tmp_path, p): p for p in (tmp_path / "cpbench").rglob("*.py")}


def module_name_in(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.parametrize("lazy", [False, True])
def test_a_circle_is_found_even_through_a_lazy_import(tmp_path, lazy):
    body = "def f():\n    from . import b\n" if lazy else "from . import b\n"
    known = _tree(tmp_path, {"cpbench/__init__.py": "", "cpbench/cp/__init__.py": "", "cpbench/cp/a.py": body,
                             "cpbench/cp/b.py": "from cpbench.cp.a import f\n",
                             "cpbench/cp/c.py": "from .a import f\n"})
    assert cycles(import_graph(known)) == [["cpbench.cp.a", "cpbench.cp.b"]]


def test_a_crossed_rule_is_found(tmp_path):
    known = _tree(tmp_path, {"cpbench/__init__.py": "", "cpbench/cp/__init__.py": "",
                             "cpbench/cp/ring/__init__.py": "",
                             "cpbench/cp/ring/x.py": "from cpbench.cp import apply\n",
                             "cpbench/cp/apply.py": "", "cpbench/harness/__init__.py": "",
                             "cpbench/harness/measure/__init__.py": "",
                             "cpbench/harness/measure/step.py": "from ..run import worker\n",
                             "cpbench/harness/run/__init__.py": "", "cpbench/harness/run/worker.py": ""})
    assert violations(import_graph(known)) == [
        "cpbench.cp.ring.x imports cpbench.cp.apply (cpbench.cp.ring must not)",
        "cpbench.harness.measure.step imports cpbench.harness.run.worker (cpbench.harness.measure must not)",
    ]
