"""Command line: `python -m cpbench <command>`. Thin: each area registers its subcommands and the function
each one calls (`harness.commands`: sweep, run; `harness.estimate_cli`: estimate; `harness.project.commands`: plan,
calibrate; `report.commands`: report, compare, gate)."""

from __future__ import annotations

import argparse
import importlib
import sys

AREAS = ("cpbench.harness.commands", "cpbench.harness.estimate_cli", "cpbench.harness.project.commands",
         "cpbench.report.commands")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cpbench", description="Context parallelism for transformers, benchmarked.")
    sub = parser.add_subparsers(dest="command", required=True)
    version = sub.add_parser("version", help="print the versions cpbench runs with")
    version.set_defaults(func=_version)
    for area in AREAS:
        try:
            module = importlib.import_module(area)
        except ModuleNotFoundError as e:
            if e.name != area:
                raise
            continue
        module.register(sub)  # adds subparsers, each with set_defaults(func=callable(args) -> exit code)
    return parser


def _version(args: argparse.Namespace) -> int:
    import torch
    import transformers

    import cpbench

    print(f"cpbench {cpbench.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
