"""One writer per run folder: `writer(run_dir)` holds the folder's lock while a sweep, a projection or an external
run writes it. A second writer (the same `--run-name` twice, or `--resume` while another sweep writes) is refused
with the process that holds the lock, or, asked to, waits for it.

The lock is an OS file lock (filelock: `flock` on POSIX), so a holder that dies, even by kill -9, releases it with
its last open descriptor; the note of who holds it (`.writer.json`) is only read while the lock is held by someone
else, so a note a dead writer left behind is never believed.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from filelock import FileLock, Timeout

LOCK_FILE = ".writer.lock"
OWNER_FILE = ".writer.json"


class RunLocked(ValueError):
    """Another process is writing the run (a ValueError: the CLI refuses it with exit 2)."""


def holder(run_dir: Path) -> str:
    """Who holds the lock, as its note says (pid, host, command, since when)."""
    try:
        note = json.loads((Path(run_dir) / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return "another process (it left no note of itself yet)"
    return (f"process {note.get('pid')} on {note.get('host')} (`{note.get('command')}`, writing since "
            f"{note.get('since')})")


@contextlib.contextmanager
def writer(run_dir: str | os.PathLike, *, wait: bool = False, command: str | None = None,
           on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
    """Holds `run_dir`'s writer lock for the block. Held by another process: RunLocked naming it, or with `wait`,
    `on_wait(message)` once and then block until it is released."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(run_dir / LOCK_FILE)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        who = holder(run_dir)
        if not wait:
            raise RunLocked(
                f"{run_dir} is being written by {who}. Two writers would interleave their rows: wait for it to "
                "finish (pass --wait to queue behind it and then go on with what it left), or choose another "
                "--run-name.") from None
        if on_wait is not None:
            on_wait(f"waiting for {who} to finish writing {run_dir}")
        lock.acquire()
    owner = run_dir / OWNER_FILE
    note = {"pid": os.getpid(), "host": socket.gethostname(), "command": command or " ".join(sys.argv),
            "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        owner.write_text(json.dumps(note))
        yield
    finally:
        owner.unlink(missing_ok=True)
        lock.release()
