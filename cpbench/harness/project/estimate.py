"""`cpbench estimate`: a suite's points projected, not measured (projection.py), into the same Parquet schema.

Every row is `measurement = "projected"`: status `ok`, `oom` when the projected per-rank peak passes the capacity
(`--device-memory`, else the suite's `memory_budget`) or a node's ranks together hold more host memory than
`--host-memory` (`status_detail` says which side, by how much), `skipped` with why (a backend whose kernels cannot
run on fake tensors, a longer length of a configuration already out of memory), or `error` with the message: one point
that fails is recorded and the others go on.

`--max-seq`: per configuration (cp size, style, backend, ...), the largest length whose projected per-rank peak fits,
to a granularity of tokens (`chains`, `search`): from the suite's shortest length (rounded up to the granularity) the
length doubles until a projection runs out of memory or reaches the model's max_position_embeddings, then bisects
between the longest length that fit and the shortest that did not. Every length tried is a row of the run, so the
table and the largest-fit plot show the search; `report.derive.largest_fit` reads the answer off them.

Each configuration (the points that differ only in length) is a chain: its next length waits for the verdict on
the one before. Chains run side by side, one (point, rank) projection per worker process, so the cores of the
machine share the work; rows are written as points finish.
"""

from __future__ import annotations

import concurrent.futures as futures
import multiprocessing
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

from cpbench.harness.measure.env import fingerprint
from cpbench.harness.project.hardware import SDPA_KERNELS
from cpbench.harness.project.hardware import load as load_hardware
from cpbench.harness.project.projection import project_rank, projected_ranks, stand_in
from cpbench.harness.run import rows
from cpbench.harness.run.skips import SkipRules
from cpbench.harness.run.sweep import pick_run_dir, writing
from cpbench.harness.suite.presets import get_preset
from cpbench.harness.suite.spec import Point, Suite
from cpbench.harness.suite.suites import resolve_suite
from cpbench.report.runs import store
from cpbench.report.units import parse_bytes


@dataclass(kw_only=True)
class EstimateOptions:
    suite: str | Suite | None = None
    out: Path = Path("results")
    run: str | None = None
    device_memory: str | None = None
    host_memory: str | None = None  # per node
    gpus_per_node: int | None = None  # ranks per node (8), for host memory and the pricing of collectives
    max_seq: bool = False
    granularity: int | None = None  # the --max-seq search's step in tokens (1024)
    jobs: int | None = None  # worker processes (default: the CPUs, at most 8); 1: in this process
    gpu: str | None = None  # a GPU profile (hardware.py): projected time, and the capacity when none is given
    sdpa_kernel: str | None = None  # the kernel a model's own SDPA call is priced as (default: the profile's)
    wait: bool = False  # another process writes the run: wait for it (else refuse, naming it)


class Estimator:
    """The run being written: one row per point, with the skip rules learned from what is written."""

    def __init__(self, run_dir: Path, suite: Suite, capacity: int | None, on_row=None, host_capacity: int | None = None,
                 gpus_per_node: int = 8, hardware=None):
        self.run_dir, self.suite, self.capacity, self.on_row = run_dir, suite, capacity, on_row
        self.ctx = {"run_id": run_dir.name, "env": fingerprint(suite.device), "budget": capacity,
                    "host_budget": host_capacity, "gpus_per_node": gpus_per_node, "measurement": "projected"}
        self.rules = SkipRules()
        self.hardware = hardware  # a GPU profile: each projection is also priced on it (timing.py)

    def skip(self, point: Point) -> dict | None:
        """The `skipped` row of a point that is not projected (written), or None."""
        why = self.rules.why_skip(point, projection=True)
        return self.write(point, rows.outcome_row(point, "skipped", why, 0.0, **self.ctx)) if why else None

    def finish(self, point: Point, records: list[dict] | None, error: str | None, wall_s: float) -> dict:
        if error is not None:
            row = rows.outcome_row(point, "error", f"projection failed: {error}", wall_s, **self.ctx)
        else:
            by_rank = {r["rank"]: r for r in records}
            ranks = [{**by_rank[stand_in(point, r)], "rank": r} for r in range(point.world_size)]
            row = rows.measured_row(point, ranks, wall_s, **self.ctx)
            if 1 < len(by_rank) < point.cp_size:  # sampled (rank 0 alone stands for identical ranks: no note)
                note = (f"projected cp ranks {', '.join(map(str, sorted(by_rank)))} of {point.cp_size}; each other "
                        f"rank repeats the nearest projected cp rank below its own (projection.projected_ranks)")
                row["status_detail"] = "; ".join(filter(None, [row["status_detail"], note]))
        return self.write(point, row)

    def write(self, point: Point, row: dict) -> dict:
        store.append_rows(self.run_dir, [row])
        self.rules.observe(point, row["status"])
        if self.on_row:
            self.on_row(row)
        return row


def in_order(points: list[Point]):
    """A chain that projects its points in order (the skip rules drop longer ones after an `oom`)."""
    for point in points:
        yield point


def capacity_of(opts: EstimateOptions, suite: Suite, hardware=None) -> int | None:
    """--device-memory, else the suite's memory_budget, else the GPU profile's memory, else none."""
    text = opts.device_memory or suite.memory_budget
    if text:
        return parse_bytes(text, field_name="--device-memory")
    return hardware.memory_bytes if hardware is not None else None


@dataclass(frozen=True)
class Checked:
    """What a projection runs with, every option checked (`preflight`)."""
    suite: Suite
    hardware: object
    capacity: int | None
    host_capacity: int | None
    gpus_per_node: int
    jobs: int


def preflight(opts: EstimateOptions) -> Checked:
    """Every option checked, and each one that cannot apply (an option of another that was not given) refused naming
    it, before anything is projected."""
    suite = opts.suite if isinstance(opts.suite, Suite) else resolve_suite(opts.suite)
    if suite.loop != "own":
        raise ValueError(f"suite {suite.name!r}: loop = {suite.loop!r} is measured only (a projection runs cpbench's own "
                         "step on fake tensors, which Trainer's data loading cannot feed): `cpbench sweep` the suite, "
                         "or drop `loop` to project the same step.")
    hardware = load_hardware(opts.gpu) if opts.gpu else None
    if opts.sdpa_kernel is not None:
        if hardware is None or opts.sdpa_kernel not in SDPA_KERNELS:
            raise ValueError(f"--sdpa-kernel {opts.sdpa_kernel!r}: give one of {list(SDPA_KERNELS)}, with --gpu.")
        hardware = replace(hardware, sdpa_kernel=opts.sdpa_kernel)
    capacity = capacity_of(opts, suite, hardware)
    host_capacity = parse_bytes(opts.host_memory, field_name="--host-memory") if opts.host_memory else None
    if opts.max_seq and capacity is None:
        raise ValueError("--max-seq needs a capacity: pass --gpu (e.g. h100-sxm) or --device-memory (e.g. 80GiB), "
                         "or set the suite's memory_budget.")
    if opts.granularity is not None and not opts.max_seq:
        raise ValueError(f"--granularity {opts.granularity}: the step of --max-seq's search, which was not asked "
                         "for; give --max-seq too, or drop --granularity.")
    gpus_per_node = 8 if opts.gpus_per_node is None else opts.gpus_per_node
    if gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node {gpus_per_node}: give at least 1 (ranks that share a node's host "
                         "memory).")
    jobs = opts.jobs if opts.jobs is not None else min(os.cpu_count() or 1, 8)
    if jobs < 1:
        raise ValueError(f"--jobs {jobs}: give at least 1 (worker processes; 1 projects in this process).")
    return Checked(suite, hardware, capacity, host_capacity, gpus_per_node, jobs)


def run_estimate(opts: EstimateOptions, on_row=None) -> Path:
    """Projects a suite (or, with `max_seq`, searches its largest lengths); returns the run folder."""
    checked = preflight(opts)
    suite, jobs = checked.suite, checked.jobs
    run_dir = pick_run_dir(Path(opts.out) / suite.name, opts.run, resume=False)
    with writing(run_dir, opts.run, False, opts.wait, "estimate"):
        estimator = Estimator(run_dir, suite, checked.capacity, on_row, checked.host_capacity, checked.gpus_per_node,
                              checked.hardware)
        if opts.max_seq:
            run_chains(estimator, chains(suite, 1024 if opts.granularity is None else opts.granularity), jobs)
        else:
            by_config: dict[str, list[Point]] = {}
            for p in suite.points():
                by_config.setdefault(p.family_key, []).append(p)
            run_chains(estimator, [in_order(points) for points in by_config.values()], jobs)
    return run_dir


def _project(point: dict, rank: int, hardware=None, gpus_per_node: int = 8) -> dict:
    """A worker's task (module level, so a spawned process can import it)."""
    return project_rank(Point.from_dict(point), rank, hardware, gpus_per_node)


class _InProcess:
    """The executor interface, run at submission: `--jobs 1`, and tests."""

    def submit(self, fn, *args):
        future = futures.Future()
        try:
            future.set_result(fn(*args))
        except Exception as e:  # noqa: BLE001 - the future carries it, as a worker's would
            future.set_exception(e)
        return future

    def shutdown(self, **_):
        pass


def run_chains(estimator: Estimator, chains: list, jobs: int) -> None:
    """Drives every chain (a generator that yields the next Point and is sent back its row) to its end."""
    pool = _InProcess() if jobs == 1 else futures.ProcessPoolExecutor(
        jobs, mp_context=multiprocessing.get_context("spawn"))
    running: dict[futures.Future, tuple] = {}  # future -> (chain, point, rank)
    done: dict[str, list] = {}  # point_key -> records (or the error) so far
    started: dict[str, float] = {}
    try:
        for chain in chains:
            _advance(estimator, pool, chain, None, running, started)
        while running:
            finished, _ = futures.wait(running, return_when=futures.FIRST_COMPLETED)
            for future in finished:
                chain, point, _ = running.pop(future)
                error = future.exception()
                results = done.setdefault(point.point_key, [])
                results.append(_said(error) if error else future.result())
                if len(results) < len(projected_ranks(point)):
                    continue
                errors = [r for r in results if isinstance(r, str)]
                row = estimator.finish(point, None if errors else results, errors[0] if errors else None,
                                       time.perf_counter() - started[point.point_key])
                _advance(estimator, pool, chain, row, running, started)
    finally:
        pool.shutdown(cancel_futures=True)


# fake tensors hold no values: an op whose result depends on them cannot run in a projection
VALUE_READS = {"DataDependentOutputException": "a tensor's value read on the host (`.item()`, a data-dependent branch)",
               "DynamicOutputShapeException": "an op whose output size depends on the values (nonzero, a mask index)"}


def _said(error: BaseException) -> str:
    """A projection's error as its row says it; one the fake tensors cannot run says so, and what to do."""
    text = f"{type(error).__name__}: {error}"
    why = VALUE_READS.get(type(error).__name__)
    if why is None:
        return text
    return (f"{text}: the projection runs the step on fake tensors, which hold no values, and this step needs one "
            f"({why}: an MoE router's dispatch, a mask read on the host); measure the point instead "
            f"(`cpbench sweep`, on CPU at a smaller size or on the GPU)")


def _advance(estimator: Estimator, pool, chain, row, running: dict, started: dict) -> None:
    """Sends `row` to the chain and submits its next point's ranks (skipped points are answered at once)."""
    while True:
        try:
            point = chain.send(row) if row is not None else next(chain)
        except StopIteration:
            return
        row = estimator.skip(point)
        if row is None:
            started[point.point_key] = time.perf_counter()
            for rank in projected_ranks(point):
                running[pool.submit(_project, point.to_dict(), rank, estimator.hardware,
                                    estimator.ctx["gpus_per_node"])] = (chain, point, rank)
            return


def families(points: list[Point]) -> list[Point]:
    """One point per configuration (its shortest length), in suite order."""
    seen: dict[str, Point] = {}
    for p in points:
        if p.family_key not in seen or p.seq_len < seen[p.family_key].seq_len:
            seen[p.family_key] = p
    return list(seen.values())


def chains(suite, granularity: int) -> list:
    """One search per configuration of the suite (see estimate.run_chains for how chains run)."""
    if not isinstance(granularity, int) or granularity < 1:
        raise ValueError(f"--granularity {granularity}: give a positive number of tokens, e.g. 1024.")
    out = []
    for template in families(suite.points()):
        config = get_preset(template.preset).config(template.model_overrides)
        limit = config.max_position_embeddings // granularity * granularity
        if limit < granularity:
            raise ValueError(f"--granularity {granularity} is longer than {template.model}'s "
                             f"max_position_embeddings ({config.max_position_embeddings}).")
        out.append(search(template, granularity, limit))
    return out


def search(template: Point, g: int, limit: int):
    """Yields the lengths to project (as points), is sent each one's row; ends with the largest that fits."""

    def fits(row: dict) -> bool | None:
        return {"ok": True, "oom": False}.get(row["status"])  # None: skipped or error, the search stops

    fit, over = 0, None
    length = min(max(g, -(-template.seq_len // g) * g), limit)
    while True:
        verdict = fits((yield replace(template, seq_len=length)))
        if verdict is None:
            return fit or None
        if not verdict:
            over = length
            break
        fit = length
        if length == limit:
            return fit
        length = min(2 * length, limit)
    while over - fit > g:
        middle = (fit + over) // 2 // g * g
        verdict = fits((yield replace(template, seq_len=middle)))
        if verdict is None:
            break
        fit, over = (middle, over) if verdict else (fit, middle)
    return fit or None
