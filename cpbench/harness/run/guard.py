"""`python -m cpbench.harness.run.guard MODULE ARGS...`: runs MODULE as `__main__` in a process that dies with its
parent.

A sweep starts torch's launcher through it, and each rank calls `die_with_parent()` first, so a sweep killed without
a chance to clean up (kill -9, the kernel's OOM killer) takes its launch down with it instead of leaving ranks
running a point nobody will read, holding cores and memory. Linux's PR_SET_PDEATHSIG; elsewhere a no-op (the sweep
still kills its launch on Ctrl-C and SIGTERM: sweep._sigterm_as_interrupt).
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the call: no signal would ever come
        os._exit(1)


if __name__ == "__main__":
    die_with_parent()
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
