"""`cpbench sweep` and `cpbench run`: argument parsing only; the work is in sweep.py and worker.py."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def register(subparsers) -> None:
    sweep = subparsers.add_parser("sweep", help="run a suite of points into results/<suite>/<run>/runs.parquet")
    sweep.add_argument("suite", nargs="?", default=None, help="suite file (default: the embedded CPU suite)")
    _common(sweep)
    sweep.add_argument("--resume", action="store_true", help="finish the latest run of the suite")
    sweep.set_defaults(func=sweep_command)

    run = subparsers.add_parser("run", help="run one point (under an external torchrun, or launched here)")
    run.add_argument("suite", help="suite file, or 'default'")
    run.add_argument("--point", required=True, action="append", dest="points", help="point id (repeatable)")
    _common(run)
    run.set_defaults(func=run_command)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("results"), help="results folder (default: results)")
    p.add_argument("--run-name", dest="run", default=None,
                   help="run folder name (default: a UTC timestamp; with --resume the latest)")
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
    from .sweep import run_sweep

    t0 = time.perf_counter()
    try:
        run_dir = run_sweep(_options(args))
    except ValueError as e:
        print(f"cpbench sweep: {e}", file=sys.stderr)
        return 2
    df = store.read_run(run_dir)
    print(summary_table(df))
    print(f"\n{len(df)} points in {store.runs_path(run_dir)} ({time.perf_counter() - t0:.0f}s)")
    return 0 if (df["status"] != "error").all() else 1


def run_command(args) -> int:
    from . import worker

    if worker.launched_by_torchrun() is None:
        return sweep_command_for(args)
    from .external import run_external

    return run_external(args)


def sweep_command_for(args) -> int:
    from cpbench.report import store

    from .summary import summary_table
    from .sweep import run_sweep

    try:
        run_dir = run_sweep(_options(args, only=args.points))
    except ValueError as e:
        print(f"cpbench run: {e}", file=sys.stderr)
        return 2
    df = store.read_run(run_dir)
    print(summary_table(df[df["point_id"].isin(args.points)]))
    return 0
