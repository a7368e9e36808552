"""`NaivePrefixCache`: a deliberately simple full-token prefix cache, obviously correct.

The second oracle for `ShadowRadixPrefixCache` and the A/B baseline an engine can swap in. It
knows nothing of SWA windows, compressed streams or shadows: one pool of pages, and a trie whose
edges are ``(namespace, parent page, the page's tokens) -> page``. Locks count per page (a lock
always covers a whole path from the root), eviction takes the least recently used unlocked leaf
page, one page at a time, by scanning every page. Clear over fast: every operation is
O(pages) or worse.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import CapacityError, InvalidRequestError, LockError, StaleMatchError, require
from .protocol import CacheSizes, PrefixHit, PrefixLock, TokenInput, as_tokens

_ids = itertools.count()


@dataclass
class _Page:
    parent: int | None
    key: tuple[int, ...]
    namespace: Hashable
    children: int = 0
    locks: int = 0
    last_access: int = 0


@dataclass(frozen=True)
class _Match:
    owner: NaivePrefixCache
    tokens: tuple[int, ...]
    pages: tuple[int, ...]


class NaiveRequest:
    """A running request: ``pages[:tree_pages]`` are cached (locked), the rest private."""

    def __init__(self, owner: NaivePrefixCache, prompt: list[int], namespace: Hashable) -> None:
        self.id = next(_ids)
        self.owner = owner
        self.prompt = prompt
        self.namespace = namespace
        self.tokens: list[int] = []
        self.pages: list[int] = []
        self.tree_pages = 0
        self.active = True

    @property
    def length(self) -> int:
        return len(self.tokens)


class NaivePrefixCache:
    """`PrefixCache[NaiveRequest]` over ``capacity_pages`` pages of ``page_size`` tokens."""

    def __init__(self, page_size: int, capacity_pages: int) -> None:
        if page_size < 1 or capacity_pages < 1:
            raise InvalidRequestError("page_size and capacity_pages must be positive")
        self._p, self._capacity = page_size, capacity_pages
        self._free = list(range(capacity_pages))[::-1]  # LIFO, low ids on top
        self._pages: dict[int, _Page] = {}
        self._edges: dict[tuple[Hashable, int | None, tuple[int, ...]], int] = {}
        self._requests: dict[int, NaiveRequest] = {}
        self._locks: dict[int, tuple[PrefixLock, tuple[int, ...]]] = {}
        self._clock = itertools.count(1)

    @property
    def page_size(self) -> int:
        return self._p

    # -- matching and admission ------------------------------------------------------------

    def _walk(self, tokens: Sequence[int], namespace: Hashable) -> list[int]:
        p, pages, parent = self._p, [], None
        for i in range(len(tokens) // p):
            page = self._edges.get((namespace, parent, tuple(tokens[i * p : (i + 1) * p])))
            if page is None:
                break
            pages.append(page)
            parent = page
        return pages

    def match(
        self, tokens: TokenInput, max_len: int | None = None, *, namespace: Hashable = None
    ) -> PrefixHit:
        arr = as_tokens(tokens)
        if max_len is not None:
            if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)):
                raise InvalidRequestError(f"max_len must be an int, got {max_len!r}")
            if max_len < 0:
                raise InvalidRequestError(f"max_len must be >= 0, got {max_len}")
            arr = arr[:max_len]
        _check_hashable(namespace)
        pages = self._walk(arr, namespace)
        n = len(pages) * self._p
        return PrefixHit(len(arr), n, n, n, namespace, _Match(self, tuple(arr[:n]), tuple(pages)))

    def admit(self, tokens: TokenInput, hit: PrefixHit | None = None) -> NaiveRequest:
        prompt = as_tokens(tokens, "prompt")
        hit = self.match(prompt) if hit is None else hit
        if not isinstance(hit, PrefixHit) or not isinstance(hit.source, _Match):
            raise InvalidRequestError("not a PrefixHit of this cache")
        m = hit.source
        if m.owner is not self:
            raise InvalidRequestError("this PrefixHit was taken from another cache")
        if tuple(prompt[: len(m.tokens)]) != m.tokens:
            raise InvalidRequestError("tokens do not start with the matched prefix")
        if tuple(self._walk(m.tokens, hit.namespace)) != m.pages:
            raise StaleMatchError("the hit's pages left the cache since it was taken")
        request = NaiveRequest(self, prompt, hit.namespace)
        request.tokens = list(m.tokens)
        request.pages = list(m.pages)
        request.tree_pages = len(m.pages)
        self._lock_pages(m.pages, +1)
        self._touch(m.pages)
        self._requests[request.id] = request
        return request

    # -- extension -------------------------------------------------------------------------

    def _pages_needed(self, request: NaiveRequest, num_tokens: int) -> int:
        return -(-(request.length + num_tokens) // self._p) - len(request.pages)

    def _evictable(self) -> int:
        return sum(1 for pg in self._pages.values() if not pg.locks)

    def can_extend(self, request: NaiveRequest, num_tokens: int) -> bool:
        self._check_active(request)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)):
            raise InvalidRequestError(f"num_tokens must be a positive int, got {num_tokens!r}")
        if num_tokens < 1:
            raise InvalidRequestError(f"num_tokens must be a positive int, got {num_tokens!r}")
        return self._pages_needed(request, int(num_tokens)) <= len(self._free) + self._evictable()

    def extend(self, request: NaiveRequest, tokens: TokenInput) -> tuple[int, ...]:
        self._check_active(request)
        new = as_tokens(tokens)
        need = self._pages_needed(request, len(new))
        available = len(self._free) + self._evictable()
        if need > available:
            raise CapacityError("full", need, available)
        while len(self._free) < need:
            self._evict_one()
        fresh = [self._free.pop() for _ in range(need)]
        request.pages.extend(fresh)
        request.tokens.extend(new)
        return tuple(fresh)

    def page_table(self, request: NaiveRequest) -> tuple[int, ...]:
        self._check_active(request)
        return tuple(request.pages)

    # -- caching and completion ------------------------------------------------------------

    def cache_unfinished(self, request: NaiveRequest) -> None:
        self._check_active(request)
        self._insert(request)

    def finish(self, request: NaiveRequest) -> None:
        self._check_active(request)
        self._insert(request)
        self._release(request)

    def abort(self, request: NaiveRequest) -> None:
        self._check_active(request)
        self._release(request)

    def _insert(self, request: NaiveRequest) -> None:
        """Hand the request's whole pages past its cached part to the trie, or switch it to
        the trie's copy where another request inserted the same page first."""
        p, ns, now = self._p, request.namespace, next(self._clock)
        full = request.length // p
        for i in range(request.tree_pages, full):
            parent = request.pages[i - 1] if i else None
            key = tuple(request.tokens[i * p : (i + 1) * p])
            existing = self._edges.get((ns, parent, key))
            if existing is not None:
                self._free.append(request.pages[i])
                request.pages[i] = existing
            else:
                page = request.pages[i]
                self._pages[page] = _Page(parent, key, ns, last_access=now)
                self._edges[(ns, parent, key)] = page
                if parent is not None:
                    self._pages[parent].children += 1
            self._lock_pages([request.pages[i]], +1)
        request.tree_pages = max(request.tree_pages, full)

    def _release(self, request: NaiveRequest) -> None:
        tree = request.pages[: request.tree_pages]
        self._lock_pages(tree, -1)
        self._touch(tree)
        self._free.extend(reversed(request.pages[request.tree_pages :]))
        del request.pages[request.tree_pages :]
        request.active = False
        del self._requests[request.id]

    # -- eviction, locks, sizes ------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)):
            raise InvalidRequestError("eviction size must be a non-negative int (tokens)")
        if num_tokens < 0:
            raise InvalidRequestError("eviction size must be a non-negative int (tokens)")
        freed = 0
        while freed * self._p < num_tokens and self._evict_one():
            freed += 1
        return freed * self._p

    def _evict_one(self) -> bool:
        leaves = [(pg.last_access, i) for i, pg in self._pages.items() if not pg.locks]
        leaves = [(t, i) for t, i in leaves if not self._pages[i].children]
        if not leaves:
            return False
        page_id = min(leaves)[1]
        page = self._pages.pop(page_id)
        del self._edges[(page.namespace, page.parent, page.key)]
        if page.parent is not None:
            self._pages[page.parent].children -= 1
        self._free.append(page_id)
        return True

    def lock(self, tokens: TokenInput, *, namespace: Hashable = None) -> PrefixLock:
        hit = self.match(tokens, namespace=namespace)
        assert isinstance(hit.source, _Match)
        pages = hit.source.pages
        lock = PrefixLock(next(_ids), hit.prefix_len, namespace, self)
        self._lock_pages(pages, +1)
        self._locks[lock.id] = (lock, pages)
        return lock

    def unlock(self, lock: PrefixLock) -> None:
        held = self._locks.get(lock.id) if isinstance(lock, PrefixLock) else None
        if held is None or held[0] is not lock:
            raise LockError(f"{lock!r} is not a live lock of this cache: double unlock?")
        self._lock_pages(held[1], -1)
        del self._locks[lock.id]

    def sizes(self) -> CacheSizes:
        p = self._p
        protected = sum(1 for pg in self._pages.values() if pg.locks)
        held = sum(len(r.pages) - r.tree_pages for r in self._requests.values())
        return CacheSizes(
            p,
            self._capacity * p,
            len(self._free) * p,
            (len(self._pages) - protected) * p,
            protected * p,
            held * p,
        )

    def reset(self) -> None:
        if self._requests or self._locks:
            raise InvalidRequestError("requests still active or locks held: release them first")
        self._free.extend(self._pages)
        self._pages.clear()
        self._edges.clear()

    def snapshot(self) -> tuple[object, ...]:
        """A comparable picture of the whole state (to show a failed call changed nothing)."""
        pages = tuple(sorted((i, pg.parent, pg.key, repr(pg.namespace), pg.children, pg.locks,
                              pg.last_access) for i, pg in self._pages.items()))  # fmt: skip
        requests = tuple((r.id, tuple(r.tokens), tuple(r.pages), r.tree_pages)
                         for r in self._requests.values())  # fmt: skip
        return pages, requests, tuple(self._free), tuple(sorted(self._locks))

    def check_invariants(self) -> None:
        owned = list(self._pages) + [
            pg for r in self._requests.values() for pg in r.pages[r.tree_pages :]
        ]
        require(len(set(owned)) == len(owned), "a page is owned twice")
        require(not set(owned) & set(self._free), "a page is both free and in use")
        require(len(owned) + len(self._free) == self._capacity, "pages leaked")
        locks = dict.fromkeys(self._pages, 0)
        children = dict.fromkeys(self._pages, 0)
        for r in self._requests.values():
            require(len(r.pages) == -(-r.length // self._p), f"request {r.id}: table length")
            require(self._walk(r.tokens, r.namespace)[: r.tree_pages] == r.pages[: r.tree_pages],
                    f"request {r.id}: its cached part is not the trie's path")  # fmt: skip
            for pg in r.pages[: r.tree_pages]:
                locks[pg] += 1
        for _, pages in self._locks.values():
            for pg in pages:
                locks[pg] += 1
        for key, i in self._edges.items():
            edge = self._pages[i]
            require(key == (edge.namespace, edge.parent, edge.key), f"page {i}: edge key")
            if edge.parent is not None:
                children[edge.parent] += 1
        require(len(self._edges) == len(self._pages), "a page is not in the trie")
        for i, page in self._pages.items():
            require(page.locks == locks[i], f"page {i}: lock count")
            require(page.children == children[i], f"page {i}: child count")
            require(page.parent is None or page.parent in self._pages, f"page {i}: no parent")

    # -- helpers ---------------------------------------------------------------------------

    def _lock_pages(self, pages: Sequence[int], delta: int) -> None:
        for pg in pages:
            self._pages[pg].locks += delta

    def _touch(self, pages: Sequence[int]) -> None:
        now = next(self._clock)
        for pg in pages:
            self._pages[pg].last_access = now

    def _check_active(self, request: NaiveRequest) -> None:
        if not isinstance(request, NaiveRequest) or request.owner is not self:
            raise InvalidRequestError("not a request of this cache")
        if not request.active:
            raise InvalidRequestError(f"request {request.id} is no longer active")


def _check_hashable(namespace: Hashable) -> None:
    try:
        hash(namespace)
    except TypeError:
        raise InvalidRequestError(f"namespace must be hashable, got {namespace!r}") from None
