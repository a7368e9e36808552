"""Per-pool LRU indexes over tree nodes, and the tree's evictable / protected page counts.

Full pool: evictable *leaves* (no children, ``full_lock_ref == 0``) ordered by last access;
removing one may expose its parent. SWA pool: nodes with unprotected live SWA pages, in two
tiers so that the tail window of every branch goes last::

    node pages  [ tombstoned | tier 0 (head)         | tier 1 (tail window) | protected )
                             ^ live_from             ^ tail_from            ^ protect_from

Keys are ``(last_access, id)`` / ``(tier, last_access, id)`` in ``SortedList``s, so a lookup,
update or pop is O(log n); nothing is ever rebuilt wholesale.
"""

from __future__ import annotations

from sortedcontainers import SortedList

from .errors import require
from .node import Node


class LruIndex:
    def __init__(self, page_size: int, window: int) -> None:
        self.page_size = page_size
        self.window = window
        self.full = SortedList()
        self.swa = SortedList()
        self.nodes: dict[int, Node] = {}
        self.full_evictable = 0
        self.full_protected = 0
        self.swa_evictable = 0
        self.swa_protected = 0

    def tail_from(self, node: Node) -> int:
        """Local index of the first page that intersects the node's last `window` tokens."""
        first = (node.end_page * self.page_size - self.window) // self.page_size - node.start_page
        return min(max(first, 0), node.num_pages)

    def tiers(self, node: Node) -> tuple[int, int, int]:
        """``(tier0_end, tier1_end, live_from)``: evictable SWA is ``[live_from, tier1_end)``."""
        live_from = node.live_from
        protect = max(node.protect_from(), live_from)
        tail = min(max(self.tail_from(node), live_from), protect)
        return tail, protect, live_from

    def update(self, node: Node) -> None:
        """Re-derive the node's keys and page counts after any change to it."""
        if node.parent is None:
            return
        tail, protect, live_from = self.tiers(node)
        n, live = node.num_pages, len(node.swa_pages)
        full_e, full_p = (0, n) if node.full_lock_ref else (n, 0)
        swa_e = protect - live_from
        acct = (full_e, full_p, swa_e, live - swa_e)
        keys: list[tuple[int, ...]] = []
        if not node.full_lock_ref and not node.children:
            keys.append((node.last_access, node.id))
        if tail > live_from:
            keys.append((0, node.last_access, node.id))
        if protect > tail:
            keys.append((1, node.last_access, node.id))
        new_keys = tuple(keys)
        if new_keys == node.lru_keys and acct == node.acct and node.id in self.nodes:
            return
        self.remove(node)
        self.nodes[node.id] = node
        for key in new_keys:
            (self.full if len(key) == 2 else self.swa).add(key)
        node.lru_keys, node.acct = new_keys, acct
        self._add_acct(acct, 1)

    def remove(self, node: Node) -> None:
        for key in node.lru_keys:
            (self.full if len(key) == 2 else self.swa).remove(key)
        node.lru_keys = ()
        self._add_acct(node.acct, -1)
        node.acct = (0, 0, 0, 0)
        self.nodes.pop(node.id, None)

    def _add_acct(self, acct: tuple[int, int, int, int], sign: int) -> None:
        self.full_evictable += sign * acct[0]
        self.full_protected += sign * acct[1]
        self.swa_evictable += sign * acct[2]
        self.swa_protected += sign * acct[3]

    def oldest_full_leaf(self) -> Node | None:
        return self.nodes[self.full[0][1]] if self.full else None

    def oldest_swa(self) -> Node | None:
        return self.nodes[self.swa[0][2]] if self.swa else None

    def check_invariants(self, nodes: list[Node]) -> None:
        """Recompute every key and count from the nodes themselves and compare."""
        saved = {n.id: (n.acct, n.lru_keys) for n in nodes}
        full_keys, swa_keys = set(self.full), set(self.swa)
        totals = (self.full_evictable, self.full_protected, self.swa_evictable, self.swa_protected)
        require(set(self.nodes) == {n.id for n in nodes}, "LRU index tracks the wrong node set")
        shadow = LruIndex(self.page_size, self.window)
        for n in nodes:
            n.lru_keys, n.acct = (), (0, 0, 0, 0)
            shadow.update(n)
        try:
            require(set(shadow.full) == full_keys, "full LRU keys are stale")
            require(set(shadow.swa) == swa_keys, "SWA LRU keys are stale")
            require(
                totals
                == (
                    shadow.full_evictable,
                    shadow.full_protected,
                    shadow.swa_evictable,
                    shadow.swa_protected,
                ),
                "evictable / protected page counts drifted",
            )
        finally:
            for n in nodes:
                n.acct, n.lru_keys = saved[n.id]
