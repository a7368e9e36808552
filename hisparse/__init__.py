"""hisparse: the CPU-extended C4 pool's working-set coordinator (DeepSeek-V4 HiSparse).

Each C4 layer attends to the indexer's top-k entries only, so most C4 KV is idle. The full C4 KV
lives in a pinned host mirror indexed by host page; the GPU keeps ``device_slots`` page-sized
slots per layer. `Coordinator.plan_step` decides, per layer-step, which missing pages to swap
in, which least recently used pages to evict, which written pages to back up, and translates
host pages to device slots. Pure: numpy only, no torch; the adapter executes the copies.
See docs/hisparse.md.
"""

from __future__ import annotations

from .config import HiSparseConfig
from .coordinator import Coordinator
from .errors import (
    ConfigError,
    DeviceBufferFull,
    HiSparseError,
    InvalidInputError,
    InvariantError,
    MissingPageDataError,
    PinnedPageError,
    TicketError,
)
from .ids import DeviceSlot, HostPage
from .results import BufferStats, CopyBatch, CopyKind, StepPlan

__all__ = [
    "BufferStats",
    "ConfigError",
    "Coordinator",
    "CopyBatch",
    "CopyKind",
    "DeviceBufferFull",
    "DeviceSlot",
    "HiSparseConfig",
    "HiSparseError",
    "HostPage",
    "InvalidInputError",
    "InvariantError",
    "MissingPageDataError",
    "PinnedPageError",
    "StepPlan",
    "TicketError",
]
