"""`cpbench run SUITE --point ID` under an external torchrun (e.g. multi-node): every rank runs the point
through the same worker code as a sweep; rank 0 then turns the records into rows in the run's Parquet.

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m cpbench run suites/llama3-8b-long.toml --point llama-3-8b/s131072/cp16/flash_attention_2/cp_ring

A rank that raises writes its error record and exits; torchrun then ends the others and no row is written
(the record stays in `records/`). Rows land in `--out/<suite>/<--run or torchrun's run id>/runs.parquet`.
"""

from __future__ import annotations

import sys

import pandas as pd

from cpbench.harness.measure.env import fingerprint
from cpbench.harness.run import rows, worker
from cpbench.harness.run.records import LaunchRecords
from cpbench.harness.run.sweep import failures
from cpbench.harness.suite.suites import resolve_suite
from cpbench.report.runs import lock, store
from cpbench.report.units import parse_bytes


def run_external(args) -> int:
    suite = resolve_suite(args.suite, allow_faults=args.allow_faults, cp_plan=args.cp_plan)
    by_id = {p.point_id: p for p in suite.points()}
    missing = [i for i in args.points if i not in by_id]
    if missing:
        raise ValueError(f"--point {missing} not in suite {suite.name!r}; its points are {sorted(by_id)}.")
    points = [by_id[i] for i in args.points]
    run_dir = args.out / suite.name / (args.run or worker.launched_by_torchrun())
    budget_text = args.memory_budget or suite.memory_budget
    budget = parse_bytes(budget_text) if budget_text else None
    records_dir = run_dir / "records" / "external"
    worker.run_points(points, records_dir, budget=budget, cache_dir=run_dir.parent / "cache")
    if worker.rank_env()[0] != 0:
        return 0
    ctx = {"run_id": run_dir.name, "env": fingerprint(suite.device), "budget": budget}
    written = []
    with lock.writer(run_dir, wait=args.wait):  # refused while a sweep writes the same run (RunLocked: exit 2)
        for point, result in LaunchRecords(records_dir, points).harvest(exited=True):
            if result["kind"] == "records":
                row = rows.measured_row(point, result["records"], result["wall_s"], **ctx)
            else:
                row = rows.outcome_row(point, result["status"], result["message"], result["wall_s"], **ctx)
            store.append_rows(run_dir, [row])
            written.append(row)
    print(f"{len(points)} point(s) -> {store.runs_path(run_dir)}")
    failed = failures(pd.DataFrame(written, columns=["point_id", "status", "parity_status"]))
    if failed:
        print("cpbench run: " + "; ".join(failed), file=sys.stderr)
    return 1 if failed else 0
