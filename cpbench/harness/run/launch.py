"""Launching a group of points: torch's own launcher (`python -m torch.distributed.run`) in a child process.

Each launch is its own process group on its own rendezvous port (`--standalone`), so whatever happens to it
(a crash, a hang, a rank killed by the OS) ends with that launch. The caller watches it through the records
the worker writes (see `worker.py`) and kills it — the whole process tree, since torchrun puts each rank in its
own session — when the point in flight exceeds its timeout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def worker_command(
    world_size: int, suite_ref: str, point_ids: list[str], records: Path, cache: Path,
    budget: str | None, allow_faults: bool, cp_plan: str | None = None, rendezvous: list[str] | None = None,
) -> list[str]:
    """torch's launcher running the worker; `rendezvous`: its multi-node arguments (cluster.py), else one node."""
    nodes = rendezvous or ["--standalone", "--nnodes", "1", "--nproc-per-node", str(world_size)]
    cmd = [  # through guard.py: the launcher dies with the sweep, whatever kills it
        sys.executable, "-m", "cpbench.harness.run.guard", "torch.distributed.run", *nodes, "--max-restarts", "0", "--monitor-interval", "0.5",
        "-m", "cpbench.harness.run.worker", "--suite", suite_ref, "--records", str(records), "--cache", str(cache),
    ]
    for pid in point_ids:
        cmd += ["--point", pid]
    if budget:
        cmd += ["--memory-budget", budget]
    if allow_faults:
        cmd.append("--allow-faults")
    if cp_plan is not None:
        cmd += ["--cp-plan", cp_plan]
    return cmd


class Launch:
    """One running torchrun. `poll()` -> exit code or None; `kill()` ends it and every rank."""

    def __init__(self, cmd: list[str], log_path: Path, threads_per_rank: int | None = None):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        if threads_per_rank:  # the ranks share the machine's cores instead of each taking all of them
            env["OMP_NUM_THREADS"] = str(threads_per_rank)
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in `close`
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def poll(self) -> int | None:
        return self.proc.poll()

    def waiting(self) -> bool:
        """Whether the launch is still queued (a cluster job); a local launch starts at once."""
        return False

    def kill(self) -> None:
        for pid in [*_descendants(self.proc.pid), self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        self._log.close()

    def log_tail(self, chars: int = 2000) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace")
        return text[-chars:]


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc; elsewhere only the launcher itself is killed)."""
    if not Path("/proc").exists():
        return []
    children, out, todo = _children_map(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out
