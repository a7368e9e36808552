"""Two-counter locks with receipts.

``full_lock_ref`` protects a node (and so its ancestors' and its compressed shadows) from
removal; a FULL receipt raises it on every node of the path root..node. ``swa_locks`` count
requests whose window still covers a node; a SWA receipt raises them on the path nodes that end
after the window start. Unlock walks the same path again, so a split that happens in between
(which copies both counters into the new upper node) keeps lock and unlock symmetric.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from .errors import LockError, require
from .node import Node


class Pool(enum.Enum):
    FULL = "full"
    SWA = "swa"


@dataclass(frozen=True, eq=False)
class LockReceipt:
    """Proof of one `lock`; `unlock` consumes it, and a second `unlock` raises `LockError`."""

    id: int
    node: Node
    pool: Pool
    #: SWA receipts: absolute page index where the holder's window starts.
    window_page: int = 0

    @classmethod
    def _issue(cls, id: int, node: Node, pool: Pool, window_page: int = 0) -> LockReceipt:
        """The receipt ``LockReceipt(id, node, pool, window_page)`` would make, without the frozen
        ``__init__``'s per-field ``object.__setattr__`` (one is issued on every lock)."""
        receipt = object.__new__(cls)
        receipt.__dict__.update(id=id, node=node, pool=pool, window_page=window_page)
        return receipt


@dataclass(frozen=True, eq=False)
class PinReceipt:
    """Proof of one `ShadowRadixCache.pin`; `unpin` consumes it (a second one raises
    `LockError`). ``tokens``: the pinned prefix, which neither pool evicts while pinned; its
    locks are ``full`` (the path) and ``swa`` (the window before its end, when live)."""

    id: int
    tokens: int
    full: LockReceipt | None
    swa: LockReceipt | None


class LockTable:
    """Owns every live receipt; ``on_change`` is told of each node whose counters moved."""

    def __init__(self, on_change: Callable[[Node], None]) -> None:
        self._live: dict[int, LockReceipt] = {}
        self._ids = itertools.count()
        self._on_change = on_change

    def __len__(self) -> int:
        return len(self._live)

    def lock_full(self, node: Node) -> LockReceipt:
        n: Node | None = node
        while n is not None and n.parent is not None:
            n.full_lock_ref += 1
            if n.full_lock_ref == 1:
                self._on_change(n)
            n = n.parent
        return self._register(LockReceipt._issue(next(self._ids), node, Pool.FULL))

    def lock_swa(self, node: Node, window_page: int) -> LockReceipt:
        for n in self._swa_path(node, window_page):
            count = n.swa_locks.get(window_page, 0)
            n.swa_locks[window_page] = count + 1
            if not count and window_page == min(n.swa_locks):
                self._on_change(n)  # the protected range grew
        return self._register(LockReceipt._issue(next(self._ids), node, Pool.SWA, window_page))

    def unlock(self, receipt: LockReceipt) -> None:
        if self._live.pop(receipt.id, None) is not receipt:
            raise LockError(
                f"receipt {receipt.id} ({receipt.pool.value}) is not live: double unlock?"
            )
        if receipt.pool is Pool.FULL:
            n: Node | None = receipt.node
            while n is not None and n.parent is not None:
                n.full_lock_ref -= 1
                if n.full_lock_ref == 0:
                    self._on_change(n)
                n = n.parent
            return
        w = receipt.window_page
        for n in self._swa_path(receipt.node, w):
            count = n.swa_locks[w] - 1
            if count:
                n.swa_locks[w] = count
                continue
            del n.swa_locks[w]
            if not n.swa_locks or w < min(n.swa_locks):
                self._on_change(n)  # the protected range shrank

    def _register(self, receipt: LockReceipt) -> LockReceipt:
        self._live[receipt.id] = receipt
        return receipt

    @staticmethod
    def _swa_path(node: Node, window_page: int) -> list[Node]:
        path = []
        n: Node | None = node
        while n is not None and n.parent is not None and n.end_page > window_page:
            path.append(n)
            n = n.parent
        return path

    def check_invariants(self, nodes: list[Node]) -> None:
        """Every node's counters equal what the live receipts account for."""
        full: dict[int, int] = {}
        swa: dict[int, dict[int, int]] = {}
        for r in self._live.values():
            if r.pool is Pool.FULL:
                for n in r.node.path_from_root():
                    full[n.id] = full.get(n.id, 0) + 1
            else:
                for n in self._swa_path(r.node, r.window_page):
                    per = swa.setdefault(n.id, {})
                    per[r.window_page] = per.get(r.window_page, 0) + 1
        for n in nodes:
            require(
                n.full_lock_ref >= 0 and all(c > 0 for c in n.swa_locks.values()),
                f"{n}: negative lock count",
            )
            require(
                n.full_lock_ref == full.get(n.id, 0), f"{n}: full_lock_ref disagrees with receipts"
            )
            require(n.swa_locks == swa.get(n.id, {}), f"{n}: swa_locks disagree with receipts")
            if n.swa_locks:
                require(n.full_lock_ref > 0, f"{n}: SWA-locked but not full-locked")
