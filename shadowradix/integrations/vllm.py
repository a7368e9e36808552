"""A vLLM-shaped KV-cache manager over `ShadowRadixCache`: the method names and semantics of
vLLM 0.33's ``KVCacheManager``, with arguments and results as records of our own
(`vllm_types`; no vllm import).

How vLLM's scheduler calls it, and what each call does here::

    blocks, n, _ = get_computed_blocks(request)     waiting request: pure lookup, leaving the
                                                    last token to compute
    new = allocate_slots(request, k, n, blocks)     admit at that hit and compute k tokens, or
                                                    None (nothing admitted): try later
    new = allocate_slots(request, k)                running request: first publish what its
                                                    earlier steps computed (cache_unfinished),
                                                    then k more tokens, or None: preempt
    free(request)                                   finished or preempted: insert and release

vLLM caches a block as soon as it is scheduled; shadowradix inserts only computed pages, so a
running request's pages are inserted at its next ``allocate_slots`` (its previous step has run
by then) and at ``free``. A request preempted before its scheduled step ran
(``num_computed_tokens`` still short of what was allocated) is aborted instead: the step's
tokens were never computed, and what it inserted earlier stays cached.

Block tables, groups and events: `vllm_types` and `vllm_events`. Speculative lookahead, KV
connectors, encoder tokens and reserved blocks are not supported (`InvalidRequestError`); use
the core's ``extend_draft`` / ``rollback`` for drafts. What else differs from vLLM 0.33:
docs/integrations.md.
"""

from __future__ import annotations

import numpy as np

from .. import slots
from ..cache import ShadowRadixCache
from ..config import CacheConfig
from ..deltas import PageTableDelta
from ..errors import CapacityError, InvalidRequestError
from ..locks import Pool
from ..request import Request as CoreRequest
from ..results import Allocation, StepPlan
from ..results import MatchResult as CoreMatch
from ..validation import as_tokens
from .admission import admit_and_extend
from .paths import prefix_vpages, window_swa_pages
from .vllm_events import EventTranslator
from .vllm_types import (
    AllBlocksCleared,
    BlockIds,
    KVCacheBlocks,
    KVCacheEvent,
    KVCacheGroup,
    PrefixCacheStats,
    Request,
    TableDelta,
)

__all__ = ["ShadowRadixKVCacheManager", "Request", "KVCacheBlocks"]

_Tables = tuple[list[int | None], list[int | None]]


class _Told:
    """What the engine was last told of one request: its two tables (SWA entries before
    ``swa_base`` are ``None``), and the core's deltas since, not yet reported."""

    __slots__ = ("tables", "swa_base", "pending")

    def __init__(self, tables: _Tables, swa_base: int) -> None:
        self.tables, self.swa_base = tables, swa_base
        self.pending: list[PageTableDelta] = []


class ShadowRadixKVCacheManager:
    """``KVCacheManager`` over a `ShadowRadixCache` made from ``config`` (``.cache``)."""

    def __init__(
        self, config: CacheConfig, *, log_stats: bool = False, enable_kv_cache_events: bool = False
    ) -> None:
        self.cache = ShadowRadixCache(config, kv_events=enable_kv_cache_events)
        self.log_stats = log_stats
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_cache_groups = (
            KVCacheGroup("full", Pool.FULL, config.page_size, None, config.ratios),
            KVCacheGroup("swa", Pool.SWA, config.page_size, config.window, config.ratios),
        )
        self.num_kv_cache_groups = len(self.kv_cache_groups)
        self._p = config.page_size
        self._running: dict[str, CoreRequest] = {}
        self._told: dict[str, _Told] = {}  # what the engine was last told
        self._events = EventTranslator(config.page_size)
        self._stats = [False, 0, 0, 0, 0, 0, 0]  # PrefixCacheStats fields, in order

    @property
    def usage(self) -> float:
        """Used fraction of the full (virtual) pool."""
        return self.cache.stats().full.used_fraction

    # -- lookup and allocation -------------------------------------------------------------

    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int]:
        """The cached prefix a waiting request can resume after (whole pages, at most
        ``max_cache_hit_length``, by default ``num_tokens - 1``), its length, and vLLM's
        ``shared_prefix_boundary`` (always 0: the SWA windows here are tombstoned per node and
        replayed, no junction to pin). Pure."""
        tokens = _tokens_of(request)
        limit = len(tokens) - 1
        if max_cache_hit_length is not None:
            limit = min(limit, _count(max_cache_hit_length, "max_cache_hit_length", minimum=0))
        match = self.cache.match_prefix(tokens, limit, namespace=request.namespace)
        hit = tuple(tuple(t) for t in _hit_tables(match, self.cache.config))
        return KVCacheBlocks(hit, match=match), match.prefix_len, 0

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> KVCacheBlocks | None:
        """Slots for the next ``num_new_tokens`` of ``request``: the blocks allocated now, or
        ``None`` when the pools cannot supply them even after evicting (nothing changed, but a
        running request's earlier steps got published). A waiting request is admitted at
        ``new_computed_blocks`` (from `get_computed_blocks`; ``num_new_computed_tokens`` must be
        its length) or, without it, from scratch. Bad input raises `InvalidRequestError`.
        ``full_sequence_must_fit``: ``None`` unless the request's tokens left fit now (its full
        pages; the SWA pages of a window and this chunk, `_fits_whole`);
        ``has_scheduled_reqs`` and ``skip_zeroing_group_ids`` change nothing here (no block is
        zeroed); lookahead, external, encoder tokens and ``reserved_blocks`` are refused."""
        n = _count(num_new_tokens, "num_new_tokens", minimum=1)
        for name, value in (("num_lookahead_tokens", num_lookahead_tokens),
                            ("num_external_computed_tokens", num_external_computed_tokens),
                            ("num_encoder_tokens", num_encoder_tokens),
                            ("reserved_blocks", reserved_blocks)):  # fmt: skip
            if _count(value, name, minimum=0):
                raise InvalidRequestError(f"{name} is not supported by this shim")
        tokens = _tokens_of(request)
        whole = bool(full_sequence_must_fit)
        kv = self._running.get(request.request_id)
        if kv is None:
            return self._admit(request, tokens, n, num_new_computed_tokens, new_computed_blocks,
                               whole)  # fmt: skip
        if request.num_computed_tokens != kv.length:
            raise InvalidRequestError(
                f"{request.request_id}: {request.num_computed_tokens} computed tokens, "
                f"but {kv.length} were allocated"
            )
        chunk = _span(tokens, kv.length, n)
        as_tokens(chunk, "the request's tokens")  # bad input: refused before anything changes
        if whole and not self._fits_whole(len(tokens), kv.length, n):
            return None
        told = self._told[request.request_id]
        if not delay_cache_blocks and kv.num_committed // self._p > kv.tree_pages:
            # its previous steps have run: publish them (deduplication may rewrite entries)
            told.pending += self.cache.cache_unfinished(kv).deltas
            self._drain()
        if not self.cache.can_extend([kv], [n]):
            return None
        plan = self.cache.extend(kv, chunk)
        self._drain()
        return self._report(told, plan, None)

    def _admit(
        self,
        request: Request,
        tokens: list[int],
        n: int,
        num_computed: int,
        computed: KVCacheBlocks | None,
        whole: bool,
    ) -> KVCacheBlocks | None:
        if request.num_computed_tokens != 0:
            raise InvalidRequestError(f"{request.request_id} is not running: 0 tokens computed")
        if computed is None:
            match = self.cache.match_prefix(tokens, 0, namespace=request.namespace)
        elif isinstance(computed, KVCacheBlocks) and isinstance(computed.match, CoreMatch):
            match = computed.match
        else:
            raise InvalidRequestError("new_computed_blocks must come from get_computed_blocks")
        if match.namespace != request.namespace:  # another adapter's / salt's prefix
            raise InvalidRequestError(
                f"{request.request_id}: the computed blocks were looked up in namespace "
                f"{match.namespace!r}, the request's is {request.namespace!r}"
            )
        if num_computed != match.prefix_len:
            raise InvalidRequestError(
                f"num_new_computed_tokens={num_computed}, the computed blocks hold "
                f"{match.prefix_len}"
            )
        chunk = _span(tokens, match.prefix_len, n)
        if whole and not self._fits_whole(len(tokens), match.prefix_len, n):
            return None
        try:
            kv, allocation = admit_and_extend(self.cache, tokens, match, chunk)
        except CapacityError:
            return None
        self._running[request.request_id] = kv
        # what the engine holds: the hit's blocks as reported at lookup (the prefix's pages are
        # fixed while the match is valid; reading them through its node now would not be)
        hit = computed.blocks if computed is not None else ((), ())
        told = self._told[request.request_id] = _Told((list(hit[0]), list(hit[1])), kv.swa_base)
        if kv.replay_allocation is not None:  # the replayed window's private SWA: not in the hit
            end = match.prefix_len // self._p
            window = tuple(kv.swa_pages[: end - kv.swa_base])
            told.pending.append(PageTableDelta(kv.id, Pool.SWA, kv.swa_base, window, end,
                                               kv.swa_base))  # fmt: skip
        self._record(request, match.hit_len)
        self._drain()
        return self._report(told, allocation, kv.replay_allocation)

    def _fits_whole(self, total: int, start: int, n: int) -> bool:
        """vLLM's ``full_sequence_must_fit`` gate, changing nothing: the full pages of tokens
        ``[start, total)`` and, the SWA pool holding a window and a chunk at a time as vLLM
        caps sliding-window groups, the SWA pages of the window plus this ``n``-token chunk,
        each within its pool's free and evictable pages."""
        p, st = self._p, self.cache.stats()
        full = slots.num_pages(total, p) - slots.page_of(start, p)
        swa = min(full, slots.num_pages(self.cache.config.window + n, p) + 1)
        return (full <= st.full.free_pages + st.full.evictable_pages
                and swa <= st.swa.free_pages + st.swa.evictable_pages)  # fmt: skip

    def free(self, request: Request) -> None:
        """Release a finished or preempted request: insert its computed pages and release the
        rest (abort if its last allocation was never computed). Unknown requests: no-op."""
        _tokens_of(request)  # a Request, or InvalidRequestError
        kv = self._running.pop(request.request_id, None)
        if kv is None:
            return
        del self._told[request.request_id]
        if request.num_computed_tokens >= kv.length:
            self.cache.finish(kv)
        else:
            self.cache.abort(kv)
        self._drain()

    # -- tables ------------------------------------------------------------------------------

    def get_block_ids(self, request_id: str) -> BlockIds:
        """Each group's block table of a running request (`vllm_types` on the layout)."""
        return _tables_of(self.kv_request(request_id))

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(tuple(t) for t in self.get_block_ids(request_id)))

    def kv_request(self, request_id: str) -> CoreRequest:
        """The core request behind a running ``request_id`` (for read plans)."""
        kv = self._running.get(request_id)
        if kv is None:
            raise InvalidRequestError(f"{request_id!r} has no slots allocated")
        return kv

    def _report(self, told: _Told, plan: StepPlan, replay: Allocation | None) -> KVCacheBlocks:
        """The blocks appended and each table's change since the last report, from the core's
        deltas (cache_unfinished's, then the step's) applied to what the engine was told: no
        table is diffed."""
        told.pending += plan.deltas
        sizes = [len(t) for t in told.tables]
        first = sizes[:]
        for delta in told.pending:
            g = 0 if delta.pool is Pool.FULL else 1
            first[g] = min(first[g], _apply(told.tables[g], delta, told.swa_base if g else 0))
            if g:
                told.swa_base = delta.base_page
        told.pending = []
        new = tuple(tuple(t[n:]) for t, n in zip(told.tables, sizes))
        deltas = tuple(TableDelta(f, tuple(t[f:])) for t, f in zip(told.tables, first))
        return KVCacheBlocks(new, deltas, plan, replay)

    # -- events, reset, stats ----------------------------------------------------------------

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events.events = self._events.events, []
        return events

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix; ``False`` (nothing changed) while requests hold slots."""
        try:
            self.cache.reset()
        except InvalidRequestError:
            return False
        if self.enable_kv_cache_events:
            self.cache.take_events()  # the per-page EVICTED events: one AllBlocksCleared instead
            self._events.events.append(AllBlocksCleared())
        self._stats[0] = True
        return True

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The stats since the last call (and start afresh); ``None`` unless ``log_stats``."""
        if not self.log_stats:
            return None
        reset, *counts = self._stats
        self._stats = [False, 0, 0, 0, 0, 0, 0]
        return PrefixCacheStats(bool(reset), *(int(c) for c in counts))

    def _record(self, request: Request, hits: int) -> None:
        base = 4 if request.num_preemptions > 0 else 1
        self._stats[base] += 1
        self._stats[base + 1] += request.num_tokens
        self._stats[base + 2] += hits

    def _drain(self) -> None:
        if self.enable_kv_cache_events:
            self._events.add(self.cache.take_events())


def _tokens_of(request: Request) -> list[int]:
    if not isinstance(request, Request):
        raise InvalidRequestError(f"expected a Request, got {type(request).__name__}")
    return request.all_token_ids


def _count(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise InvalidRequestError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _span(tokens: list[int], start: int, n: int) -> list[int]:
    if start + n > len(tokens):
        raise InvalidRequestError(f"{n} tokens from {start} run past the request's {len(tokens)}")
    return tokens[start : start + n]


def _tables_of(kv: CoreRequest) -> _Tables:
    swa: list[int | None] = [None] * kv.swa_base
    return list(kv.vpages), swa + list(kv.swa_pages)


def _hit_tables(match: CoreMatch, config: CacheConfig) -> _Tables:
    """The tables a request admitted at ``match`` starts with (its hit's blocks)."""
    first = max(0, match.prefix_len - config.window) // config.page_size
    swa: list[int | None] = [None] * first
    return list(prefix_vpages(match)), swa + list(window_swa_pages(match, first))


def _apply(table: list[int | None], delta: PageTableDelta, base: int) -> int:
    """Apply a core delta to an engine-shaped table (entries before the base are ``None``);
    returns the first entry it changed."""
    end = delta.num_pages
    del table[end:]
    table.extend([None] * (end - len(table)))
    dropped = range(base, min(delta.base_page, end))
    for i in dropped:
        table[i] = None
    table[delta.first_page : delta.first_page + len(delta.pages)] = delta.pages
    first = min(delta.first_page, end)
    return min(first, base) if len(dropped) else first
