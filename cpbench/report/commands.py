"""`python -m cpbench report | compare | gate`: parse, call one function, return the exit code.

Exit codes: 0 fine, 1 the gate found a regression, 2 the inputs cannot be used (missing file, bad rules,
different hardware or schema without the flag to allow it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from .units import parse_bytes

REFUSED = 2


def register(subparsers) -> None:
    report = subparsers.add_parser("report", help="tables, plots and a report page for a run")
    report.add_argument("run", help="a run directory (results/<suite>/<run>) or a .parquet file")
    report.add_argument("--out", help="where to write (default: the run directory; for a file, <name>_report/)")
    report.add_argument("--device-memory", type=_size, help="draw this capacity on the memory plot, e.g. 80GiB")
    report.add_argument("--projected", default=None, metavar="RUN",
                        help="a projection of the same points (cpbench estimate --gpu): the report shows each point's "
                             "measured and projected step and peak, and the projection's error")
    report.set_defaults(func=run_report)

    compare = subparsers.add_parser("compare", help="two runs side by side, with the change per metric")
    compare.add_argument("run_a", help="the first run: a run directory (results/<suite>/<run>) or a .parquet file")
    compare.add_argument("run_b", help="the second run, compared with the first (change = b against a)")
    compare.add_argument("--out", help="also write the comparison (Markdown) to this file")
    compare.set_defaults(func=run_compare)

    gate = subparsers.add_parser("gate", help="fail (exit 1) when a run regresses against a baseline")
    gate.add_argument("run", help="the run to check: a run directory (results/<suite>/<run>) or a .parquet file")
    gate.add_argument("--baseline", required=True, help="baseline Parquet, e.g. results/baselines/smoke.parquet")
    gate.add_argument("--rules", help="rules TOML (default: gate-rules.toml beside the baseline, else the rules "
                                      "shipped with cpbench)")
    gate.add_argument("--allow-hardware-mismatch", action="store_true", help="compare runs of different hardware_id")
    gate.add_argument("--allow-schema-mismatch", action="store_true", help="compare runs of different schema versions")
    gate.add_argument("--allow-measurement-mismatch", action="store_true",
                      help="compare a projected run with a measured one (or the other way)")
    gate.add_argument("--allow-suite-mismatch", action="store_true",
                      help="gate a run against a baseline of another suite (only the points both hold are compared; "
                           "the baseline's others are reported missing)")
    gate.add_argument("--update-baseline", action="store_true",
                      help="write RUN as the new baseline (after showing its gate result against the old one)")
    gate.set_defaults(func=run_gate)


def _size(text: str) -> int:
    try:
        return parse_bytes(text, field_name="--device-memory")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _say_notes(command: str, *frames) -> None:
    """What load_run could not read or recovered (a damaged table read from its journal), on stderr."""
    for frame in frames:
        for note in frame.attrs.get("notes", []):
            print(f"cpbench {command}: {note}", file=sys.stderr)


def _fail(message: str) -> int:
    print(f"cpbench: {message}", file=sys.stderr)
    return REFUSED


def run_report(args: argparse.Namespace) -> int:
    from .runs.load import load_run, parquet_path
    from .page import write_report
    from .tables import comparison_markdown

    try:
        frame = load_run(args.run)
        projected = load_run(args.projected) if args.projected else None
    except (FileNotFoundError, ValueError) as e:
        return _fail(str(e))
    source = Path(args.run)
    out = Path(args.out) if args.out else source if source.is_dir() else source.with_name(f"{source.stem}_report")
    _say_notes("report", frame)
    files = write_report(frame, out, capacity=args.device_memory, projected=projected)
    print(comparison_markdown(frame))
    print(f"\nreport: {files.html}\n        {files.markdown}\nplots:  {', '.join(str(p) for p in files.plots.values())}")
    for name, why in files.omitted.items():
        print(f"        not drawn: {name} ({why})")
    print(f"data:   {parquet_path(args.run)}")
    return 0


def run_compare(args: argparse.Namespace) -> int:
    from .compare import compare, render
    from .runs.load import load_run, run_label

    try:
        a, b = load_run(args.run_a), load_run(args.run_b)
        text = render(compare(a, b), run_label(a), run_label(b))
    except (FileNotFoundError, ValueError) as e:
        return _fail(str(e))
    _say_notes("compare", a, b)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


def run_gate(args: argparse.Namespace) -> int:
    from .gate import GateRefusal, check_comparable, gate, render, rules_across_hardware
    from .gate_rules import load_rules, rules_path
    from .runs.load import load_run, parquet_path, run_label

    baseline_path = Path(args.baseline)
    allow_schema = args.allow_schema_mismatch
    try:
        run = load_run(args.run, allow_schema_mismatch=allow_schema)
        if not baseline_path.exists():
            if args.update_baseline:
                return _write_baseline(parquet_path(args.run), baseline_path, "created")
            return _fail(f"baseline: no file at '{baseline_path}'; create it from a checked run with "
                         f"`python -m cpbench gate --baseline {baseline_path} RUN --update-baseline`")
        baseline = load_run(baseline_path, allow_schema_mismatch=allow_schema, what="baseline")
        _say_notes("gate", baseline, run)
        rules_file = rules_path(args.rules, baseline_path)
        rules = load_rules(rules_file)
        print(f"rules: {rules_file}")
        same_hardware = check_comparable(baseline, run, allow_hardware_mismatch=args.allow_hardware_mismatch,
                                         allow_schema_mismatch=allow_schema,
                                         allow_measurement_mismatch=args.allow_measurement_mismatch,
                                         allow_suite_mismatch=args.allow_suite_mismatch)
        if not same_hardware:
            cuda = bool((run["device"] == "cuda").any() or (baseline["device"] == "cuda").any())
            gated, listed = ("status and parity", "time and memory") if cuda else ("status, parity and memory", "time")
            print(f"note: baseline and run ran on different hardware (--allow-hardware-mismatch): {gated} are gated; "
                  f"{listed} only listed as warnings")
            rules = rules_across_hardware(rules, cuda)
        result = gate(baseline, run, rules)
    except FileNotFoundError as e:
        return _fail(str(e))
    except (ValueError, GateRefusal) as e:
        return _fail(f"gate refused: {e}")
    print(render(result, str(baseline_path), run_label(run)))
    if args.update_baseline:
        return _write_baseline(parquet_path(args.run), baseline_path, "replaced")
    return result.exit_code


def _write_baseline(source: Path, baseline: Path, verb: str) -> int:
    """Copy the run's Parquet byte for byte (atomically: a reader never sees half a file)."""
    baseline.parent.mkdir(parents=True, exist_ok=True)
    partial = baseline.with_name(f".{baseline.name}.partial")
    shutil.copyfile(source, partial)
    os.replace(partial, baseline)
    print(f"baseline {verb}: {baseline} (from {source}); commit it to make it the gate's reference")
    return 0
