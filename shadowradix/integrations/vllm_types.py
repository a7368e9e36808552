"""The arguments and results of the vLLM-shaped shim (`vllm`), named and shaped as in vLLM
0.33's ``v1/core/kv_cache_manager.py``, ``v1/metrics/stats.py`` and ``distributed/kv_events.py``:
plain records of our own (no vllm import). Only the fields the shim reads or fills are here.

KV-cache groups. vLLM gives every group its own block table; shadowradix has two page pools
and every other pool is arithmetic on one of them (design.md §2), so there are two groups:

* group 0, ``"full"``: virtual pages, one per page of the request. Every compressed stream's
  entries live at ``vpage * slots_per_page + ...`` (`CacheConfig.compressed_capacity`), so a
  stream is a view of this table, not a group of its own.
* group 1, ``"swa"``: SWA pages of the window; every stream's in-flight ring rows live at
  ``swa_page * ring_len + ...``. Positional like vLLM's sliding-window groups: entry ``j`` is
  page ``j``'s SWA page, ``None`` for pages the window has left (vLLM puts its null block
  there; shadowradix's page 0 is a real page, so there is no id to spare).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from ..locks import Pool
from ..results import Allocation
from ..results import MatchResult as CoreMatch

BlockIds = tuple[list[int | None], ...]


@dataclass(eq=False)
class Request:
    """The scheduler's request as the manager reads it. The scheduler owns every field: it
    appends sampled tokens to ``output_token_ids``, advances ``num_computed_tokens`` after
    scheduling (as vLLM's ``_update_after_schedule``), resets it to 0 and counts
    ``num_preemptions`` when it preempts."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    lora_int_id: int | None = None
    cache_salt: str | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def namespace(self) -> Hashable:
        """The prefix namespace: requests of different LoRA adapters or cache salts never
        share a cached prefix (vLLM puts both in its block hashes)."""
        if self.lora_int_id is None and self.cache_salt is None:
            return None
        return (self.lora_int_id, self.cache_salt)


@dataclass(frozen=True)
class KVCacheGroup:
    """One block table of a request: its pool, page size, and what addresses it."""

    name: str
    pool: Pool
    block_size: int
    sliding_window: int | None
    stream_ratios: tuple[int, ...]


@dataclass(frozen=True)
class TableDelta:
    """How one group's block table changed: from ``first_page`` on it is now ``block_ids``
    (so its length is ``first_page + len(block_ids)``). Inserting can replace a request's pages
    with the tree's copies of the same prefix; the window's trim turns entries to ``None``."""

    first_page: int
    block_ids: tuple[int | None, ...]


@dataclass(frozen=True)
class KVCacheBlocks:
    """Blocks per KV-cache group. From ``get_computed_blocks``: the hit's blocks (``match`` is
    the core's match, which ``allocate_slots`` admits at). From ``allocate_slots``: the blocks
    allocated now (appended to each table), every table's ``deltas`` since the last report, the
    step's ``allocation`` (every pool's slots, for the executor) and, on an admission whose hit
    replays its window, the ``replay`` to run first."""

    blocks: tuple[tuple[int | None, ...], ...]
    deltas: tuple[TableDelta, ...] = ()
    allocation: Allocation | None = None
    replay: Allocation | None = None
    match: CoreMatch | None = field(default=None, repr=False)

    def get_block_ids(
        self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None
    ) -> BlockIds | None:
        """Each group's block ids (``group_ids``: those groups only); ``None`` with
        ``allow_none`` when every selected group is empty (as vLLM's)."""
        groups = self.blocks if group_ids is None else tuple(self.blocks[g] for g in group_ids)
        if allow_none and all(len(group) == 0 for group in groups):
            return None
        return tuple(list(group) for group in groups)

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        """The blocks of both, group by group (what vLLM's scheduler adds up)."""
        if not isinstance(other, KVCacheBlocks) or len(other.blocks) != len(self.blocks):
            return NotImplemented
        return KVCacheBlocks(tuple((*a, *b) for a, b in zip(self.blocks, other.blocks)))


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix-cache hits since the last ``make_prefix_cache_stats``, recorded at admission:
    ``queries`` tokens looked up, ``hits`` reused (a window-replayed hit counts only what it
    skipped); requests that were preempted before are counted apart."""

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0


@dataclass(frozen=True)
class BlockStored:
    """Blocks of one group joined the cache (``parent_block_hash``: the block before the
    first, ``None`` at the root). Hashes are the core's chained page hashes."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    group_idx: int


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks of one group left the cache (group 1 alone: the window's SWA was tombstoned,
    the compressed KV stays)."""

    block_hashes: tuple[int, ...]
    group_idx: int


@dataclass(frozen=True)
class AllBlocksCleared:
    """``reset_prefix_cache`` dropped everything."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
