"""`cpbench sweep` and `cpbench run`: argument parsing only; the work is in sweep.py and worker.py."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def register(subparsers) -> None:
    sweep = subparsers.add_parser(
        "sweep", help="run a suite of points into results/<suite>/<run>/runs.parquet",
        description="Run a suite of points into results/<suite>/<run>/runs.parquet. " + EXIT_CODES)
    sweep.add_argument("suite", nargs="?", default=None, help="suite file (default: the embedded CPU suite)")
    _common(sweep)
    sweep.set_defaults(func=sweep_command)

    run = subparsers.add_parser(
        "run", help="run one point (under an external torchrun, or launched here)",
        description="Run the given points of a suite (under an external torchrun, or launched here). " + EXIT_CODES)
    run.add_argument("suite", help="suite file, or 'default'")
    run.add_argument("--point", required=True, action="append", dest="points", help="point id (repeatable)")
    _common(run)
    run.set_defaults(func=run_command)


EXIT_CODES = ("Exit status: 1 when a point of the run is `error` or `timeout`, or a point's parity is `fail`; "
              "0 otherwise (`oom` and `skipped` points are results, not failures); 2 for a bad suite or arguments.")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("results"), help="results folder (default: results)")
    p.add_argument("--run-name", dest="run", default=None,
                   help="run folder name (default: a UTC timestamp; with --resume the latest). An existing run "
                        "is only continued with --resume")
    p.add_argument("--resume", action="store_true",
                   help="finish a run: --run-name's, or else the suite's most recently written one")
    p.add_argument("--memory-budget", default=None, help="e.g. 80GiB: a point whose peak passes it is `oom`")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--allow-faults", action="store_true",
                   help="honour a suite's [faults] table (for cpbench's own tests: injected crashes and hangs)")


def _options(args, only=()):
    from .sweep import SweepOptions

    return SweepOptions(suite=args.suite, out=args.out, run=args.run, resume=getattr(args, "resume", False),
                        memory_budget=args.memory_budget, allow_faults=args.allow_faults, only=tuple(only),
                        progress=not args.no_progress)


def sweep_command(args) -> int:
    from cpbench.report import store

    from .summary import summary_table
    from .sweep import failures, run_sweep

    t0 = time.perf_counter()
    try:
        run_dir = run_sweep(_options(args))
    except ValueError as e:
        print(f"cpbench sweep: {e}", file=sys.stderr)
        return 2
    df = store.read_run(run_dir)
    print(summary_table(df))
    print(f"\n{len(df)} points in {store.runs_path(run_dir)} ({time.perf_counter() - t0:.0f}s)")
    return _exit_code(failures(df), "sweep")


def _exit_code(failed: list[str], command: str) -> int:
    if not failed:
        return 0
    print(f"cpbench {command}: {len(failed)} failure(s): " + "; ".join(failed[:10]), file=sys.stderr)
    return 1


def run_command(args) -> int:
    from . import worker

    if worker.launched_by_torchrun() is None:
        return sweep_command_for(args)
    from .external import run_external

    return run_external(args)


def sweep_command_for(args) -> int:
    from cpbench.report import store

    from .summary import summary_table
    from .sweep import failures, run_sweep

    try:
        run_dir = run_sweep(_options(args, only=args.points))
    except ValueError as e:
        print(f"cpbench run: {e}", file=sys.stderr)
        return 2
    df = store.read_run(run_dir)
    mine = df[df["point_id"].isin(args.points)]
    print(summary_table(mine))
    return _exit_code(failures(mine), "run")
