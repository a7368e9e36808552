"""Eviction and capacity: full eviction removes the least recently used unlocked leaves, SWA
eviction tombstones the oldest unprotected pages (node heads before any branch's tail window);
a step evicts from each pool only what that pool lacks; `rebalance` moves the live capacities
(evicting by count, then relocating the ids in use above a shrunk capacity: `relocation`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import slots
from .errors import CapacityError, ConfigError, InvalidRequestError
from .relocation import RebalanceReport, relocate
from .results import EvictionReport
from .validation import as_count

if TYPE_CHECKING:
    from .allocator import PageAllocator
    from .config import CacheConfig
    from .lru import LruIndex
    from .radix_tree import RadixTree

#: the report of an eviction that freed nothing
NO_EVICTION = EvictionReport()


class EvictionPolicy:
    """Mixed into `ShadowRadixCache` (see there for the state it names)."""

    if TYPE_CHECKING:
        config: CacheConfig
        _tree: RadixTree
        _index: LruIndex
        _full: PageAllocator
        _swa: PageAllocator
        _evicted_pages: list[int]

        def _debug_check(self) -> None: ...

    def evict(self, full_tokens: int = 0, swa_tokens: int = 0) -> EvictionReport:
        """Free at least this many tokens' pages per pool, if that many are evictable.

        Full eviction removes LRU unlocked leaves; SWA eviction tombstones the oldest
        unprotected pages, heads of nodes before any branch's tail window.
        """
        full, swa = as_count(full_tokens), as_count(swa_tokens)
        if full is None or swa is None:
            raise InvalidRequestError("eviction sizes must be non-negative ints (tokens)")
        p = self.config.page_size
        num_full, num_swa = slots.num_pages(full, p), slots.num_pages(swa, p)
        report = self._evict_full(num_full) + self._evict_swa(num_swa)
        self._debug_check()
        return report

    def eviction_ages(self) -> tuple[int | None, int | None]:
        """How long ago (in tree accesses: admissions, inserts, finishes) the next full and SWA
        eviction victims were last used. ``None``: nothing evictable in the pool, or, for SWA,
        a victim at a node's head, before its tail window (no match can end there, so losing
        it costs no hit). A pool whose victims are young evicts what it still needs; one whose
        victims are old holds slack (`adapters.memory.pool_balance` moves memory on this). Mutates
        nothing."""
        clock = self._tree.clock
        full, swa = self._index.oldest_full_leaf(), self._index.oldest_swa()
        swa_age = None
        if swa is not None:
            tier0_end, _, live_from = swa.lru_tiers
            swa_age = None if tier0_end > live_from else clock - swa.last_access
        return (None if full is None else clock - full.last_access, swa_age)

    def _reserve(self, full_pages: int, swa_pages: int) -> EvictionReport:
        """Make sure the pages can be had (else raise, changing nothing), evicting if needed."""
        if full_pages > self._full.num_free or swa_pages > self._swa.num_free:
            self._ensure_capacity(full_pages, swa_pages)
            return self._make_room(full_pages, swa_pages)
        return NO_EVICTION

    def _ensure_capacity(self, full_pages: int, swa_pages: int) -> None:
        if full_pages > self._full.num_free:
            available = self._full.num_free + self._index.full_evictable
            if full_pages > available:
                raise CapacityError("full", full_pages, available)
        if swa_pages > self._swa.num_free:
            available = self._swa.num_free + self._index.swa_evictable
            if swa_pages > available:
                raise CapacityError("swa", swa_pages, available)

    def _make_room(self, full_pages: int, swa_pages: int) -> EvictionReport:
        """Evict from each pool only what it lacks (the pool that failed is the one evicted)."""
        full = self._evict_full(full_pages - self._full.num_free)
        swa = self._evict_swa(swa_pages - self._swa.num_free)
        return swa if full is NO_EVICTION else full if swa is NO_EVICTION else full + swa

    def _evict_full(self, num_pages: int) -> EvictionReport:
        if num_pages <= 0:
            return NO_EVICTION
        freed = swa = removed = 0
        index, tree = self._index, self._tree
        while freed < num_pages:
            leaf = index.oldest_full_leaf()
            if leaf is None:
                break
            vpages, swa_pages = tree.remove_leaf(leaf)
            self._full.free(vpages)
            self._swa.free(swa_pages)
            freed, swa, removed = freed + len(vpages), swa + len(swa_pages), removed + 1
        total = self._evicted_pages
        total[0], total[1], total[2] = total[0] + freed, total[1] + swa, total[2] + removed
        return EvictionReport(freed, swa, removed, 0)

    def _evict_swa(self, num_pages: int) -> EvictionReport:
        if num_pages <= 0:
            return NO_EVICTION
        freed = tombstoned = 0
        index, tree = self._index, self._tree
        while freed < num_pages:
            node = index.oldest_swa()  # its tiers are up to date
            if node is None:
                break
            tier0_end, tier1_end, live_from = node.lru_tiers
            avail = (tier0_end if tier0_end > live_from else tier1_end) - live_from
            pages = tree.tombstone(node, min(avail, num_pages - freed))
            self._swa.free(pages)
            freed, tombstoned = freed + len(pages), tombstoned + 1
        total = self._evicted_pages
        total[1], total[3] = total[1] + freed, total[3] + tombstoned
        return EvictionReport(0, freed, 0, tombstoned)

    def rebalance(
        self, full_capacity: int | None = None, swa_capacity: int | None = None
    ) -> RebalanceReport:
        """Move the live pool capacities (tokens) within their configured maxima at run time.

        Shrinking evicts what no longer fits by count, then moves every page id in use at or
        above the new capacity to a free id below it (`relocation`): the report names the moves
        (the adapter copies those pages' rows, then resizes its pools) and the page-table
        changes of the requests that held one. Raises `ConfigError` for a bad size and
        `CapacityError` when locked or request-held pages exceed the new size, changing
        nothing either way.
        """
        targets = self._rebalance_targets(full_capacity, swa_capacity)
        before = (self._full.capacity, self._swa.capacity)
        excess = [max(0, a.num_used - t) for a, t in zip((self._full, self._swa), targets)]
        self._ensure_capacity(excess[0] + self._full.num_free, excess[1] + self._swa.num_free)
        evicted = self._evict_full(excess[0]) + self._evict_swa(
            max(0, self._swa.num_used - targets[1])
        )
        full_moves, swa_moves, changes = relocate(self, targets[0], targets[1])  # type: ignore[arg-type]
        self._debug_check()
        return RebalanceReport(
            evicted.full_pages,
            evicted.swa_pages,
            evicted.nodes_removed,
            evicted.nodes_tombstoned,
            (before[0], targets[0]),
            (before[1], targets[1]),
            full_moves,
            swa_moves,
            changes,
        )

    def _rebalance_targets(
        self, full_capacity: int | None, swa_capacity: int | None
    ) -> tuple[int, int]:
        """The new capacities in pages (``None``: unchanged), or `ConfigError`."""
        p = self.config.page_size
        targets = []
        for name, alloc, value in (
            ("full", self._full, full_capacity),
            ("swa", self._swa, swa_capacity),
        ):
            if value is None:
                targets.append(alloc.capacity)
                continue
            count = as_count(value)
            if count is None:
                raise ConfigError(f"{name} capacity must be an int number of tokens, got {value!r}")
            if count == 0 or count % p or count // p > alloc.max_pages:
                raise ConfigError(
                    f"{name} capacity must be a multiple of {p} in (0, {alloc.max_pages * p}]"
                )
            targets.append(count // p)
        if targets[1] < self.config.window_pages + 1:
            raise ConfigError("swa capacity must hold at least one request's window")
        return targets[0], targets[1]
