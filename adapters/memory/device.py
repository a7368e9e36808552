"""Device selection with clear errors (no silent CPU fallback for an explicit request)."""

from __future__ import annotations

import os

import numpy as np
import torch

from shadowradix.errors import ShadowRadixError


class DeviceError(ShadowRadixError, ValueError):
    """The requested device does not exist or is not usable here."""


class PoolMemoryError(ShadowRadixError, ValueError):
    """The pools asked for do not fit in the device's free memory (raised before anything is
    allocated, so the caller can retry with smaller pools)."""


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` on ``device`` without waiting for the device: on CUDA a non-blocking copy from
    pinned memory, queued on the current stream (a blocking or pageable copy waits for the
    steps queued before it, which would undo overlap scheduling); elsewhere a plain copy."""
    host = torch.from_numpy(array)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)  # pragma: no cover - needs a GPU


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` / ``"auto"``: the first CUDA GPU if one is present, else the CPU. An explicit
    device must exist: ``"cuda"`` without a GPU raises `DeviceError`."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise DeviceError(f"not a device: {device!r} ({exc})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {device!r} requested but no CUDA GPU is available")
        index = dev.index or 0
        if index >= torch.cuda.device_count():
            raise DeviceError(f"device {device!r}: only {torch.cuda.device_count()} GPU(s)")
    elif dev.type != "cpu":
        raise DeviceError(f"unsupported device type {dev.type!r}; use 'cpu' or 'cuda'")
    return dev


def free_bytes(device: torch.device) -> int:
    """Memory free for new tensors on ``device``: CUDA's free bytes, or the host's available
    memory (``MemAvailable``; physical memory where /proc is missing)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # pragma: no cover


def check_pools_fit(need: int, device: torch.device, free: int | None = None) -> None:
    """Raises `PoolMemoryError` when ``need`` bytes of pools exceed what ``device`` has free
    (``free``: that figure, for tests)."""
    free = free_bytes(device) if free is None else free
    if need > free:
        raise PoolMemoryError(
            f"the pools need {need / 2**30:.2f} GiB but {device} has {free / 2**30:.2f} GiB "
            "free: lower the full / SWA pool sizes (the CLI's --full-tokens / --swa-tokens or "
            "--pool-budget-gib)"
        )
