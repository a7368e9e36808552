"""Per-pool LRU indexes over tree nodes, and the tree's evictable / protected page counts.

Full pool: evictable *leaves* (no children, ``full_lock_ref == 0``) ordered by last access;
removing one may expose its parent. SWA pool: nodes with unprotected live SWA pages, in two
tiers so that the tail window of every branch goes last::

    node pages  [ tombstoned | tier 0 (head)         | tier 1 (tail window) | protected )
                             ^ live_from             ^ tail_from            ^ protect_from

Keys are ints ordered as ``(last_access, id)`` / ``(tier, last_access, id)`` would be
(`full_key`, `swa_key`: one int compare per heap step instead of a tuple's); the oldest is the
smallest, and a key's low `ID_BITS` bits are its node's id. Each pool keeps its keys in a binary
heap with lazy deletion: a node's current keys are
``node.lru_keys``, and a heap entry that is not among them any more (the node was touched,
locked, tombstoned or removed since) is stale and skipped when it reaches the top. So a key
change costs one C-level ``heappush`` and nothing for the key it replaces, a lookup of the
oldest pops the stale entries above it, and the heap is compacted when stale entries outnumber
live ones (amortised O(1) per change; nothing is rebuilt per operation).

`update` only notes that a node changed; its keys and counts are re-derived when the index is
next read (an eviction, a capacity check, the counts, `check_invariants`), once however often
it changed in between (a request's admission, inserts and release touch the same few nodes
several times). The result is the same as re-deriving at every change: keys depend only on
the node's state at the time they are read.
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush

from . import slots
from .errors import require
from .node import Node

_NO_ACCT = (0, 0, 0, 0)
#: a key's low bits: its node's id (node ids count up from 0 in one process)
ID_BITS = 40
_ID_MASK = (1 << ID_BITS) - 1
#: the tier bits of SWA keys, above any stamp (< 2**62): tier 0 < tier 1, and both above
#: every full key, so a node's full key is never mistaken for one of its SWA keys
_STAMP_BITS = 62 + ID_BITS
_TIER0 = 2 << _STAMP_BITS
_TIER1 = 3 << _STAMP_BITS


def full_key(last_access: int, node_id: int) -> int:
    """The full pool's key of a leaf: ordered as ``(last_access, node_id)``."""
    return last_access << ID_BITS | node_id


def swa_key(tier: int, last_access: int, node_id: int) -> int:
    """An SWA tier's key: ordered as ``(tier, last_access, node_id)``."""
    return (_TIER1 if tier else _TIER0) | last_access << ID_BITS | node_id


def is_full_key(key: int) -> bool:
    return key < _TIER0


#: compact the heaps once they hold this many entries more than twice the most live keys (a
#: node has at most three: a full key and one per SWA tier)
_SLACK = 1024


class LruIndex:
    def __init__(self, page_size: int, window: int) -> None:
        self.page_size = page_size
        self.window = window
        #: a node's last ``window`` tokens meet its last this many pages
        self._window_pages = slots.tail_window_pages(window, page_size)
        #: heaps of `full_key` and `swa_key` ints, stale entries included
        self._full: list[int] = []
        self._swa: list[int] = []
        self._nodes: dict[int, Node] = {}
        self._dirty: dict[int, Node] = {}
        #: full evictable, full protected, SWA evictable, SWA protected pages
        self._counts = [0, 0, 0, 0]

    # -- what the cache reads (each brings the index up to date first) -------------------------

    @property
    def full_evictable(self) -> int:
        self.flush()
        return self._counts[0]

    @property
    def full_protected(self) -> int:
        self.flush()
        return self._counts[1]

    @property
    def swa_evictable(self) -> int:
        self.flush()
        return self._counts[2]

    @property
    def swa_protected(self) -> int:
        self.flush()
        return self._counts[3]

    @property
    def nodes(self) -> dict[int, Node]:
        """The indexed nodes by id (every node of the tree)."""
        self.flush()
        return self._nodes

    @property
    def full(self) -> list[int]:
        """The full pool's heap (stale entries included)."""
        self.flush()
        return self._full

    @property
    def swa(self) -> list[int]:
        """The SWA pool's heap (stale entries included)."""
        self.flush()
        return self._swa

    def oldest_full_leaf(self) -> Node | None:
        if self._dirty:
            self.flush()
        return self._oldest(self._full)

    def oldest_swa(self) -> Node | None:
        if self._dirty:
            self.flush()
        return self._oldest(self._swa)

    def tiers(self, node: Node) -> tuple[int, int, int]:
        """``(tier0_end, tier1_end, live_from)``: evictable SWA is ``[live_from, tier1_end)``."""
        self.flush()
        return node.lru_tiers

    # -- changes -------------------------------------------------------------------------------

    def update(self, node: Node) -> None:
        """Note a change to ``node`` (its keys and counts are re-derived before the next read)."""
        self._dirty[node.id] = node

    def tombstoned(self, node: Node, num_pages: int) -> None:
        """`update` after `RadixTree.tombstone` took ``num_pages`` evictable SWA pages from
        ``node``, applied at once: its live start moves up to at most its protected start, so
        the tail tier can only start later, the evictable count drops by ``num_pages``, and a
        key goes only if its tier emptied (none appears, stamps stay)."""
        tail, protect, live_from = node.lru_tiers
        live_from += num_pages
        nid = node.id
        if nid in self._dirty or nid not in self._nodes or live_from > protect:
            self._dirty[nid] = node  # not indexed as it stands: re-derive it
            return
        if tail < live_from:
            tail = live_from
        node.lru_tiers = (tail, protect, live_from)
        a = node.acct
        node.acct = (a[0], a[1], a[2] - num_pages, a[3])
        self._counts[2] -= num_pages
        if tail == live_from or tail == protect:  # a tier emptied: its key goes
            keys = node.lru_keys
            kept: tuple[int, ...] = keys[:1] if keys and keys[0] < _TIER0 else ()
            stamp = node.last_access << ID_BITS | nid
            if tail > live_from:
                kept += (_TIER0 | stamp,)
            if protect > tail:
                kept += (_TIER1 | stamp,)
            node.lru_keys = kept

    def child_removed(self, node: Node) -> None:
        """`update` after a child of ``node`` was removed, applied at once: it only gains a full
        key, if that was its last child and it is unlocked (its counts and tiers stay)."""
        nid = node.id
        if nid in self._dirty or (node.parent is not None and nid not in self._nodes):
            self._dirty[nid] = node  # pending or not indexed: re-derive it
            return
        if node.parent is None or node.children or node.full_lock_ref:
            return  # a root, not a leaf yet, or locked: nothing it is indexed by changed
        key = node.last_access << ID_BITS | nid
        if key not in node.lru_keys:
            node.lru_keys = (key, *node.lru_keys)
            heappush(self._full, key)

    def remove(self, node: Node) -> None:
        """Stop tracking ``node`` (its heap entries go stale)."""
        self._dirty.pop(node.id, None)
        node.lru_keys = ()
        c, a = self._counts, node.acct
        c[0] -= a[0]
        c[1] -= a[1]
        c[2] -= a[2]
        c[3] -= a[3]
        node.acct = _NO_ACCT
        self._nodes.pop(node.id, None)

    def flush(self) -> None:
        """Re-derive every node changed since the last read."""
        while self._dirty:
            dirty, self._dirty = self._dirty, {}
            for node in dirty.values():
                self._refresh(node)

    def _refresh(self, node: Node) -> None:
        if node.parent is None:
            return
        # the tiers of the module docstring, clamped with comparisons (no min/max calls)
        nv, start = len(node.vpages), node.start_page
        live_from = nv - len(node.swa_pages)
        protect = nv
        if node.swa_locks:
            protect = min(node.swa_locks) - start
            if protect < live_from:
                protect = live_from
            elif protect > nv:
                protect = nv
        tail = nv - self._window_pages  # the first page meeting the last `window` tokens
        if tail < live_from:
            tail = live_from
        elif tail > protect:
            tail = protect
        node.lru_tiers = (tail, protect, live_from)
        stamp = node.last_access << ID_BITS | node.id
        if node.full_lock_ref:
            acct = (0, nv, protect - live_from, nv - protect)
            keys: tuple[int, ...] = ()
        else:
            acct = (nv, 0, protect - live_from, nv - protect)
            keys = () if node.children else (stamp,)
        if tail > live_from:
            keys += (_TIER0 | stamp,)
        if protect > tail:
            keys += (_TIER1 | stamp,)
        nid = node.id
        old, was = node.lru_keys, node.acct
        if keys == old and acct == was and nid in self._nodes:
            return
        self._nodes[nid] = node
        node.lru_keys, node.acct = keys, acct
        if acct != was:
            c = self._counts
            c[0] += acct[0] - was[0]
            c[1] += acct[1] - was[1]
            c[2] += acct[2] - was[2]
            c[3] += acct[3] - was[3]
        pushed = False
        for key in keys:
            if key not in old:
                heappush(self._full if key < _TIER0 else self._swa, key)
                pushed = True
        if pushed and len(self._full) + len(self._swa) > 6 * len(self._nodes) + _SLACK:
            self._compact()

    def _compact(self) -> None:
        """Drop the stale entries (and duplicates) of both heaps. After it they hold at most
        three live keys a node, and the next one comes at least as many pushes later:
        amortised O(1) a push."""
        for heap in (self._full, self._swa):
            heap[:] = set(filter(self._is_live, heap))
            heapify(heap)

    # -- lookups -------------------------------------------------------------------------------

    def _is_live(self, key: int) -> bool:
        node = self._nodes.get(key & _ID_MASK)
        return node is not None and key in node.lru_keys

    def _oldest(self, heap: list[int]) -> Node | None:
        nodes = self._nodes
        while heap:
            key = heap[0]
            node = nodes.get(key & _ID_MASK)
            if node is not None and key in node.lru_keys:
                return node
            heappop(heap)
        return None

    def live_keys(self) -> tuple[set[int], set[int]]:
        """The current (full, SWA) keys, stale heap entries left out."""
        self.flush()
        return set(filter(self._is_live, self._full)), set(filter(self._is_live, self._swa))

    def check_invariants(self, nodes: list[Node]) -> None:
        """Recompute every key and count from the nodes themselves and compare."""
        full_keys, swa_keys = self.live_keys()
        saved = {n.id: (n.acct, n.lru_keys, n.lru_tiers) for n in nodes}
        totals = tuple(self._counts)
        require(set(self._nodes) == {n.id for n in nodes}, "LRU index tracks the wrong node set")
        held = {k for n in nodes for k in n.lru_keys}
        require(held == full_keys | swa_keys, "LRU keys missing from the heaps")
        shadow = LruIndex(self.page_size, self.window)
        for n in nodes:
            n.lru_keys, n.acct = (), _NO_ACCT
            shadow.update(n)
        try:
            want_full, want_swa = shadow.live_keys()
            require(want_full == full_keys, "full LRU keys are stale")
            require(want_swa == swa_keys, "SWA LRU keys are stale")
            require(totals == tuple(shadow._counts), "evictable / protected page counts drifted")
            for n in nodes:
                require(n.lru_tiers == saved[n.id][2], f"{n}: SWA tiers are stale")
        finally:
            for n in nodes:
                n.acct, n.lru_keys, n.lru_tiers = saved[n.id]
