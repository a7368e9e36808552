"""Programmatic dependent launch for Lightning TopK (Hopper+, Triton >= 3.3): the device
primitives (no-ops where this Triton lacks them) and whether a launch uses it."""

from __future__ import annotations

import os

import torch
import triton

try:  # programmatic dependent launch (Hopper+): Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAS_GDC = True
except ImportError:  # pragma: no cover - older Triton
    _HAS_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


def _use_pdl(device: torch.device, pdl: bool | None) -> bool:
    """Programmatic dependent launch: Hopper or newer, Triton with ``griddepcontrol``; on by
    default unless ``ADAPTERS_TOPK_PDL=0``."""
    if device.type != "cuda" or not _HAS_GDC or (pdl is not None and not pdl):
        return False
    if pdl is None and os.environ.get("ADAPTERS_TOPK_PDL", "1") == "0":  # pragma: no cover
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9  # pragma: no cover - needs a GPU
