"""Run a function on N ranks of a gloo process group on CPU, and get back what each rank returned.

`run_ranks(fn, world_size, *args)` starts `world_size` fresh processes (from a fork server, see `PRELOAD`) with RANK/WORLD_SIZE/LOCAL_RANK/
MASTER_ADDR/MASTER_PORT set as torchrun sets them (a free port each time), so the code under test initialises
torch.distributed exactly as it would under torchrun. Each rank's return value comes back pickled; a failing
rank's traceback is raised in the parent; ranks still running after `timeout` seconds are killed and reported.
`fn` must be importable (a module-level function).
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import re
import socket
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

PEER_GRACE_S = 10.0
# What a rank raises when a peer died (gloo's transport/tcp/pair.cc; torch's TCPStore where the dead rank hosted it),
# read in the exception's own line: the crash's echo, not an error of its own
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection was likely closed")


class RankFailure(RuntimeError):
    def __init__(self, message: str, signalled: bool = False):
        super().__init__(message)
        self.signalled = signalled  # a rank was killed by a signal it did not get from us (SIGSEGV, SIGABRT, ...)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank: int, world_size: int, port: int, out_dir: str, args: tuple, kwargs: dict) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    path = Path(out_dir) / f"rank{rank}.pkl"
    # A rank killed by a signal (a segfault in a kernel or in gloo) writes no result: faulthandler leaves the
    # Python stack of every thread at that moment, which the parent reports with the exit code.
    fault = open(Path(out_dir) / f"rank{rank}.fault", "w")  # noqa: SIM115 - open until the process ends
    faulthandler.enable(file=fault, all_threads=True)
    try:
        result = ("ok", fn(*args, **kwargs))
    except BaseException:  # noqa: BLE001 - the traceback is the result: the parent raises it
        result = ("error", traceback.format_exc())
    finally:
        import torch.distributed as dist

        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - keep the rank's own result; a failing teardown is reported beside it
            if result[0] == "ok":
                result = ("error", "destroy_process_group failed:\n" + traceback.format_exc())
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(result))
    tmp.replace(path)  # whole or absent: the parent polls for it


def run_ranks(fn, world_size: int, *args, timeout: float = 240.0, **kwargs) -> list:
    try:
        return _run_ranks(fn, world_size, args, kwargs, timeout)
    except RankFailure as e:
        # The free port is closed before rank 0's store binds it; in between another process may take it.
        if "Address already in use" in str(e) or "EADDRINUSE" in str(e):
            why = "the port was taken; once more on a new one"
        # A rank killed by a signal in native code once in hundreds of spawns (seen once in CI: a SIGSEGV in a
        # gloo step whose cases run clean under valgrind's memcheck and 30 reruns): once more, its stacks printed
        # and warned. A fault the code under test causes recurs on the second try and fails the test with both
        # reports; CPBENCH_SPAWN_RETRY=0 fails on the first (to count crashes in a stress run).
        elif e.signalled and os.environ.get("CPBENCH_SPAWN_RETRY", "1") != "0":
            why = "a rank was killed by a signal; once more"
        else:
            raise
        print(f"run_ranks: {why}. The first try said:\n{e}", file=sys.stderr)
        # a warning too: pytest drops a passing test's stderr, and keeps its warnings in the run's summary
        warnings.warn(f"run_ranks: {why} ({fn.__name__}, {world_size} ranks); the first try said: {e}", stacklevel=2)
        first = e
    try:
        return _run_ranks(fn, world_size, args, kwargs, timeout)
    except RankFailure as e:
        raise RankFailure(f"{e}\n\n(on the second try; the first said:)\n{first}", e.signalled) from None


# Ranks start from a fork server that has imported these once, not from a fresh interpreter each: importing
# torch and transformers is seconds of CPU per rank, paid by every spawn of every multi-rank test otherwise.
# The server is a clean process (it imports, it runs nothing, no thread pool exists yet), so a fork of it is as
# fresh as a spawn; cpbench itself is not preloaded (its import-time patching is under test). transformers.trainer is
# (the Trainer tests' ranks import it; cpbench wraps Trainer whether it was imported before or after cpbench).
PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.modeling_utils", "transformers.trainer",
           *(f"transformers.models.{m}.modeling_{m}" for m in ("llama", "qwen3", "mistral", "gemma3"))]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _run_ranks(fn, world_size: int, args: tuple, kwargs: dict, timeout: float) -> list:
    ctx = _context()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="cpbench-ranks-") as out_dir:
        procs = [
            ctx.Process(target=_child, args=(fn, r, world_size, port, out_dir, args, kwargs), daemon=False)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        _wait(procs, Path(out_dir), timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        # The report lists what ranks raised first and the crashes last, so a log's tail shows the crash's stacks
        results, raised, lost, crashed, signalled = [], [], [], [], False
        for r in range(world_size):
            f = Path(out_dir) / f"rank{r}.pkl"
            if not f.exists():
                results.append(None)
                if r not in hung:
                    signalled = signalled or (procs[r].exitcode or 0) < 0
                    crashed.append(f"rank {r} exited with code {procs[r].exitcode} and no result{_fault(out_dir, r)}")
                continue
            status, value = pickle.loads(f.read_bytes())
            results.append(value if status == "ok" else None)
            if status == "error":
                (lost if _peer_lost(value) else raised).append(f"rank {r} raised:\n{value}")
        if raised or lost or crashed:
            stopped = f"ranks {hung} were stopped {PEER_GRACE_S:.0f}s after a rank failed (blocked on it)"
            # run again only for a crash alone: where a rank raised an error of its own, its peers' signals may
            # follow from it; a peer that lost its connection to the crashed rank raised nothing of its own
            report = raised + lost + ([stopped] if hung else []) + crashed
            raise RankFailure("\n".join(report), signalled and not raised)
        if hung:
            raise RankFailure(f"ranks {hung} still running after {timeout:.0f}s and were killed")
        return results


def _peer_lost(traceback_text: str) -> bool:
    """Whether a rank's traceback ends in an exception that says a peer went away (`PEER_LOST`)."""
    lines = traceback_text.strip().splitlines()
    return bool(lines) and any(s in lines[-1] for s in PEER_LOST)


def _fault(out_dir: str, rank: int) -> str:
    """What faulthandler wrote as the rank died from a signal (the Python stack of each thread), or nothing."""
    f = Path(out_dir) / f"rank{rank}.fault"
    text = f.read_text(errors="replace").strip() if f.exists() else ""
    # Python 3.10+ ends the report with one line naming every loaded extension module (thousands of characters)
    text = re.sub(r"\n*Extension modules: .*", "", text).strip()
    return f"; its stacks when it died:\n{text}" if text else ""


def _wait(procs: list, out_dir: Path, timeout: float) -> None:
    """Until every rank exits, `timeout` passes, or `PEER_GRACE_S` after a rank reported an error or died (its peers
    are then most likely blocked in a collective with it, and would otherwise hold the test for the whole timeout)."""
    deadline, failed_at = time.monotonic() + timeout, None
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        # killed by a signal before its result (one that crashes after writing it ended its work: not a failure)
        died = any(p.exitcode not in (None, 0) and not (out_dir / f"rank{r}.pkl").exists() for r, p in enumerate(procs))
        if failed_at is None and (died or any(_failed(f) for f in out_dir.glob("rank*.pkl"))):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > PEER_GRACE_S:
            return
        time.sleep(0.05)


def _failed(result_file: Path) -> bool:
    return pickle.loads(result_file.read_bytes())[0] == "error"

