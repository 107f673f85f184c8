"""Launching a group of points as a cluster job (`cpbench sweep --launcher slurm`), through submitit.

One job per group of points of one world size: one task per node, each running torch's launcher with a c10d
rendezvous on the job's first node (`--nnodes N --rdzv-backend c10d`). The ranks write the same records as a local
launch (worker.py) into the run folder, which the cluster's nodes share with the machine that runs the sweep; the
sweep watches them and turns them into rows exactly as for a local launch (statuses, resume, fail-fast). The job's
time limit is the sum of its points' timeouts plus the startup grace; a point past its own timeout cancels the job.

`--launcher submitit-local` runs the same job with submitit's local executor: every "node" a local process, the
rendezvous on localhost. It needs no cluster (the tests use it).
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

LAUNCHERS = ("local", "slurm", "submitit-local")
MASTER = "{master}"  # filled in on the job's nodes: the first node's host name


@dataclass(frozen=True)
class ClusterOptions:
    launcher: str = "slurm"
    nodes: int = 1
    gpus_per_node: int = 8  # ranks per node (on CPU points: processes per node)
    partition: str | None = None
    account: str | None = None

    def shape(self, world_size: int) -> tuple[int, int]:
        """(nodes, ranks per node) for a group of `world_size` ranks: one node when it fits, else full nodes."""
        if world_size <= self.gpus_per_node:
            return 1, world_size
        nodes = world_size // self.gpus_per_node
        if world_size % self.gpus_per_node or nodes > self.nodes:
            raise ValueError(
                f"world size {world_size} does not fit --nodes {self.nodes} x --gpus-per-node {self.gpus_per_node}: "
                f"it needs whole nodes of {self.gpus_per_node} ranks and at most {self.nodes} of them; raise --nodes "
                "or drop those points from the run."
            )
        return nodes, self.gpus_per_node


def rendezvous_args(nodes: int, per_node: int, port: int, run_id: str) -> list[str]:
    return ["--nnodes", str(nodes), "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{MASTER}:{port}", "--rdzv-id", run_id]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _node_task(cmd: list[str], threads_per_rank: int | None) -> int:
    """What each task (node) of the job runs: torch's launcher, pointed at the first node."""
    import submitit

    env = submitit.JobEnvironment()
    master = "127.0.0.1" if env.cluster == "local" else env.hostnames[0]
    run_env = dict(os.environ)
    if threads_per_rank:
        run_env["OMP_NUM_THREADS"] = str(threads_per_rank)
    code = subprocess.call([part.replace(MASTER, master) for part in cmd], env=run_env)
    if code:
        raise RuntimeError(f"torch's launcher on node {env.global_rank} exited with code {code}")
    return code


class ClusterLaunch:
    """One submitted job, watched like a local `Launch`: `poll()` -> exit code or None, `kill()` cancels it."""

    def __init__(self, cmd: list[str], log_path: Path, options: ClusterOptions, nodes: int, timeout_s: float,
                 threads_per_rank: int | None = None):
        import submitit

        self.log_path = log_path
        folder = log_path.parent / f"{log_path.stem}-job"
        executor = submitit.AutoExecutor(folder=folder, cluster="local" if options.launcher == "submitit-local"
                                         else "slurm")
        params = {"timeout_min": max(1, math.ceil(timeout_s / 60)), "name": f"cpbench-{log_path.stem}"}
        if options.launcher == "submitit-local":  # the local executor has one node: its tasks stand for the nodes
            params.update(tasks_per_node=nodes, nodes=1)
        else:
            params.update(nodes=nodes, tasks_per_node=1, gpus_per_node=options.gpus_per_node,
                          slurm_partition=options.partition, slurm_account=options.account)
        executor.update_parameters(**{k: v for k, v in params.items() if v is not None})
        self.job = executor.submit(_node_task, cmd, threads_per_rank)

    def waiting(self) -> bool:
        """Queued, not yet running: the sweep's startup grace starts when the job does."""
        return self.job.state in ("PENDING", "CONFIGURING", "REQUEUED", "UNKNOWN") and not self.job.done()

    def poll(self) -> int | None:
        if not self.job.done():
            return None
        try:
            return 0 if self.job.exception() is None else 1
        except Exception:  # noqa: BLE001 - a job cancelled or lost by the scheduler has no result to read
            return 1

    def kill(self) -> None:
        self.job.cancel(check=False)

    def close(self) -> None:
        if not self.job.done():
            self.kill()
        self.log_path.write_text(self._logs())

    def log_tail(self, chars: int = 2000) -> str:
        return self._logs()[-chars:]

    def _logs(self) -> str:
        return "\n".join(filter(None, (self.job.stdout(), self.job.stderr())))
