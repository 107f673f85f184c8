"""Rank functions for the projection-against-measurement tests: each rank measures every point of its world size
through the sweep worker's `run_point` (gloo, real tensors), then projects its share of the points (fake tensors,
fake process group), so the two cores of a CI machine share both halves."""

from __future__ import annotations

import torch
import torch.distributed as dist

from cpbench.harness.project import projection
from cpbench.harness.run import worker
from cpbench.harness.suite.spec import Point

KEEP = ("peak_bytes", "params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "temporaries_bytes",
        "host_peak_bytes", "d2h_bytes", "h2d_bytes", "host_params_bytes", "host_grads_bytes", "host_optimizer_bytes",
        "host_activations_bytes")


def _columns(record: dict) -> dict:
    return {k: v for k, v in record.items() if k in KEEP or k.startswith("comm_")}


def measure_then_project(points: list[dict], world_size: int, rank: int | None = None,
                         solo: list[dict] = ()) -> dict:
    """{point_id: {"measured": columns of this rank, "projected": {rank: columns} for this process's share}}.
    `points` run on `world_size` ranks together; the `solo` points (world size 1) run on rank 0 after that."""
    points, solo = [Point.from_dict(p) for p in points], [Point.from_dict(p) for p in solo]
    if world_size > 1:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    rank = rank or 0
    out = {}
    for point in points:
        record = worker.run_point(point, rank=rank, device=torch.device("cpu"), budget=None, cache_dir=None)
        out[point.point_id] = {"measured": _columns(record), "projected": {}}
    if world_size > 1:
        dist.destroy_process_group()
    for point in solo if rank == 0 else ():
        record = worker.run_point(point, rank=0, device=torch.device("cpu"), budget=None, cache_dir=None)
        out[point.point_id] = {"measured": _columns(record), "projected": {}}
    jobs = [(point, r) for point in points + solo for r in projection.projected_ranks(point)]
    for i, (point, r) in enumerate(jobs):
        if i % world_size == rank:
            record = _columns(projection.project_rank(point, r))
            # a rank that stands for its cp group (projected_ranks) is compared with every measured rank
            for stands_for in (range(point.cp_size) if projection.projected_ranks(point) == [0] else [r]):
                out.setdefault(point.point_id, {"measured": {}, "projected": {}})["projected"][stands_for] = record
    return out
