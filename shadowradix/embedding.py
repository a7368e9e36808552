"""The verbs an engine embedding the cache calls besides the request lifecycle: the
non-raising capacity check, external pins, KV events, interval metrics and reset
(`ShadowRadixCache` inherits them; they read its state and change it only through its
tree, locks and eviction)."""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterator, Sequence
from typing import TYPE_CHECKING

from . import slots
from .errors import ConfigError, InvalidRequestError, LockError
from .events import KvEvent
from .locks import PinReceipt
from .metrics import IntervalMetrics
from .results import EvictionReport, ExtendCheck, WindowSource

if TYPE_CHECKING:
    import numpy as np

    from .allocator import PageAllocator
    from .config import CacheConfig
    from .locks import LockTable
    from .lru import LruIndex
    from .radix_tree import RadixTree
    from .request import Request
    from .results import CacheStats, MatchResult

    TokenInput = Sequence[int] | np.ndarray


def _positive_count(value: object) -> int | None:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        return None
    n = value.__index__()  # type: ignore[attr-defined]
    return n if n > 0 else None


class EmbedderVerbs:
    """Mixed into `ShadowRadixCache` (see there for the state it names)."""

    if TYPE_CHECKING:
        config: CacheConfig
        _tree: RadixTree
        _locks: LockTable
        _full: PageAllocator
        _swa: PageAllocator
        _index: LruIndex
        _requests: dict[int, Request]
        _pins: dict[int, PinReceipt]
        _pin_ids: Iterator[int]
        _metrics_mark: tuple[CacheStats, float]

        def match_prefix(self, tokens: TokenInput, max_len: int | None = None, *,
                         namespace: Hashable = None) -> MatchResult: ...  # fmt: skip
        def stats(self) -> CacheStats: ...
        def _check_batch(
            self, requests: Sequence[Request], tokens: Sequence[TokenInput] | np.ndarray
        ) -> None: ...
        def _pages_needed(self, request: Request, num_tokens: int) -> tuple[int, int]: ...
        def _evict_full(self, num_pages: int) -> EvictionReport: ...
        def _debug_check(self) -> None: ...

    def can_extend(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> ExtendCheck:
        """Whether `extend_batch` giving ``num_tokens[i]`` committed tokens to ``requests[i]``
        would find its pages now (evicting what it may), without changing anything: the typed,
        non-raising form of its capacity check (a scheduler's admission test). Bad requests or
        counts (not positive ints) raise `InvalidRequestError` as `extend_batch` would."""
        given = (
            [_positive_count(n) for n in num_tokens] if isinstance(num_tokens, Sequence) else [None]
        )
        counts = [n for n in given if n]
        if len(counts) != len(given):
            raise InvalidRequestError(f"num_tokens must be positive ints, got {num_tokens!r}")
        self._check_batch(requests, [[0]] * len(counts))  # the same checks as extend_batch
        needs = [self._pages_needed(r, n) for r, n in zip(requests, counts)]
        return ExtendCheck(
            sum(n[0] for n in needs),
            sum(n[1] for n in needs),
            self._full.num_free + self._index.full_evictable,
            self._swa.num_free + self._index.swa_evictable,
        )

    def pin(self, tokens: TokenInput, *, namespace: Hashable = None) -> PinReceipt:
        """Keep the reusable prefix of ``tokens`` (what `match_prefix` finds: its compressed KV,
        and its window's SWA when live) from eviction until `unpin`: for a prefill-decode
        sender while it transfers, or an offload write-through. Splits a node if the prefix
        ends inside one. A prefix with nothing to reuse gives a receipt of 0 tokens."""
        match = self.match_prefix(tokens, namespace=namespace)
        p, node = self.config.page_size, match.node
        if 0 < match.node_pages < node.num_pages:
            node = self._tree.split(node, match.node_pages)
        full = None if node.is_root else self._locks.lock_full(node)
        swa = None
        if match.window is WindowSource.LIVE:
            first = slots.window_first_page(match.prefix_len, self.config.window, p)
            if first < slots.page_of(match.prefix_len, p):
                swa = self._locks.lock_swa(node, first)
        tokens_pinned = (node.end_page * p) if full is not None else 0
        receipt = PinReceipt(next(self._pin_ids), tokens_pinned, full, swa)
        self._pins[receipt.id] = receipt
        self._debug_check()
        return receipt

    def unpin(self, receipt: PinReceipt) -> None:
        """Release a `pin`. Raises `LockError` for a receipt that is not live here (unpinned
        already, or another cache's), changing nothing."""
        if not isinstance(receipt, PinReceipt) or self._pins.get(receipt.id) is not receipt:
            raise LockError(f"{receipt!r} is not a live pin of this cache: double unpin?")
        del self._pins[receipt.id]
        for lock in (receipt.swa, receipt.full):
            if lock is not None:
                self._locks.unlock(lock)
        self._debug_check()

    def take_events(self) -> list[KvEvent]:
        """The `KvEvent`s since the last call, oldest first (pages inserted, evicted,
        tombstoned, revived; `shadowradix.events`). Raises `ConfigError` unless the cache was
        made with ``kv_events=True``."""
        if self._tree.events is None:
            raise ConfigError("KV events are off: make the cache with kv_events=True")
        return self._tree.events.take()

    def reset(self) -> EvictionReport:
        """Drop every cached prefix (SGLang's ``reset``, vLLM's ``reset_prefix_cache``): the
        tree empties and every page returns to its free list. Refused with
        `InvalidRequestError` while a request is active (its pages are in use), changing
        nothing. Cumulative statistics are kept."""
        if self._requests or self._pins:
            raise InvalidRequestError(
                f"{len(self._requests)} request(s) still active and {len(self._pins)} pin(s) "
                "held: finish, abort or unpin them first"
            )
        report = self._evict_full(self._full.num_used)
        self._debug_check()
        return report

    def take_metrics(self) -> IntervalMetrics:
        """What happened since the last call (or since the cache was made): admissions, hits,
        evictions, tombstones, and the pools at the end (`IntervalMetrics`)."""
        now, at = self.stats(), time.monotonic()
        before, since = self._metrics_mark
        self._metrics_mark = (now, at)
        return IntervalMetrics.between(before, now, at - since)
