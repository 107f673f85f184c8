"""cpbench points as pytest-benchmark benchmarks, for teams that gate with `--benchmark-compare-fail`.

    pytest benchmarks/ --benchmark-autosave                       # the default CPU suite's points
    pytest benchmarks/ --benchmark-compare --benchmark-compare-fail=median:10%
    pytest benchmarks/ --cpbench-suite suites/my-suite.toml -k cp2

Each benchmark times one training step (forward + backward + AdamW) of the point, `warmup_steps` warm-up rounds
then `measured_steps` rounds. This pytest process is rank 0; at cp_size 2 a spawned process is rank 1 of a
gloo group and runs the same steps in lockstep, so each timed round ends when both ranks' step ends. Before
timing, both ranks run the point once through the sweep worker (`run_point`), whose memory and parity results
go into `extra_info` together with the point's spec. These files are not collected by `pytest tests`.
"""

from __future__ import annotations

import multiprocessing as mp
import socket

import torch
import torch.distributed as dist

from cpbench.harness.measure import step

from cpbench.harness.run import worker
from cpbench.harness.suite.spec import Point

EXTRA = ("peak_bytes", "activations_bytes", "params_bytes", "grads_bytes", "optimizer_bytes", "rss_peak_bytes")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session(point: Point, rank: int, port: int, cache_dir: str) -> tuple[dict, tuple]:
    """Both ranks: the point once through the worker (memory, parity), then a fresh model to time."""
    torch.set_num_threads(1)  # one core per rank, as in `cpbench sweep` (a rank stands for one device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=point.world_size)
    record = worker.run_point(point, rank=rank, device=torch.device("cpu"), budget=None, cache_dir=cache_dir)
    model = step.distribute(step.build_model(point, "cpu"), point)
    batch = step.make_batch(point, model.config.vocab_size, "cpu")
    return record, (model, step.make_optimizer(model, point), batch, point.keep_outputs)


def _peer(point_dict: dict, port: int, cache_dir: str) -> None:
    point = Point.from_dict(point_dict)
    _, state = _session(point, 1, port, cache_dir)
    for _ in range(point.warmup_steps + point.measured_steps):
        step.train_step(*state)
    dist.destroy_process_group()


def test_point(benchmark, cpbench_point: Point, tmp_path_factory):
    point, port = cpbench_point, _free_port()
    cache = str(tmp_path_factory.getbasetemp() / "reference-cache")
    peer = None
    if point.world_size == 2:
        peer = mp.get_context("spawn").Process(target=_peer, args=(point.to_dict(), port, cache))
        peer.start()
    try:
        record, state = _session(point, 0, port, cache)
        benchmark.extra_info.update({k: record[k] for k in EXTRA})
        benchmark.extra_info.update(record["parity"])
        benchmark.extra_info["point_id"] = point.point_id
        benchmark.extra_info["spec"] = point.to_dict()
        benchmark.pedantic(step.train_step, args=state, rounds=point.measured_steps,
                           warmup_rounds=point.warmup_steps, iterations=1)
    finally:
        dist.destroy_process_group()
        if peer is not None:
            peer.join(60)
            if peer.is_alive():
                peer.kill()
    assert record["parity"]["parity_status"] == "pass", record["parity"]
    if peer is not None:
        assert peer.exitcode == 0, f"rank 1 exited with {peer.exitcode}"
