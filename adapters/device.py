"""Device selection with clear errors (no silent CPU fallback for an explicit request)."""

from __future__ import annotations

import torch

from shadowradix.errors import ShadowRadixError


class DeviceError(ShadowRadixError, ValueError):
    """The requested device does not exist or is not usable here."""


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
