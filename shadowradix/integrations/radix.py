"""`ShadowRadixPrefixCache`: the `PrefixCache` protocol over a `ShadowRadixCache`.

A thin translation: hits are the core's `MatchResult` (kept in `PrefixHit.source`), locks its
pins, sizes its full (virtual-page) pool. The SWA pool is the core's own business here: its
window rule can make ``prefix_len`` shorter than ``cached_len`` (design.md §6), and
``extend`` raises `CapacityError("swa", ...)` when the SWA pool is what falls short.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable

from ..cache import ShadowRadixCache
from ..errors import InvalidRequestError, LockError
from ..locks import PinReceipt
from ..request import Request
from ..results import MatchResult
from .protocol import CacheSizes, PrefixHit, PrefixLock, TokenInput


class ShadowRadixPrefixCache:
    """`PrefixCache[Request]` backed by ``cache`` (which it changes; use it for slot plans)."""

    def __init__(self, cache: ShadowRadixCache) -> None:
        if not isinstance(cache, ShadowRadixCache):
            raise InvalidRequestError(f"need a ShadowRadixCache, got {type(cache).__name__}")
        self.cache = cache
        self._lock_ids = itertools.count()
        self._locks: dict[int, PrefixLock] = {}

    @property
    def page_size(self) -> int:
        return self.cache.config.page_size

    def match(
        self, tokens: TokenInput, max_len: int | None = None, *, namespace: Hashable = None
    ) -> PrefixHit:
        m = self.cache.match_prefix(tokens, max_len, namespace=namespace)
        return PrefixHit(m.query_len, m.cached_len, m.prefix_len, m.hit_len, m.namespace, m)

    def admit(self, tokens: TokenInput, hit: PrefixHit | None = None) -> Request:
        if hit is None:
            return self.cache.admit(tokens)
        match = hit.source if isinstance(hit, PrefixHit) else None
        if not isinstance(match, MatchResult) or match.owner is not self.cache:
            raise InvalidRequestError("not a PrefixHit of this cache")
        if match.prefix_len == 0:  # reuses nothing: a fresh empty match (see admission.py)
            match = self.cache.match_prefix(tokens, 0, namespace=match.namespace)
        return self.cache.admit(tokens, match)

    def can_extend(self, request: Request, num_tokens: int) -> bool:
        return self.cache.can_extend([request], [num_tokens]).ok

    def extend(self, request: Request, tokens: TokenInput) -> tuple[int, ...]:
        before = len(request.vpages) if isinstance(request, Request) else 0
        self.cache.extend(request, tokens)
        return tuple(request.vpages[before:])

    def page_table(self, request: Request) -> tuple[int, ...]:
        self._check_active(request)
        return tuple(request.vpages)

    def cache_unfinished(self, request: Request) -> None:
        self.cache.cache_unfinished(request)

    def finish(self, request: Request) -> None:
        self.cache.finish(request)

    def abort(self, request: Request) -> None:
        self.cache.abort(request)

    def evict(self, num_tokens: int) -> int:
        return self.cache.evict(full_tokens=num_tokens).full_pages * self.page_size

    def lock(self, tokens: TokenInput, *, namespace: Hashable = None) -> PrefixLock:
        receipt = self.cache.pin(tokens, namespace=namespace)
        lock = PrefixLock(next(self._lock_ids), receipt.tokens, namespace, receipt)
        self._locks[lock.id] = lock
        return lock

    def unlock(self, lock: PrefixLock) -> None:
        if not isinstance(lock, PrefixLock) or self._locks.get(lock.id) is not lock:
            raise LockError(f"{lock!r} is not a live lock of this cache: double unlock?")
        assert isinstance(lock.source, PinReceipt)
        self.cache.unpin(lock.source)
        del self._locks[lock.id]

    def sizes(self) -> CacheSizes:
        full, p = self.cache.stats().full, self.page_size
        return CacheSizes(
            p,
            full.capacity_pages * p,
            full.free_pages * p,
            full.evictable_pages * p,
            full.protected_pages * p,
            full.held_pages * p,
        )

    def reset(self) -> None:
        self.cache.reset()

    def check_invariants(self) -> None:
        self.cache.check_invariants()

    def _check_active(self, request: Request) -> None:
        if not isinstance(request, Request) or request.owner is not self.cache:
            raise InvalidRequestError("not a request of this cache")
        if not request.is_active:
            raise InvalidRequestError(f"request {request.id} is {request.state.value}")
