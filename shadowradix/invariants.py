"""`check_invariants` of the whole cache: one place that states what must always hold."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Protocol

import numpy as np

from . import slots
from .allocator import PageAllocator
from .config import CacheConfig
from .errors import require
from .locks import LockTable, PinReceipt
from .lru import LruIndex
from .node import Node
from .radix_tree import RadixTree
from .request import Request
from .results import CacheStats


class CacheState(Protocol):
    """What the checks read of a `ShadowRadixCache` (named here, so this module does not
    import the cache that calls it)."""

    config: CacheConfig
    _tree: RadixTree
    _index: LruIndex
    _locks: LockTable
    _full: PageAllocator
    _swa: PageAllocator
    _requests: dict[int, Request]
    _pins: dict[int, PinReceipt]

    def stats(self) -> CacheStats: ...


def _concat(parts: Sequence[Sequence[int]]) -> np.ndarray:
    return np.fromiter(chain.from_iterable(parts), np.int64)


def check_cache(cache: CacheState) -> None:
    tree, index, locks = cache._tree, cache._index, cache._locks
    tree.check_invariants()
    nodes = tree.nodes()
    locks.check_invariants(nodes)
    index.check_invariants(nodes)
    requests = list(cache._requests.values())
    receipts = sum((r.full_receipt is not None) + (r.swa_receipt is not None) for r in requests)
    receipts += sum((q.full is not None) + (q.swa is not None) for q in cache._pins.values())
    require(receipts == len(locks), "live receipts not held by any request or pin")
    owned_v: list[Sequence[int]] = [n.vpages for n in nodes]
    owned_v += [r.vpages[r.tree_pages :] for r in requests]
    cache._full.check_invariants(_concat(owned_v))
    owned_s: list[Sequence[int]] = [n.swa_pages for n in nodes]
    owned_s += [[pg for pg, own in zip(r.swa_pages, r.swa_owned) if own] for r in requests]
    cache._swa.check_invariants(_concat(owned_s))
    stats = cache.stats()
    for name, pool in (("full", stats.full), ("swa", stats.swa)):
        total = pool.free_pages + pool.evictable_pages + pool.protected_pages + pool.held_pages
        require(pool.free_pages >= 0, f"{name}: more pages in use than capacity")
        require(
            total == pool.capacity_pages,
            f"{name}: free+evictable+protected+held={total} != {pool.capacity_pages}",
        )
    for r in requests:
        _check_request(cache, r)


def _node_at(terminal: Node, page: int) -> Node:
    n: Node | None = terminal
    while n is not None and not (n.start_page <= page < n.end_page):
        n = n.parent
    require(n is not None, f"page {page} not on the request's path")
    assert n is not None
    return n


def _check_request(cache: CacheState, r: Request) -> None:
    p, w = cache.config.page_size, cache.config.window
    require(r.is_active and r.owner is cache, f"{r}: registered but not active here")
    n: Node | None = r.terminal
    while n is not None and n.parent is not None:
        require(n.parent.children.get(n.key) is n, f"{r}: terminal detached from the tree")
        n = n.parent
    require(n is not None and cache._tree.is_a_root(n), f"{r}: terminal not under a root here")
    require(r.terminal.end_page == r.tree_pages, f"{r}: terminal does not end its tree prefix")
    require((r.full_receipt is not None) == (not r.terminal.is_root), f"{r}: full lock missing")
    path = r.terminal.path_from_root()
    tree_vpages = [v for n in path for v in n.vpages]
    require(r.vpages[: r.tree_pages] == tree_vpages, f"{r}: page table disagrees with its path")
    num_pages = slots.num_pages(len(r.tokens), p)
    require(len(r.vpages) == num_pages, f"{r}: {len(r.vpages)} virtual pages for {num_pages}")
    require(r.tree_pages * p <= r.num_committed, f"{r}: drafts reached the tree")
    require(r.swa_base + len(r.swa_pages) == num_pages, f"{r}: SWA table does not reach the end")
    require(len(r.swa_owned) == len(r.swa_pages), f"{r}: SWA ownership flags out of step")
    # SWA held per request: the window before the last page boundary plus newer pages only.
    held_from = slots.held_window_first_page(r.released_at, w, p)
    require(r.swa_base == held_from, f"{r}: window not trimmed")
    for i, (page_id, own) in enumerate(zip(r.swa_pages, r.swa_owned)):
        k = r.swa_base + i
        if own:
            continue
        require(k < r.tree_pages, f"{r}: unowned SWA page beyond the tree")
        node = _node_at(r.terminal, k)
        local = k - node.start_page
        require(local >= node.live_from, f"{r}: reads tombstoned SWA at page {k}")
        require(
            node.swa_pages[local - node.live_from] == page_id, f"{r}: SWA table stale at page {k}"
        )
        require(local >= node.protect_from(), f"{r}: reads unprotected SWA at page {k}")
