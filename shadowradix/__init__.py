"""shadowradix: prefix-cache management for DeepSeek-V4-style hybrid sparse attention.

Pure core (no torch): a radix tree over virtual full-token slots with per-pool shadows
(SWA table, compressed arithmetic, ring rows), two-counter locks, tombstoning, LRU eviction
and bounded replay. See docs/design.md.
"""

from __future__ import annotations

from .allocator import PageAllocator, SwaPage, VirtualPage
from .cache import ShadowRadixCache
from .config import V4_FLASH_RATIOS, CacheConfig, StreamSpec, split_budget
from .deltas import PageTableDelta, TableChanges
from .errors import (
    CapacityError,
    ConfigError,
    InvalidRequestError,
    InvariantError,
    LockError,
    ShadowRadixError,
    StaleMatchError,
    StalePlanError,
)
from .events import KvEvent, KvEventKind
from .locks import LockReceipt, PinReceipt, Pool
from .relocation import PageMoves, RebalanceReport
from .request import Request, RequestState
from .results import (
    Allocation,
    CacheStats,
    EvictionReport,
    ExtendCheck,
    MatchResult,
    PoolStats,
    ReadPlan,
    StepPlan,
    StreamReads,
    StreamWrites,
    WindowSource,
)
from .transfer import export_layout, import_prefix, plan_import, release_layout
from .transfer_layout import (
    ImportPlan,
    ImportReceipt,
    ImportRefused,
    PageMap,
    PoolRegion,
    PrefixLayout,
    RefusalReason,
    pool_regions,
)

__version__ = "0.1.0"

__all__ = [
    "Allocation",
    "CacheConfig",
    "CacheStats",
    "CapacityError",
    "ConfigError",
    "EvictionReport",
    "ExtendCheck",
    "KvEvent",
    "KvEventKind",
    "InvalidRequestError",
    "InvariantError",
    "LockError",
    "LockReceipt",
    "PinReceipt",
    "MatchResult",
    "PageAllocator",
    "PageMoves",
    "PageTableDelta",
    "Pool",
    "PoolStats",
    "ReadPlan",
    "RebalanceReport",
    "Request",
    "RequestState",
    "ShadowRadixCache",
    "ShadowRadixError",
    "StaleMatchError",
    "StalePlanError",
    "StepPlan",
    "StreamReads",
    "StreamSpec",
    "StreamWrites",
    "SwaPage",
    "TableChanges",
    "V4_FLASH_RATIOS",
    "VirtualPage",
    "WindowSource",
    "split_budget",
    # prefix transfer between caches (transfer.py)
    "ImportPlan",
    "ImportReceipt",
    "ImportRefused",
    "PageMap",
    "PoolRegion",
    "PrefixLayout",
    "RefusalReason",
    "export_layout",
    "import_prefix",
    "plan_import",
    "pool_regions",
    "release_layout",
]
