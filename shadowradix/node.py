"""A radix-tree node: a page-aligned run of tokens, its virtual pages and its SWA shadow.

Positions inside a node (``[start, end)``, raw tokens) map page by page to virtual pages. SWA is
live on a *suffix* of the node's pages (windows are suffixes, and eviction takes the oldest
pages first), so the SWA shadow is stored as that suffix only::

    pages      [0 .................................... n)
    swa        [ tombstoned      | live suffix         )
                                 ^ live_from = n - len(swa_pages)

Page ids are tuples of ints: immutable, so a request's page table shares a node's tuple as it
is, and page ids move between free lists, requests and nodes as the same int objects (no
conversion to and from arrays on every insert and eviction). The tokens are a NumPy array (a
match compares them in C).
"""

from __future__ import annotations

import itertools

import numpy as np

_ids = itertools.count()

EMPTY = np.zeros(0, dtype=np.int64)
#: a node's page ids (virtual or SWA): never changed in place
Pages = tuple[int, ...]
NO_PAGES: Pages = ()


class Node:
    __slots__ = (
        "id",
        "parent",
        "children",
        "key",
        "tokens",
        "start_page",
        "vpages",
        "swa_pages",
        "full_lock_ref",
        "swa_locks",
        "last_access",
        "acct",
        "lru_keys",
        "lru_tiers",
        "approximate",
        "changed",
        "grown",
    )

    def __init__(
        self,
        parent: Node | None,
        tokens: np.ndarray,
        start_page: int,
        vpages: Pages,
        swa_pages: Pages,
        key: tuple[int, ...],
    ) -> None:
        self.id = next(_ids)
        self.parent = parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.key = key
        self.tokens = tokens
        self.start_page = start_page
        self.vpages = vpages
        self.swa_pages = swa_pages
        self.full_lock_ref = 0
        #: absolute page where a locker's window starts -> number of lockers
        self.swa_locks: dict[int, int] = {}
        self.last_access = 0
        #: (full evictable, full protected, swa evictable, swa protected) pages, as indexed
        self.acct = (0, 0, 0, 0)
        #: its LRU heap keys as last indexed (a `lru.full_key` first if any, then `lru.swa_key`s)
        self.lru_keys: tuple[int, ...] = ()
        #: ``(tier0_end, tier1_end, live_from)`` as last indexed (`LruIndex.tiers`)
        self.lru_tiers = (0, 0, 0)
        #: computed downstream of a bounded replay (not bit-identical to a cold prefill)
        self.approximate = False
        #: tree versions of the last change that can alter a match through this node (its
        #: pages' SWA, its removal) and of the last that can lengthen a match ending at its end
        #: (a new child, pages appended); a split copies both to the new upper node
        self.changed = 0
        self.grown = 0

    @property
    def num_pages(self) -> int:
        return len(self.vpages)

    @property
    def end_page(self) -> int:
        return self.start_page + len(self.vpages)

    @property
    def live_from(self) -> int:
        """Local index of the first page whose SWA is live (``num_pages`` if none)."""
        return len(self.vpages) - len(self.swa_pages)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def swa_lock_ref(self) -> int:
        return sum(self.swa_locks.values())

    def protect_from(self) -> int:
        """Local index from which SWA pages are protected by a locker's window."""
        if not self.swa_locks:
            return len(self.vpages)
        first = min(self.swa_locks) - self.start_page
        return min(max(first, 0), len(self.vpages))

    def path_from_root(self) -> list[Node]:
        path = []
        node: Node | None = self
        while node is not None and node.parent is not None:
            path.append(node)
            node = node.parent
        return path[::-1]

    def __repr__(self) -> str:
        return (
            f"Node(id={self.id}, pages=[{self.start_page},{self.end_page}), "
            f"live_from={self.live_from}, full_lock={self.full_lock_ref}, "
            f"swa_locks={self.swa_locks})"
        )
