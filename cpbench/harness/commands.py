"""`cpbench sweep` and `cpbench run`: argument parsing only; the work is in run/sweep.py and run/worker.py. The flags
and helpers they share with `cpbench estimate` (estimate_cli.py) live here."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from cpbench.harness.run.cluster import LAUNCHERS


def register(subparsers) -> None:
    sweep = subparsers.add_parser(
        "sweep", help="run a suite of points into results/<suite>/<run>/runs.parquet",
        description="Run a suite of points into results/<suite>/<run>/runs.parquet. " + EXIT_CODES)
    sweep.add_argument("suite", nargs="?", default=None,
                       help="suite file, or 'default' (the embedded CPU suite, also what no argument runs)")
    _common(sweep)
    cluster = sweep.add_argument_group("on a cluster (submitit: pip install 'cpbench[slurm]')")
    cluster.add_argument("--launcher", default="local", choices=LAUNCHERS,
                         help="local: torch's launcher here (default); slurm: one SLURM job per world size, torch's "
                              "launcher on every node; submitit-local: the same job on this machine, each node a "
                              "local process")
    cluster.add_argument("--nodes", type=int, default=None, help="nodes a job may use (default 1)")
    cluster.add_argument("--gpus-per-node", type=int, default=None, help="ranks per node (default 8)")
    cluster.add_argument("--partition", default=None, help="SLURM partition")
    cluster.add_argument("--account", default=None, help="SLURM account")
    sweep.set_defaults(func=sweep_command)

    run = subparsers.add_parser(
        "run", help="run one point (under an external torchrun, or launched here)",
        description="Run the given points of a suite (under an external torchrun, or launched here). " + EXIT_CODES)
    run.add_argument("suite", help="suite file, or 'default'")
    run.add_argument("--point", required=True, action="append", dest="points", help="point id (repeatable)")
    _common(run)
    run.set_defaults(func=run_command)


CP_PLAN_HELP = ("the CP plan in place of the suite's: a JSON object of module pattern -> style, or a style name for the "
                "default plan's shape under the model's prefix (every `layers.*` cut, every `layers.*.self_attn` "
                "exchanging); for a family without a default plan (docs/families.md)")
DOCUMENTS_HELP = ("packed documents in place of the suite's: a shipped mix (meta-128k, prolong-64k, llama3-sft, longalign, "
                  "pile), or lengths summing to the sequence length, e.g. 50000,30000,51072 (pad:N for N padded "
                  "tokens; rows separated by ';')")
BALANCE_HELP = ("the zigzag ring's placement (cp_ring_zigzag, cp_usp), in place of the suite's `balance`: documents (the "
                "default: every rank the same attention work of the batch's documents) or sequence (the plain zigzag)")
COMPILE_HELP = ("torch.compile each decoder layer, in place of the suite's `compile`: alone (torch's default mode), off, or "
                "a mode (max-autotune-no-cudagraphs, ...); rows record graph_breaks, recompiles and compile_s. A "
                "projection prices the eager step (its row's projected_pricing says so)")


def add_optimizer_flags(parser: argparse.ArgumentParser, scope: str) -> None:
    """--optimizer and --max-grad-norm, for `scope` ("the step", "every configuration searched")."""
    parser.add_argument("--optimizer", default="foreach", choices=("foreach", "fused"),
                        help=f"torch's AdamW in {scope}: foreach (torch's default) | fused (AdamW(fused=True): one "
                             "kernel over every parameter, no temporaries)")
    parser.add_argument("--max-grad-norm", type=_grad_norm, default=0.0, metavar="NORM",
                        help=f"{scope} clips the gradients to this global norm before each optimizer step, as "
                             "transformers' Trainer and torchtitan do by default at 1.0 (default 0: none)")


def _grad_norm(text: str) -> float:
    """A --max-grad-norm: a finite number >= 0 (argparse names the flag beside the message)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number >= 0, e.g. 1.0 (0: no clipping)")
    return value


EXIT_CODES = ("Exit status: 1 when a point of the run is `error` or `timeout`, or a point's parity is `fail`; "
              "0 otherwise (`oom` and `skipped` points are results, not failures); 2 for a bad suite or arguments.")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("results"), help="results folder (default: results)")
    p.add_argument("--run-name", dest="run", default=None,
                   help="run folder name (default: a UTC timestamp; with --resume the latest). An existing run "
                        "is only continued with --resume")
    p.add_argument("--resume", action="store_true",
                   help="finish a run: --run-name's, or else the suite's most recently written one")
    p.add_argument("--wait", action="store_true",
                   help="another process is writing the run: wait for it to finish, then go on (default: refuse, "
                        "naming that process)")
    p.add_argument("--cp-plan", default=None, metavar="JSON|STYLE", help=CP_PLAN_HELP)
    p.add_argument("--documents", default=None, metavar="MIX|LENGTHS", help=DOCUMENTS_HELP)
    p.add_argument("--compile", nargs="?", const="on", default=None, metavar="MODE", help=COMPILE_HELP)
    p.add_argument("--balance", choices=("documents", "sequence"), default=None, help=BALANCE_HELP)
    p.add_argument("--memory-budget", default=None, help="e.g. 80GiB: a point whose peak passes it is `oom`")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--allow-faults", action="store_true",
                   help="honour a suite's [faults] table (for cpbench's own tests: injected crashes and hangs)")


def _options(args, only=()):
    from cpbench.harness.run.sweep import SweepOptions

    return SweepOptions(suite=_suite_with_flags(args), out=args.out, run=args.run, resume=getattr(args, "resume", False),
                        memory_budget=args.memory_budget, allow_faults=args.allow_faults, only=tuple(only),
                        progress=not args.no_progress, cluster=_cluster(args), wait=args.wait, cp_plan=args.cp_plan)


def _suite_with_flags(args):
    """The suite, or with `--documents` / `--compile` / `--balance` a copy of it that holds them
    (documents.suite_file_with)."""
    fields = {}
    if getattr(args, "documents", None) is not None:
        from cpbench.harness.suite import documents

        fields["documents"] = documents.parse(args.documents)
    if getattr(args, "compile", None) is not None:
        fields["compile"] = args.compile
    if getattr(args, "balance", None) is not None:
        fields["balance"] = args.balance
    if not fields:
        return args.suite
    from cpbench.harness.suite import documents
    from cpbench.harness.suite.suites import DEFAULT, DEFAULT_SUITE_TOML

    default = args.suite is None or str(args.suite) == DEFAULT
    if not default and not Path(args.suite).exists():
        return args.suite  # resolve_suite says what is wrong
    text = DEFAULT_SUITE_TOML if default else Path(args.suite).read_text()
    return documents.suite_file_with(text, "default-cpu" if default else Path(args.suite).stem, fields,
                                     args.out / ".suites")


def _cluster(args):
    """The cluster options of `sweep --launcher slurm|submitit-local`, checked before anything runs."""
    from cpbench.harness.run.cluster import ClusterOptions

    launcher = getattr(args, "launcher", "local")
    given = [name for name in ("nodes", "gpus_per_node", "partition", "account")
             if getattr(args, name, None) is not None]
    if launcher == "local":
        if given:
            flags = " ".join(f"--{n.replace('_', '-')} {getattr(args, n)}" for n in given)
            raise ValueError(f"{flags}: a cluster's, for --launcher slurm or submitit-local; the local launcher runs "
                             "each point's ranks on this machine. Give the launcher, or drop them.")
        return None
    import importlib.util

    if importlib.util.find_spec("submitit") is None:
        raise ValueError(f"--launcher {launcher} submits through submitit, not installed here: "
                         "pip install 'cpbench[slurm]'")
    nodes, per_node = args.nodes or 1, args.gpus_per_node or 8
    for name, value in (("nodes", args.nodes), ("gpus-per-node", args.gpus_per_node)):
        if value is not None and value < 1:
            raise ValueError(f"--{name} {value}: give an integer >= 1")
    return ClusterOptions(launcher, nodes, per_node, args.partition, args.account)


def sweep_command(args) -> int:
    from cpbench.harness.run.summary import summary_table
    from cpbench.harness.run.sweep import failures, run_sweep
    from cpbench.report.runs import store

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
    from cpbench.harness.run import worker
    if worker.launched_by_torchrun() is None:
        return sweep_command_for(args)
    from cpbench.harness.run.external import run_external

    try:
        args.suite = _suite_with_flags(args)
        return run_external(args)
    except ValueError as e:  # e.g. another process writes the run (lock.RunLocked)
        print(f"cpbench run: {e}", file=sys.stderr)
        return 2


def sweep_command_for(args) -> int:
    from cpbench.harness.run.summary import summary_table
    from cpbench.harness.run.sweep import failures, run_sweep
    from cpbench.report.runs import store

    try:
        run_dir = run_sweep(_options(args, only=args.points))
    except ValueError as e:
        print(f"cpbench run: {e}", file=sys.stderr)
        return 2
    df = store.read_run(run_dir)
    mine = df[df["point_id"].isin(args.points)]
    print(summary_table(mine))
    return _exit_code(failures(mine), "run")
