"""The environment fingerprint recorded with every row: versions, device, git state, host, time."""

from __future__ import annotations

import datetime
import os
import platform
import socket
import subprocess
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def fingerprint(device: str) -> dict:
    """The environment columns of the schema (all but `timestamp`, which each row sets when it finishes)."""
    import torch
    import transformers

    import cpbench

    cuda = device == "cuda" and torch.cuda.is_available()
    device_name = torch.cuda.get_device_name(0) if cuda else cpu_name()
    device_count = torch.cuda.device_count() if cuda else 0
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "cpbench_version": cpbench.__version__,
        "cuda_version": torch.version.cuda if cuda else None,
        "driver_version": _driver_version() if cuda else None,
        "device_name": device_name,
        "device_count": device_count,
        "hardware_id": f"{device_name} x {device_count}" if cuda else f"{device_name} x {os.cpu_count()} cpus",
        "git_commit": commit,
        "git_dirty": bool(status) if status is not None else None,
        "host": socket.gethostname(),
        "cpu_count": os.cpu_count(),
    }


def _driver_version() -> str | None:
    """The NVIDIA driver version, or None: without nvidia-ml-py the column is null by design (it is an optional
    dependency, and torch's own CUDA version is recorded anyway); an NVML failure is reported, not hidden."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
    except pynvml.NVMLError as e:
        warnings.warn(f"cpbench: driver_version is null: NVML failed: {e}", stacklevel=2)
        return None
    return v.decode() if isinstance(v, bytes) else v


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
