"""Radix tree over virtual full-token slots, page-aligned.

Every node holds whole pages; a child is keyed by the tokens of its first page. The tree only
knows page ids; the pools' allocators own them, and the cache moves ids between the two.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from .errors import require
from .events import EventLog, namespace_seed
from .lru import LruIndex, is_full_key
from .node import EMPTY, NO_PAGES, Node, Pages


class Walk:
    """The deepest page-aligned match of a token sequence: ``nodes`` root-down, the last one
    matched on its first ``last_pages`` pages (all of them unless the match ends inside it)."""

    __slots__ = ("nodes", "last_pages")

    def __init__(self, nodes: tuple[Node, ...], last_pages: int) -> None:
        self.nodes = nodes
        self.last_pages = last_pages

    @property
    def num_pages(self) -> int:
        if not self.nodes:
            return 0
        return self.nodes[-1].start_page + self.last_pages

    def __repr__(self) -> str:
        return f"Walk(nodes={self.nodes!r}, last_pages={self.last_pages})"


_NO_WALK = Walk((), 0)


class RadixTree:
    def __init__(self, page_size: int, index: LruIndex) -> None:
        self.page_size = page_size
        self.index = index
        #: the default namespace's root; every namespace has its own (`root_of`)
        self.root = Node(None, EMPTY, 0, NO_PAGES, NO_PAGES, ())
        self._roots: dict[Hashable, Node] = {None: self.root}
        self._seeds: dict[int, int] = {self.root.id: namespace_seed(None)}
        #: Bumped by every change that can alter a match result.
        self.version = 0
        self.clock = 0
        #: where page changes are reported (`events`), when the cache was asked to
        self.events: EventLog | None = None

    def root_of(self, namespace: Hashable) -> Node:
        """The root of ``namespace``'s subtree (made on first use: it holds no page, and no
        match or insert ever crosses from one namespace's subtree to another's)."""
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = Node(None, EMPTY, 0, NO_PAGES, NO_PAGES, ())
            self._seeds[root.id] = namespace_seed(namespace)
        return root

    def is_a_root(self, node: Node) -> bool:
        """Whether ``node`` is one of this tree's namespace roots."""
        return node.id in self._seeds

    def walk(
        self,
        tokens: np.ndarray,
        start: Node | None = None,
        max_pages: int | None = None,
        offset: int = 0,
    ) -> Walk:
        """Longest page-aligned match of ``tokens`` below ``start``. ``tokens[0]`` is at position
        ``offset`` (at most where ``start`` ends: the tokens before it are not compared)."""
        node = start or self.root
        if not node.children:  # nothing below: the walk ends where it starts
            return _NO_WALK
        p = self.page_size
        page = node.end_page
        limit = (offset + len(tokens)) // p if max_pages is None else max_pages
        nodes: list[Node] = []
        last_pages = 0
        while page < limit:
            lo = page * p - offset
            child = node.children.get(tuple(tokens[lo : lo + p].tolist()))
            if child is None:
                break
            n = min(child.num_pages, limit - page)
            same = child.tokens[: n * p] == tokens[lo : lo + n * p]
            common = n if same.all() else int(np.argmin(same)) // p
            nodes.append(child)
            last_pages = common
            page += common
            if common < child.num_pages:
                break
            node = child
        return Walk(tuple(nodes), last_pages)

    def touch(self, nodes: tuple[Node, ...] | list[Node]) -> None:
        self.clock += 1
        for n in nodes:
            n.last_access = self.clock
            self.index.update(n)

    def split(self, node: Node, num_pages: int) -> Node:
        """Cut ``node`` after ``num_pages`` pages; returns the new upper node.

        The upper node copies both counters (every holder of ``node`` also holds it; SWA lockers
        only if their window reaches into it) and the access time.
        """
        assert 0 < num_pages < node.num_pages
        p, live_from = self.page_size, node.live_from
        upper = Node(
            node.parent,
            node.tokens[: num_pages * p],
            node.start_page,
            node.vpages[:num_pages],
            node.swa_pages[: max(num_pages - live_from, 0)],
            node.key,
        )
        upper.full_lock_ref = node.full_lock_ref
        upper.swa_locks = {w: c for w, c in node.swa_locks.items() if w < upper.end_page}
        upper.last_access = node.last_access
        upper.approximate = node.approximate
        upper.changed, upper.grown = node.changed, node.grown  # same pages: matches hold
        node.parent.children[node.key] = upper  # type: ignore[union-attr]
        node.tokens = node.tokens[num_pages * p :]
        node.vpages = node.vpages[num_pages:]
        node.swa_pages = node.swa_pages[max(num_pages - live_from, 0) :]
        node.start_page += num_pages
        node.key = tuple(node.tokens[:p].tolist())
        node.parent = upper
        upper.children[node.key] = node
        self.version += 1
        self.index.update(upper)
        self.index.update(node)
        return upper

    def add_leaf(
        self,
        parent: Node,
        tokens: np.ndarray,
        vpages: Pages,
        swa_pages: Pages,
        approximate: bool = False,
    ) -> Node:
        key = tuple(tokens[: self.page_size].tolist())
        assert key not in parent.children
        leaf = Node(parent, tokens, parent.end_page, vpages, swa_pages, key)
        leaf.last_access = self.clock
        leaf.approximate = approximate
        if self.events is not None:
            self.events.inserted(self._chain_after(parent), tokens, vpages, swa_pages,
                                 parent.end_page, approximate)  # fmt: skip
        parent.children[key] = leaf
        self.version += 1
        parent.grown = leaf.changed = self.version  # a walk ending at parent may go on
        self.index.update(leaf)
        if len(parent.children) == 1:
            self.index.update(parent)  # it stopped being a leaf
        return leaf

    def extend_leaf(self, leaf: Node, tokens: np.ndarray, vpages: Pages, swa_pages: Pages) -> None:
        """Append pages to a leaf instead of hanging a one-holder chain of nodes under it.

        ``swa_pages`` is the live suffix of the new pages; the caller guarantees the result is
        still a suffix (new pages fully live, or the leaf had no live page).
        """
        assert not leaf.children and leaf.parent is not None
        assert len(leaf.swa_pages) == 0 or len(swa_pages) == len(vpages)
        if self.events is not None:
            self.events.inserted(self._chain_after(leaf), tokens, vpages, swa_pages,
                                 leaf.end_page, leaf.approximate)  # fmt: skip
        leaf.tokens = np.concatenate((leaf.tokens, tokens))
        leaf.vpages += vpages  # tuples: a new one (a request sharing the old keeps it)
        leaf.swa_pages += swa_pages
        self.version += 1
        leaf.changed = leaf.grown = self.version
        self.index.update(leaf)

    def remove_leaf(self, leaf: Node) -> tuple[Pages, Pages]:
        """Detach an unlocked leaf; returns its (virtual pages, live SWA pages) to free."""
        assert not leaf.children and not leaf.full_lock_ref and leaf.parent is not None
        parent = leaf.parent
        if self.events is not None:
            self.events.evicted(leaf.vpages, leaf.swa_pages, leaf.start_page)
        del parent.children[leaf.key]
        self.index.remove(leaf)
        self.index.child_removed(parent)
        self.version += 1
        leaf.changed = self.version
        return leaf.vpages, leaf.swa_pages

    def tombstone(self, node: Node, num_pages: int) -> Pages:
        """Drop the SWA of the ``num_pages`` oldest live pages; the node stays matchable."""
        swa = node.swa_pages
        lf = len(node.vpages) - len(swa)  # node.live_from
        freed, node.swa_pages = swa[:num_pages], swa[num_pages:]
        if self.events is not None:
            self.events.tombstoned(node.vpages[lf : lf + len(freed)], freed, node.start_page + lf)
        self.version += 1
        node.changed = self.version
        self.index.tombstoned(node, len(freed))
        return freed

    def revive(self, node: Node, swa_pages: Pages) -> None:
        """Prepend live SWA pages just before the node's live suffix (exact recomputation)."""
        assert len(node.swa_pages) + len(swa_pages) <= node.num_pages
        node.swa_pages = swa_pages + node.swa_pages
        if self.events is not None:
            lf, p = node.live_from, self.page_size
            parent_hash = (
                self.events.hash_of(node.vpages[lf - 1]) if lf else self._chain_after(node.parent)
            )
            self.events.revived(parent_hash, node.tokens[lf * p : (lf + len(swa_pages)) * p],
                                node.vpages[lf : lf + len(swa_pages)], swa_pages,
                                node.start_page + lf)  # fmt: skip
        self.version += 1
        node.changed = self.version
        self.index.update(node)

    def _chain_after(self, node: Node | None) -> int:
        """The hash a page right below ``node`` chains from: its last page's, or its namespace's
        seed when ``node`` is a root (events are on)."""
        assert node is not None and self.events is not None
        if node.is_root:
            return self._seeds[node.id]
        return self.events.hash_of(node.vpages[-1])

    def nodes(self) -> list[Node]:
        out, stack = [], [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def check_invariants(self) -> None:
        p = self.page_size
        self.index.flush()  # the node keys read below are re-derived lazily
        for n in self.nodes():
            parent = n.parent
            require(parent is not None and parent.children.get(n.key) is n, f"{n}: detached")
            assert parent is not None
            require(n.num_pages > 0 and len(n.tokens) == n.num_pages * p, f"{n}: ragged")
            require(n.start_page == parent.end_page, f"{n}: not contiguous with its parent")
            require(n.key == tuple(n.tokens[:p].tolist()), f"{n}: key is not its first page")
            require(len(n.swa_pages) <= n.num_pages, f"{n}: more SWA than pages")
            require(
                type(n.vpages) is tuple and type(n.swa_pages) is tuple,
                f"{n}: page ids must be tuples (requests share them)",
            )
            if not n.children and not n.full_lock_ref:
                require(
                    bool(n.lru_keys) and is_full_key(n.lru_keys[0]),
                    f"{n}: evictable leaf not indexed",
                )
