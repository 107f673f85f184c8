"""Every command the README and the guide (docs/*.md) show still works: cpbench commands parse with cpbench's own
command line and the suite files they name load and validate; `make` targets exist (a dry run); scripts exist and
parse; paths exist. Running each command for real belongs to the tests of what it runs (the default sweep, estimate,
report, compare, gate and the cluster launcher each have an e2e test); a command here that stops parsing, names a
moved file or a field a suite no longer has fails here first."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Placeholders the pages use, and what stands in for them (an existing suite, a run folder name).
PLACEHOLDERS = {"SUITE": "suites/default-cpu.toml", "ID": "p0", "RUN_A": "results/a", "RUN_B": "results/b",
                "RUN": "results/run", "DIR": "results", "NAME": "name", "FILE": "suites/default-cpu.toml",
                "my-h100": "h100-sxm"}  # the last: the profile file docs/time.md's calibrate line writes


def shell_lines(page: Path) -> list[str]:
    """The lines of the page's fenced blocks that are not Python, continuation lines joined."""
    lines, block, lang = [], None, ""
    for line in page.read_text().splitlines():
        fence = re.match(r"^\s*```(\w*)", line)
        if fence:
            block, lang = (None, "") if block is not None else ([], fence.group(1))
            continue
        if block is None or lang in ("python", "toml", "text"):
            continue
        if lines and lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1] + " " + line.strip()
        else:
            lines.append(line.strip())
    return [line.removeprefix("$ ") for line in lines if line]


def commands() -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        for line in shell_lines(page):
            if re.match(r"(\.venv/bin/)?(python -m cpbench|cpbench(?= )|make|bash|torchrun|pytest|python -m pytest)\b",
                        line):
                out.append((page.name, line))
    return out


def _argv(line: str) -> list[str]:
    line = re.sub(r"\[(--[^\]]+)\]", r"\1", line)  # optional flags shown as [--flag value]: check them too
    line = re.sub(r"<[^>]+>", "x", line)
    words = shlex.split(line, comments=True)
    return [PLACEHOLDERS.get(w, w) for w in words]


def _cpbench_args(argv: list[str]) -> list[str]:
    if "cpbench" in argv and argv[argv.index("cpbench") - 1] == "-m":
        return argv[argv.index("cpbench") + 1 :]
    return argv[1:]  # the `cpbench` script


def test_the_pages_show_commands():
    found = commands()
    assert any(line.startswith("make test") for _, line in found) and any("cpbench estimate" in l for _, l in found)


@pytest.mark.parametrize("page,line", commands(), ids=lambda v: v if len(v) < 60 else v[:60])
def test_a_documented_command_still_works(page, line):
    argv = _argv(line)
    if argv[0] == "make":
        targets = [w for w in argv[1:] if "=" not in w]
        dry = subprocess.run(["make", "-n", *targets], cwd=ROOT, capture_output=True, text=True)
        assert dry.returncode == 0, f"{page}: `{line}`: {dry.stderr}"
        return
    if argv[0] == "bash":
        script = ROOT / argv[1]
        assert script.exists(), f"{page}: `{line}`: {argv[1]} does not exist"
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
        return
    if argv[0] in ("pytest", "python") and "cpbench" not in argv:
        paths = [w for w in argv[1:] if not w.startswith("-") and w not in ("-m", "pytest")]
        assert all((ROOT / p).exists() for p in paths), f"{page}: `{line}`: a path does not exist"
        return
    from cpbench.cli import build_parser
    from cpbench.harness.suite.spec import load_suite

    args = _cpbench_args(argv if argv[0] != "torchrun" else [w for w in argv if w != "..."])
    try:
        parsed = build_parser().parse_args(args)
    except SystemExit as e:
        pytest.fail(f"{page}: `{line}` does not parse (exit {e.code})")
    if args[0] in ("estimate", "plan"):  # every flag shown applies: none is refused before the projection starts
        _check_options(page, line, parsed)
    for word in args:
        if word.endswith(".toml"):
            assert (ROOT / word).exists(), f"{page}: `{line}`: {word} does not exist"
            load_suite(str(ROOT / word))  # its fields are still the suite's fields, and its values pass the checks


def _check_options(page: str, line: str, parsed) -> None:
    import os

    from cpbench.harness.estimate_cli import estimate_options
    from cpbench.harness.project.commands import plan_options
    from cpbench.harness.project.estimate import preflight

    here = os.getcwd()
    os.chdir(ROOT)  # the pages' paths are the repository's
    try:
        if parsed.command == "estimate":
            preflight(estimate_options(parsed))
        else:
            plan_options(parsed)
    except ValueError as e:
        pytest.fail(f"{page}: `{line}` is refused: {e}")
    finally:
        os.chdir(here)


def test_the_suite_guide_names_every_preset():
    from cpbench.harness.suite.presets import PRESETS

    text = (ROOT / "docs" / "sweeps.md").read_text()
    comment = text.split('model = "tiny-qwen3"', 1)[1].split("model_overrides", 1)[0]
    assert set(re.findall(r"[a-z][\w.-]*\d[\w.-]*|tiny-\w+", comment)) >= set(PRESETS), sorted(PRESETS)


def _regen():
    import importlib.util

    spec = importlib.util.spec_from_file_location("regen", ROOT / "docs" / "regen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reports_guides_table_is_what_report_prints_of_the_committed_baseline(capsys):
    assert _regen().main(["--check", "--only", "reports-table"]) == 0, capsys.readouterr().err


def test_a_regenerated_block_fails_the_check_where_a_figure_moved():
    regen = _regen()
    block = "| 16384 | 62.0 GiB, 496 ms projected |\nProjected in 61 s on a 2-core machine, no GPU:"
    assert regen.differences(block, block.replace("61 s", "75 s")) == []  # a duration is this machine's
    assert regen.differences(block, block.replace("496 ms", "499 ms")) == []  # within 1 %
    assert regen.differences(block, block.replace("496 ms", "527 ms")) == ["496 ms committed, 527 ms now"]
    assert regen.differences(block, block.replace("62.0 GiB", "62.1 GiB")) != []  # memory is exact


@pytest.mark.heavy
def test_the_reference_projection_in_the_readme_is_what_the_code_projects_now():
    """Reruns the README's reference projection (docs/regen.py; about a minute). Opt-in: `-m heavy`."""
    proc = subprocess.run([sys.executable, str(ROOT / "docs" / "regen.py"), "--check", "--only", "reference-projection"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
