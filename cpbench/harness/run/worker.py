"""One rank of a launch: runs points in order and writes their per-rank records.

Run by `cpbench sweep` through torch's launcher, or by any external torchrun:

    torchrun --nproc-per-node 2 -m cpbench.harness.run.worker --suite SUITE --point ID --records DIR

Per point, in `DIR`: `<point_key>.started` (rank 0, when the point begins), `<point_key>.measured.json` (every
rank's measurements, gathered to rank 0 before the parity reference runs), then `<point_key>.json` (the same with
rank 0's parity verdict) or, when a rank raises, `<point_key>.rank<r>.error.json` — and that rank exits at once,
so a peer blocked in a collective is torn down by the launcher instead of hanging. A failure in the reference
keeps the point's measurements (its parity says why). The launcher's caller turns records into rows (`rows.py`).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from cpbench.harness.measure import parity, step
from cpbench.harness.measure.capture import capture
from cpbench.harness.measure.compiled import CompileCounters, compile_layers, first_step
from cpbench.harness.measure.probes import StepTimer, memory_probe, reset_rss_peak, rss_peak_bytes
from cpbench.harness.measure.reference import reference_phase
from cpbench.harness.measure.trainer_loop import trainer_steps
from cpbench.harness.peers.attention_level import run_attention_point
from cpbench.harness.run.guard import die_with_parent
from cpbench.harness.suite.spec import Point
from cpbench.report.units import parse_bytes


def rank_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) as torchrun sets them — the one place cpbench reads them."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def launched_by_torchrun() -> str | None:
    """torchrun's run id when this process is a rank of an external launch, else None."""
    return os.environ.get("TORCHELASTIC_RUN_ID")


def write_json(path: Path, data) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _inject(point: Point, model, rank: int) -> None:
    """Test-only faults (see `Suite.faults`) on the last rank. "crash" and "oom" raise inside the first forward, at
    the second decoder layer, after its peers have entered the step's collectives, and "kill" ends the rank there
    with SIGKILL (as the kernel's OOM killer would); "hang" blocks before it."""
    if point.fault not in ("crash", "oom", "hang", "kill") or rank != point.world_size - 1:
        return  # "reference_crash" fires in the sharded reference (`_sharded_reference`)
    while point.fault == "hang":
        time.sleep(3600)
    kind = torch.OutOfMemoryError if point.fault == "oom" else RuntimeError
    layers = [m for name, m in model.named_modules() if name.endswith("layers.1")]

    def fail(*_):
        if point.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise kind(f"injected {point.fault} in {point.point_id} (suite [faults] table)")

    if not layers:
        fail()
    layers[0].register_forward_pre_hook(fail)


def run_point(point: Point, *, rank: int, device, budget: int | None, cache_dir: Path | None) -> dict:
    """This rank's record of the point, rank 0's with its parity verdict (every rank of the point calls it)."""
    if point.level == "attention":
        record, verdict = run_attention_point(point, rank=rank, device=device, budget=budget)
        return {**record, "parity": verdict} if rank == 0 else record
    record, side = measure_point(point, rank=rank, device=device, budget=budget)
    verdict = reference_phase(point, side, rank=rank, device=device, cache_dir=cache_dir)
    return {**record, "parity": verdict} if rank == 0 else record


def measure_point(point: Point, *, rank: int, device, budget: int | None) -> tuple[dict, dict]:
    """The point's measurements (this rank's record) and what its parity needs (`reference_phase`)."""
    reset_rss_peak()
    t_start = time.perf_counter()
    model = step.distribute(step.build_model(point, device), point)
    num_params = sum(p.numel() for p in build_model_meta(point).parameters())
    mode = parity.resolve_mode(point.parity_mode, num_params)
    batch = step.make_batch(point, model.config.vocab_size, device)
    optimizer = step.make_optimizer(model, point)
    probe = memory_probe(point.device, model, optimizer, budget)
    _inject(point, model, rank)
    compiled = CompileCounters() if point.compile != "off" else None
    if compiled is not None:
        compile_layers(model, point.compile)

    # Step 0, the parity step (the first, on unchanged weights), is not tracked: the capture keeps its outputs
    # and gathers full gradients, which a training step never holds. Its optimizer step creates the state. A
    # compiled point compiles in it (timed: `compile_s`), so the tracked and timed steps run compiled code.
    t_first = time.perf_counter()
    with first_step(point.compile):
        out = step.forward(model, batch)
        out.loss.backward()
    first_step_s = time.perf_counter() - t_first
    if compiled is not None:
        compiled.mark()
    ours, capture_error = None, None
    if mode != "off":
        ours, capture_error = capture(model, out, batch, point, mode, rank)
    del out
    if capture_error is not None and device.type == "cuda":
        torch.cuda.empty_cache()  # what the failed capture held
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    timer = StepTimer(point.device)
    if point.loop == "trainer":  # the same steps, driven by transformers' Trainer
        comm = trainer_steps(point, model, optimizer, batch, probe, timer)
    else:
        comm = step.tracked_steps(point, model, optimizer, batch, probe)  # memory: identical steps (probes.py)
        for _ in range(point.measured_steps):
            if point.world_size > 1:
                dist.barrier()  # the step times of the ranks start together
            with timer.step():
                step.train_step(model, optimizer, batch, point.keep_outputs)
    record = {"rank": rank, "status": "ok", **probe.result(), **comm, "rss_peak_bytes": rss_peak_bytes(),
              "step_times_s": timer.times_s, "num_params": num_params, "model_type": model.config.model_type,
              "parity_mode": mode, "layout": getattr(getattr(model, "cp_resolved_plan", None), "layout", None),
              "run_s": time.perf_counter() - t_start}
    if compiled is not None:
        compiled.add_to(record, first_step_s, timer.times_s)
    del model, optimizer, probe
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # room for the reference
    return record, {"ours": ours, "capture_error": capture_error, "mode": mode}


def build_model_meta(point: Point) -> torch.nn.Module:
    return step.build_model(point, "meta")


def _error_record(rank: int, e: BaseException) -> dict:
    oom = isinstance(e, torch.OutOfMemoryError)
    message = f"{type(e).__name__}: {e}".strip()
    return {"rank": rank, "status": "oom" if oom else "error", "message": message, "t": time.time(),
            "traceback": traceback.format_exc()[-4000:]}


def _over_budget(records: list[dict], budget: int | None) -> bool:
    return budget is not None and max(r["peak_bytes"] for r in records) > budget


def backend_for(device_type: str, points: list[Point]) -> str:
    """The process group's backend: gloo on the CPU, NCCL on GPUs, and gloo beside it for the host's tensors where a
    point offloads the parameters and clips the gradients (clip_grad_norm_ then all-reduces the norm of host
    gradients, which NCCL cannot take; torchtitan adds "cpu:gloo" with CPU offload alike,
    torchtitan/distributed/utils.py)."""
    if device_type != "cuda":
        return "gloo"
    host = any(p.offload_params and p.max_grad_norm for p in points)
    return "cuda:nccl,cpu:gloo" if host else "nccl"


def run_points(points: list[Point], records_dir: Path, *, budget: int | None, cache_dir: Path) -> None:
    """Every rank calls this with the same points. Longer points of an out-of-memory family are not run."""
    rank, world, local_rank = rank_env()
    device = torch.device("cuda", local_rank) if points[0].device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # A long timeout: rank 0 computes the parity reference while its peers wait; hangs are the launcher's job.
        dist.init_process_group(backend_for(device.type, points), timeout=datetime.timedelta(hours=2))
    records_dir.mkdir(parents=True, exist_ok=True)
    oom_families: set[str] = set()
    for point in points:
        if point.world_size != world:
            raise ValueError(f"point {point.point_id} needs world_size={point.world_size}; this launch has {world}.")
        if point.family_key in oom_families:
            continue
        if rank == 0:
            write_json(records_dir / f"{point.point_key}.started", {"point_id": point.point_id, "t": time.time()})
        try:
            if point.level == "attention":
                record, verdict = run_attention_point(point, rank=rank, device=device, budget=budget)
            else:
                record, side = measure_point(point, rank=rank, device=device, budget=budget)
            gathered = [None] * world
            dist.all_gather_object(gathered, record)
            if rank == 0:
                write_json(records_dir / f"{point.point_key}.measured.json", gathered)
            if point.level != "attention":
                verdict = reference_phase(point, side, rank=rank, device=device, cache_dir=cache_dir)
        except BaseException as e:  # noqa: BLE001 - recorded with its message, then this rank exits
            write_json(records_dir / f"{point.point_key}.rank{rank}.error.json", _error_record(rank, e))
            sys.stdout.flush()
            os._exit(1)
        if rank == 0:
            gathered[0]["parity"] = verdict
            write_json(records_dir / f"{point.point_key}.json", gathered)
        if _over_budget(gathered, budget):
            oom_families.add(point.family_key)
    # Every rank reaches the barrier before any tears its group down: a gloo rank whose peer closes the connection
    # while its own group is alive can abort the process ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cpbench.harness.run.worker", description="Run sweep points on this rank.")
    p.add_argument("--suite", required=True, help="suite file, or 'default'")
    p.add_argument("--point", action="append", required=True, dest="points", help="point id (repeatable)")
    p.add_argument("--records", required=True, type=Path, help="folder for the per-point records")
    p.add_argument("--cache", type=Path, default=None, help="reference cache folder (default: RECORDS/../cache)")
    p.add_argument("--memory-budget", default=None)
    p.add_argument("--allow-faults", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cp-plan", default=None, help="the sweep's --cp-plan (a JSON plan or a style name)")
    args = p.parse_args(argv)
    die_with_parent()  # a rank whose launcher died (its sweep killed with -9) stops too
    from cpbench.harness.suite.suites import resolve_suite

    suite = resolve_suite(args.suite, allow_faults=args.allow_faults, cp_plan=args.cp_plan)
    by_id = {pt.point_id: pt for pt in suite.points()}
    missing = [i for i in args.points if i not in by_id]
    if missing:
        raise ValueError(f"--point {missing} not in suite {suite.name!r}; its points are {sorted(by_id)}.")
    budget_text = args.memory_budget or suite.memory_budget
    budget = parse_bytes(budget_text) if budget_text else None
    cache = args.cache or args.records.parent / "cache"
    run_points([by_id[i] for i in args.points], args.records, budget=budget, cache_dir=cache)
    return 0


if __name__ == "__main__":
    sys.exit(main())
