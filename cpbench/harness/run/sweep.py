"""`cpbench sweep`: a suite's points -> launches -> rows in `results/<suite>/<run>/runs.parquet`.

Points of one world size share a launch (a process launch costs seconds). A row is appended the moment its
point finishes, atomically, so a killed sweep leaves every finished point on disk and `--resume` runs only the
others. A launch that dies (a crash, an out-of-memory exit, a hang killed at its timeout) ends its point in
flight with that status; the points it had not started go into a fresh launch.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from cpbench.harness.measure.env import fingerprint
from cpbench.harness.run import rows
from cpbench.harness.run.cluster import ClusterLaunch, ClusterOptions, free_port, rendezvous_args
from cpbench.harness.run.launch import Launch, worker_command
from cpbench.harness.run.progress import SweepProgress
from cpbench.harness.run.records import LaunchRecords
from cpbench.harness.run.skips import SkipRules
from cpbench.harness.suite.spec import Point
from cpbench.harness.suite.suites import resolve_suite, suite_ref
from cpbench.report.runs import lock, store
from cpbench.report.units import parse_bytes

STARTUP_GRACE_S = 300.0  # imports and process-group setup before a launch's first point starts
POLL_S = 0.2
CPU_THREADS_PER_RANK = 1


@dataclass(kw_only=True)
class SweepOptions:
    suite: str | None = None
    out: Path = Path("results")
    run: str | None = None
    resume: bool = False
    memory_budget: str | None = None
    allow_faults: bool = False
    only: tuple[str, ...] = ()  # point ids; empty: all
    progress: bool = True
    cluster: ClusterOptions | None = None  # None: torch's launcher here; else one cluster job per launch
    wait: bool = False  # another process writes the run: wait for it (else refuse, naming it)
    cp_plan: str | None = None  # --cp-plan: a JSON plan or a style name, in place of the suite's plan


def pick_run_dir(suite_dir: Path, run: str | None, resume: bool) -> Path:
    """`--run-name NAME` names the folder; `--resume` alone takes the run written most recently (by the mtime of
    its runs.parquet, not its name: names need not sort by time). A named run that already has results is only
    continued with `--resume`, never silently."""
    if run:
        run_dir = suite_dir / run
        check_new(run_dir, run, resume)
        return run_dir
    if resume:
        existing = [p for p in suite_dir.glob("*") if (p / store.RUNS_FILE).exists()]
        if existing:
            return max(existing, key=lambda p: (p / store.RUNS_FILE).stat().st_mtime)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    # two runs started in the same second: the later one takes the next free name (a writer creates its folder
    # at once, under its lock)
    names = itertools.chain([stamp], (f"{stamp}-{i}" for i in itertools.count(2)))
    return next(suite_dir / name for name in names if not (suite_dir / name).exists())


def check_new(run_dir: Path, run: str | None, resume: bool) -> None:
    """A named run that already has results is only continued with `--resume`, never silently (checked again under
    the run's lock: a writer that finished meanwhile)."""
    if run and not resume and store.has_results(run_dir):
        raise ValueError(
            f"--run-name {run!r}: {run_dir} already has results. Pass --resume to finish that run, or choose "
            "another --run-name (or none, for a timestamped one)."
        )


@contextlib.contextmanager
def writing(run_dir: Path, run: str | None, resume: bool, wait: bool, what: str):
    """The run's writer lock (lock.py) for the block; inside it, a damaged table or points only in the journal are
    repaired first (store.repair), and what was found is said on stderr."""
    with lock.writer(run_dir, wait=wait, on_wait=lambda m: print(f"cpbench {what}: {m}", file=sys.stderr, flush=True)):
        check_new(run_dir, run, resume)
        for note in store.repair(run_dir):
            print(f"cpbench {what}: {note}", file=sys.stderr, flush=True)
        yield


def failures(df) -> list[str]:
    """What makes `sweep`/`run` exit 1: a point that is `error` or `timeout`, or a parity that is `fail`.
    `oom` and `skipped` are results (what fits), not failures."""
    out = [f"{r['point_id']}: {r['status']}" for r in df.to_dict("records") if r["status"] in ("error", "timeout")]
    out += [f"{r['point_id']}: parity fail" for r in df.to_dict("records") if r.get("parity_status") == "fail"]
    return out


def run_sweep(opts: SweepOptions) -> Path:
    """Runs (or finishes) a sweep; returns its run folder."""
    suite = resolve_suite(opts.suite, allow_faults=opts.allow_faults, cp_plan=opts.cp_plan)
    points = [p for p in suite.points() if not opts.only or p.point_id in opts.only]
    unknown = sorted(set(opts.only) - {p.point_id for p in points})
    if unknown:
        raise ValueError(f"--point {unknown} not in suite {suite.name!r}; its points are "
                         f"{[p.point_id for p in suite.points()]}.")
    run_dir = pick_run_dir(Path(opts.out) / suite.name, opts.run, opts.resume)
    budget_text = opts.memory_budget or suite.memory_budget
    ctx = {"run_id": run_dir.name, "env": fingerprint(suite.device),
           "budget": parse_bytes(budget_text) if budget_text else None,
           # a node's ranks share its host memory (rows.host_node_peak_bytes): a cluster job's nodes, else one
           "gpus_per_node": opts.cluster.gpus_per_node if opts.cluster is not None else None}
    if opts.cluster is not None:  # refused before anything is submitted
        for world in sorted({p.world_size for p in points}):
            opts.cluster.shape(world)
    with writing(run_dir, opts.run, opts.resume, opts.wait, "sweep"):
        sweep = _Sweep(run_dir, ctx, budget_text, suite_ref(opts.suite), opts.allow_faults, opts.cluster, opts.cp_plan)
        done = store.finished_point_ids(run_dir)
        sweep.rules.learn(store.read_run(run_dir), points)
        pending = [p for p in points if p.point_id not in done]
        with _sigterm_as_interrupt(), SweepProgress(len(points), len(points) - len(pending), suite.name,
                                                    enabled=opts.progress) as bar:
            sweep.bar = bar
            for _, group in itertools.groupby(pending, key=lambda p: p.world_size):
                remaining = list(group)
                while remaining:
                    remaining = sweep.launch(sweep.skip(remaining))
    return run_dir


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM unwinds like Ctrl-C, so the running launch is killed with the sweep instead of orphaned."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class ResultsNotWritten(ValueError):
    """A row could not be written (the sweep stops: every later point would be lost too)."""

    def __init__(self, run_dir: Path, point_id: str, error: OSError):
        done = len(store.finished_point_ids(run_dir)) if store.has_results(run_dir) else 0
        super().__init__(
            f"could not write the row of {point_id} to {run_dir} ({error}); stopped. The {done} point(s) written "
            f"before are intact; free the space (or fix the folder), then run again with --resume to finish the "
            f"others.")


class _Sweep:
    def __init__(self, run_dir: Path, ctx: dict, budget_text: str | None, ref: str, allow_faults: bool,
                 cluster: ClusterOptions | None = None, cp_plan: str | None = None):
        self.run_dir, self.ctx, self.budget_text, self.ref, self.allow_faults = (
            run_dir, ctx, budget_text, ref, allow_faults)
        self.cp_plan = cp_plan
        self.cluster = cluster
        self.rules = SkipRules()
        self.bar = None
        self.launches = len(list((run_dir / "records").glob("launch-*"))) if run_dir.exists() else 0

    def write(self, point: Point, row: dict) -> None:
        try:
            store.append_rows(self.run_dir, [row])
        except OSError as e:  # a full disk, a lost mount: stop, with every row written before intact
            raise ResultsNotWritten(self.run_dir, point.point_id, e) from e
        self.rules.observe(point, row["status"])
        self.bar.finished(point, row["status"])

    def skip(self, points: list[Point]) -> list[Point]:
        """Writes `skipped` rows for the points that must not run; returns the others."""
        keep = []
        for p in points:
            why = self.rules.why_skip(p)
            if why:
                self.write(p, rows.outcome_row(p, "skipped", why, 0.0, **self.ctx))
            else:
                keep.append(p)
        return keep

    def launch(self, points: list[Point]) -> list[Point]:
        """Runs `points` in one launch; returns those it did not get to."""
        if not points:
            return []
        self.launches += 1
        folder = self.run_dir / "records" / f"launch-{self.launches}"
        # On CPU a rank stands for one device: one core each, so cp=2 uses twice the compute of cp=1 as two
        # GPUs would (and two OpenMP threads per rank cannot fight over a shared machine's cores).
        threads = CPU_THREADS_PER_RANK if points[0].device == "cpu" else None
        proc = self._start(points, folder, self.run_dir / "logs" / f"launch-{self.launches}.log", threads)
        records = LaunchRecords(folder, points)
        try:
            return self._watch(proc, records)
        finally:
            proc.close()

    def _start(self, points: list[Point], folder: Path, log: Path, threads: int | None):
        world = points[0].world_size
        args = (world, self.ref, [p.point_id for p in points], folder, self.run_dir.parent / "cache",
                self.budget_text, self.allow_faults, self.cp_plan)
        if self.cluster is None:
            return Launch(worker_command(*args), log, threads)
        nodes, per_node = self.cluster.shape(world)
        rendezvous = rendezvous_args(nodes, per_node, free_port(), f"{self.ctx['run_id']}-{self.launches}")
        limit = sum(p.timeout_s for p in points) + STARTUP_GRACE_S
        return ClusterLaunch(worker_command(*args, rendezvous=rendezvous), log, self.cluster, nodes, limit, threads)

    def _watch(self, proc: Launch, records: LaunchRecords) -> list[Point]:
        last_progress = time.time()
        while True:
            rc = proc.poll()
            if proc.waiting():  # a queued cluster job: the startup grace counts from when it runs
                last_progress = time.time()
            for point, result in records.harvest():
                last_progress = time.time()
                self._finish(point, result)
            for p in records.pending():
                why = self.rules.why_skip(p)
                if why:  # the worker skips these too (same rule)
                    records.mark_done(p)
                    self.write(p, rows.outcome_row(p, "skipped", why, 0.0, **self.ctx))
            flight = records.in_flight()
            if rc is not None:
                return self._after_exit(proc, records, rc, flight)
            if flight is not None:
                self.bar.running(flight[0])
            deadline = (flight[1] + flight[0].timeout_s) if flight else last_progress + STARTUP_GRACE_S
            if time.time() > deadline:
                proc.kill()
                if flight is None:
                    return self._no_progress(proc, records, "no point started within the startup grace")
                point, started = flight
                records.mark_done(point)
                detail = f"no result after {point.timeout_s:g}s (point timeout): every rank was killed"
                self.write(point, rows.outcome_row(point, "timeout", detail, time.time() - started, **self.ctx))
                return records.pending()
            time.sleep(POLL_S)

    def _finish(self, point: Point, result: dict) -> None:
        if result["kind"] == "records":
            row = rows.measured_row(point, result["records"], result["wall_s"], **self.ctx)
        else:
            row = rows.outcome_row(point, result["status"], result["message"], result["wall_s"], **self.ctx)
        self.write(point, row)

    def _after_exit(self, proc: Launch, records: LaunchRecords, rc: int, flight) -> list[Point]:
        for point, result in records.harvest(exited=True):  # records written just before the exit
            if result["kind"] == "outcome" and "died without a record" in result["message"]:
                result = {**result, "message": f"{result['message']}; the launch exited with code {rc}; log tail:\n"
                                               f"{proc.log_tail()}"}
            self._finish(point, result)
        flight = records.in_flight()
        if flight is not None:
            point, started = flight
            records.mark_done(point)
            detail = f"the launch exited with code {rc} before the point finished; log tail:\n{proc.log_tail()}"
            self.write(point, rows.outcome_row(point, "error", detail, time.time() - started, **self.ctx))
        elif records.pending() and not records.progressed:
            return self._no_progress(proc, records, f"the launch exited with code {rc} before any point started")
        return records.pending()

    def _no_progress(self, proc: Launch, records: LaunchRecords, why: str) -> list[Point]:
        """A launch that ran nothing: its first point gets the error, so the sweep always moves on."""
        point = records.pending()[0]
        records.mark_done(point)
        self.write(point, rows.outcome_row(point, "error", f"{why}; log tail:\n{proc.log_tail()}", 0.0, **self.ctx))
        return records.pending()
