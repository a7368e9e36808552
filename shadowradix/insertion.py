"""Inserting a request's committed pages into the tree (`cache_unfinished`, `finish`): pages the
tree already holds replace the request's duplicates (tombstoned windows are revived with the
request's exact copies), the rest become a new leaf or extend the request's own leaf."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .node import NO_PAGES, Node, Pages
from .request import Request

if TYPE_CHECKING:
    from .allocator import PageAllocator
    from .config import CacheConfig
    from .locks import LockTable
    from .radix_tree import RadixTree
    from .table_edits import TableEdits


class TreeInsertion:
    """Mixed into `ShadowRadixCache` (see there for the state it names)."""

    if TYPE_CHECKING:
        config: CacheConfig
        _tree: RadixTree
        _locks: LockTable
        _full: PageAllocator
        _swa: PageAllocator

    def _insert(self, request: Request, edits: TableEdits) -> bool:
        """Move the committed full pages into the tree and re-take the FULL lock. Returns
        whether anything was inserted (the SWA lock must then be re-taken by the caller).
        Entries of the request's tables replaced by the tree's are recorded in ``edits``."""
        p = self.config.page_size
        full_pages = request.num_committed // p
        if full_pages <= request.tree_pages:
            return False
        first = request.terminal.end_page * p  # the tokens before it are the tree's already
        tokens = request.tokens_from(first)[: full_pages * p - first]
        walk = self._tree.walk(tokens, request.terminal, full_pages, first)
        node = request.terminal
        for child in walk.nodes:
            node = child
            if walk.last_pages < child.num_pages and child is walk.nodes[-1]:
                node = self._tree.split(child, walk.last_pages)
            self._adopt_tree_pages(request, node, edits)
        if node.end_page < full_pages:
            node = self._grow_tree(request, node, tokens[node.end_page * p - first :], full_pages)
        request.tree_pages = full_pages
        old_full, request.terminal = request.full_receipt, node
        request.full_receipt = self._locks.lock_full(node)
        if old_full is not None:
            self._locks.unlock(old_full)
        return True

    def _adopt_tree_pages(self, request: Request, node: Node, edits: TableEdits) -> None:
        """The tree already holds ``node``'s pages: drop the request's duplicates of them.

        Window pages the tree still has live replace the request's copies; window pages the
        tree had tombstoned are revived with the request's copies (computed exactly, never by
        replay: replayed pages lie before the request's first insert point).
        """
        lo, hi, base = node.start_page, node.end_page, request.swa_base
        request.approximate |= node.approximate  # it now reads that node's state
        freed_v = request.vpages.slice(lo, hi)
        self._full.free(freed_v)
        request.vpages.replace(lo, hi, list(node.vpages))
        edits.wrote_vpages(lo, hi)
        live_abs = hi - len(node.swa_pages)
        freed_s = []
        for k in range(max(lo, base, live_abs), hi):
            i = k - base
            if request.swa_owned[i]:
                freed_s.append(request.swa_pages[i])
                request.swa_pages[i] = node.swa_pages[k - live_abs]
                request.swa_owned[i] = False
                edits.wrote_swa(k, k + 1)
        self._swa.free(freed_s)
        if self._tree.events is not None:
            self._tree.events.freed(freed_v, freed_s)
        first = max(lo, base)
        if first < live_abs and (node.approximate or not request.approximate):
            revived = request.swa_pages[first - base : live_abs - base]
            assert all(request.swa_owned[first - base : live_abs - base])
            request.swa_owned[first - base : live_abs - base] = [False] * len(revived)
            self._tree.revive(node, tuple(revived))

    def _grow_tree(
        self, request: Request, parent: Node, tokens: np.ndarray, full_pages: int
    ) -> Node:
        """Hand the request's private pages ``[parent.end_page, full_pages)`` (their tokens:
        ``tokens``) to the tree: as a new leaf, or appended to ``parent`` when that is a leaf
        this request inserted itself and alone holds (a request's successive inserts make one
        node, not a chain; another request's node is never extended, so its end stays a node
        boundary for LRU tiers)."""
        lo = parent.end_page
        live_lo = max(lo, request.swa_base)
        i0, i1 = live_lo - request.swa_base, full_pages - request.swa_base
        swa: Pages = NO_PAGES
        if live_lo < full_pages:
            swa = tuple(request.swa_pages[i0:i1])
            assert all(request.swa_owned[i0:i1]), "private pages beyond the tree must be owned"
            request.swa_owned[i0:i1] = [False] * (i1 - i0)
        vpages = tuple(request.vpages.slice(lo, full_pages))
        new_tokens = tokens.copy()
        if self._can_extend_own_leaf(request, parent, live_lo == lo):
            self._tree.extend_leaf(parent, new_tokens, vpages, swa)
            return parent
        request.own_leaf = self._tree.add_leaf(
            parent, new_tokens, vpages, swa, approximate=request.approximate
        )
        return request.own_leaf

    def _can_extend_own_leaf(self, request: Request, leaf: Node, new_pages_live: bool) -> bool:
        """Append to ``leaf`` only if this request inserted it, alone holds it, its end is past
        the prompt (the prompt's end stays a node boundary, so its window keeps the tail-window
        eviction tier for branches such as regenerations), it has the same replay lineage, and
        live SWA stays a suffix."""
        return (
            leaf is request.own_leaf
            and not leaf.children
            and leaf.full_lock_ref == 1
            and leaf.end_page * self.config.page_size > len(request.prompt)
            and leaf.approximate == request.approximate
            and (new_pages_live or len(leaf.swa_pages) == 0)
        )
