"""The device's used memory as NVML (nvidia-ml-py) sees it: all processes on the GPU, or on the MIG instance.

torch numbers its CUDA devices after CUDA_VISIBLE_DEVICES (as SLURM sets it), NVML physically: the device's UUID
names the same device in both. A MIG instance (CUDA_VISIBLE_DEVICES=MIG-..., or a job given one slice) has a UUID
of its own that NVML's GPU lookup does not know: it is found among the MIG devices of the MIG-enabled GPUs, and its
memory is the instance's (another instance's tenants are not counted).
"""

from __future__ import annotations

import threading
import time

import torch


class NvmlSampler:
    """Samples the device's used memory (all processes) every `interval_s` while entered; keeps the max."""

    def __init__(self, device_index: int, interval_s: float = 0.005):
        self.peak: int | None = None
        self.interval_s = interval_s
        self.error: str | None = None  # why `peak` is null (or partial); goes into the row's status_detail
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = nvml_handle(pynvml, device_index)
            self._read = lambda: pynvml.nvmlDeviceGetMemoryInfo(self._handle).used
        except Exception as e:  # noqa: BLE001 - NVML is optional: the column is null and the row says why
            self._read = None
            self.error = f"NVML unavailable, device_peak_bytes is null: {type(e).__name__}: {e}"

    def __enter__(self):
        if self._read is None:
            return self
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def _loop(self):
        while not self._stop.is_set():
            try:
                used = self._read()
            except Exception as e:  # noqa: BLE001 - recorded (see `error`); the measurement goes on without it
                self.error = f"NVML sampling failed, device_peak_bytes is partial: {type(e).__name__}: {e}"
                return
            self.peak = used if self.peak is None else max(self.peak, used)
            time.sleep(self.interval_s)

    def __exit__(self, *exc):
        if self._read is not None:
            self._stop.set()
            self._thread.join()
        return False


def nvml_handle(pynvml, device_index: int):
    """NVML's handle of torch's CUDA device `device_index`: the GPU, or the MIG instance, with its UUID."""
    return handle_by_uuid(pynvml, str(torch.cuda.get_device_properties(device_index).uuid))


def handle_by_uuid(pynvml, uuid: str):
    """The handle of the GPU or MIG instance `uuid` names: a bare UUID (torch's form), "GPU-<uuid>", "MIG-<uuid>"
    or the legacy "MIG-GPU-<gpu uuid>/<gi>/<ci>" (drivers before R470)."""
    if not uuid.startswith("MIG-"):
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        except pynvml.NVMLError as e:
            gpu_error = e  # not a GPU: a MIG instance's UUID is bare in torch too; looked for below
    else:
        gpu_error = None
    handle = mig_handle(pynvml, uuid)
    if handle is None:
        raise LookupError(
            f"NVML knows no GPU or MIG instance with UUID {uuid!r} (GPU lookup: {gpu_error}; searched the MIG "
            f"instances of every MIG-enabled GPU): is this process's CUDA device on this host's driver?")
    return handle


def mig_handle(pynvml, uuid: str):
    """The MIG instance `uuid` names, or None. GPUs that cannot do MIG (NVML: not supported) are skipped; any
    other NVML error is raised."""
    want = _uuid_key(uuid)
    enabled = getattr(pynvml, "NVML_DEVICE_MIG_ENABLE", 1)
    for i in range(pynvml.nvmlDeviceGetCount()):
        gpu = pynvml.nvmlDeviceGetHandleByIndex(i)
        try:
            current_mode, _pending = pynvml.nvmlDeviceGetMigMode(gpu)
        except pynvml.NVMLError as e:
            if _is_not_supported(pynvml, e):
                continue
            raise
        if current_mode != enabled:
            continue
        for j in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu)):
            try:
                mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, j)
            except pynvml.NVMLError as e:
                if _is_not_found(pynvml, e):  # an empty slot: instances need not fill the indices
                    continue
                raise
            if _uuid_key(_text(pynvml.nvmlDeviceGetUUID(mig))) == want:
                return mig
    return None


def _uuid_key(uuid: str) -> str:
    """One spelling per device: lower case, without the "MIG-" / "GPU-" prefixes (the legacy MIG form keeps its
    "/gi/ci" tail, so it matches only itself: it names the instance by its GPU, not by a UUID of its own)."""
    key = uuid.strip().lower()
    for prefix in ("mig-", "gpu-"):
        key = key.removeprefix(prefix)
    return key


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _is_not_supported(pynvml, e) -> bool:
    return getattr(e, "value", None) == getattr(pynvml, "NVML_ERROR_NOT_SUPPORTED", 3)


def _is_not_found(pynvml, e) -> bool:
    return getattr(e, "value", None) == getattr(pynvml, "NVML_ERROR_NOT_FOUND", 6)
