"""Relocation: after a pool shrinks, every page id in use at or above its new capacity moves to a
free id below it, so physical pools need rows for the live capacities only.

A move renames a page: its owners (tree nodes, requests' page tables) get the new id, and the
adapter copies the page's rows (`PageMoves`: every pool's rows of a page are page-local
arithmetic, so a page move is a row-range copy in each of them)::

    ids   [0 ........ new capacity)  [new capacity .... old capacity)
           free ids here become   <-- used ids here (src), in ascending order
           the targets (dst), lowest first

The rewritten request tables come back as `TableChanges` (an engine keeping device block tables
applies them); with KV events on, each node range holding a moved page is reported as EVICTED
under its old ids, then INSERTED under its new ones (same tokens, same hashes); a moved page
private to a request is reported FREED under its old id (its new id, private too, has no event).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .allocator import PageAllocator
from .deltas import PageTableDelta, TableChanges
from .locks import Pool
from .node import Node, Pages
from .page_table import PageTable
from .radix_tree import RadixTree
from .request import Request
from .results import EvictionReport
from .shadows import Run, Shadows
from .table_edits import TableEdits


@dataclass(frozen=True)
class PageMoves:
    """Pages of one pool renamed by a rebalance: page ``src[i]`` is now ``dst[i]`` (its rows
    must be copied there before anything reads it). ``src`` ascending; ids all distinct."""

    pool: Pool
    src: tuple[int, ...] = ()
    dst: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.src)


@dataclass(frozen=True)
class RebalanceReport(EvictionReport):
    """What `rebalance` did: what it evicted (the `EvictionReport` fields), the pools' live
    capacities in pages before and after, the pages it moved below a shrunk capacity
    (``full_moves``, ``swa_moves``) and the page-table changes of every request holding one
    (``changes``; `deltas` flattens them)."""

    full_capacity_pages: tuple[int, int] = (0, 0)
    swa_capacity_pages: tuple[int, int] = (0, 0)
    full_moves: PageMoves = field(default_factory=lambda: PageMoves(Pool.FULL))
    swa_moves: PageMoves = field(default_factory=lambda: PageMoves(Pool.SWA))
    changes: tuple[TableChanges, ...] = ()

    @property
    def deltas(self) -> tuple[PageTableDelta, ...]:
        return tuple(d for c in self.changes for d in c.deltas)

    @property
    def eviction(self) -> EvictionReport:
        return EvictionReport(
            self.full_pages, self.swa_pages, self.nodes_removed, self.nodes_tombstoned
        )


class RelocationState(Protocol):
    """What relocation reads and rewrites of a `ShadowRadixCache`."""

    _tree: RadixTree
    _full: PageAllocator
    _swa: PageAllocator
    _shadows: Shadows
    _requests: dict[int, Request]


def _plan(alloc: PageAllocator, target: int, pool: Pool) -> tuple[PageMoves, np.ndarray | None]:
    """Resize ``alloc`` to ``target`` pages (its pages in use must fit: the caller evicted);
    the moves and the id map (``None``: nothing moved)."""
    if target >= alloc.capacity:
        alloc.grow(target)
        return PageMoves(pool), None
    free_high = {i for i in alloc.free_snapshot() if i >= target}
    src = [i for i in range(target, alloc.capacity) if i not in free_high]
    dst = alloc.free_below(target, len(src))
    remap = np.arange(alloc.capacity, dtype=np.int64)
    remap[src] = dst
    alloc.shrink(target, dst)
    if not src:
        return PageMoves(pool), None
    return PageMoves(pool, tuple(src), tuple(dst)), remap


def relocate(
    state: RelocationState, full_pages: int, swa_pages: int
) -> tuple[PageMoves, PageMoves, tuple[TableChanges, ...]]:
    """Set the live capacities to ``full_pages`` / ``swa_pages`` (pages in use must already fit
    by count) and move every id in use at or above them below; returns the moves of each pool
    and the changes of the requests whose tables were rewritten."""
    full_moves, vmap = _plan(state._full, full_pages, Pool.FULL)
    swa_moves, smap = _plan(state._swa, swa_pages, Pool.SWA)
    if vmap is None and smap is None:
        return full_moves, swa_moves, ()
    in_tree_v: set[int] = set()
    in_tree_s: set[int] = set()
    for node in state._tree.nodes():  # parents before children (the events chain down)
        in_tree_v.update(_moved(node.vpages, full_pages))
        in_tree_s.update(_moved(node.swa_pages, swa_pages))
        _rename_node(state._tree, node, vmap, full_pages, smap, swa_pages)
    if state._tree.events is not None:  # a private page's old id leaves use: FREED
        state._tree.events.freed(
            sorted(set(full_moves.src) - in_tree_v), sorted(set(swa_moves.src) - in_tree_s)
        )
    changes = []
    for r in state._requests.values():
        edits = TableEdits(r)
        if _rename_request(r, edits, vmap, full_pages, smap, swa_pages):
            r._step_stamp = None  # the last step plan's reads name the old ids
            if r.replay_allocation is not None and r.length == r.match.prefix_len:
                _replan_replay(state._shadows, r)
            changes.append(edits.changes())
    return full_moves, swa_moves, tuple(changes)


def _moved(pages: Pages, cap: int) -> list[int]:
    """The ids of ``pages`` at or above ``cap`` (those a shrink to ``cap`` renames)."""
    return [i for i in pages if i >= cap]


def _renamed(pages: Pages, remap: np.ndarray | None, cap: int) -> Pages | None:
    """``pages`` under ``remap`` (a new tuple), or ``None`` when none moved."""
    if remap is None or not pages or max(pages) < cap:
        return None
    return tuple(remap[np.asarray(pages, dtype=np.int64)].tolist())


def _rename_node(
    tree: RadixTree,
    node: Node,
    vmap: np.ndarray | None,
    vcap: int,
    smap: np.ndarray | None,
    scap: int,
) -> None:
    new_v, new_s = _renamed(node.vpages, vmap, vcap), _renamed(node.swa_pages, smap, scap)
    if new_v is None and new_s is None:
        return
    old_v, old_s, live_from = node.vpages, node.swa_pages, node.live_from
    events = tree.events
    if events is not None:
        changed = np.zeros(node.num_pages, dtype=bool)
        if new_v is not None:
            changed |= np.asarray(new_v) != np.asarray(old_v)
        if new_s is not None:
            changed[live_from:] |= np.asarray(new_s) != np.asarray(old_s)
        hit = np.flatnonzero(changed)
        lo, hi = int(hit[0]), int(hit[-1]) + 1
        s_lo, s_hi = max(lo - live_from, 0), max(hi - live_from, 0)
        events.evicted(old_v[lo:hi], old_s[s_lo:s_hi], node.start_page + lo)
    node.vpages = old_v if new_v is None else new_v
    node.swa_pages = old_s if new_s is None else new_s
    if events is not None:
        parent_hash = events.hash_of(node.vpages[lo - 1]) if lo else tree._chain_after(node.parent)
        p = tree.page_size
        events.inserted(parent_hash, node.tokens[lo * p : hi * p], node.vpages[lo:hi],
                        node.swa_pages[s_lo:s_hi], node.start_page + lo,
                        node.approximate)  # fmt: skip


def _rename_request(
    r: Request,
    edits: TableEdits,
    vmap: np.ndarray | None,
    vcap: int,
    smap: np.ndarray | None,
    scap: int,
) -> bool:
    """Rewrite the request's tables under the maps; whether any entry moved."""
    moved = False
    if vmap is not None and len(r.vpages):
        v = np.asarray(r.vpages, dtype=np.int64)
        hit = np.flatnonzero(v >= vcap)
        if len(hit):
            table = PageTable()  # private from now on: the tree's arrays were renamed too
            table.extend(vmap[v].tolist())
            r.vpages = table
            edits.wrote_vpages(int(hit[0]), int(hit[-1]) + 1)
            moved = True
    if smap is not None and r.swa_pages:
        s = np.asarray(r.swa_pages, dtype=np.int64)
        hit = np.flatnonzero(s >= scap)
        if len(hit):
            r.swa_pages = smap[s].tolist()
            edits.wrote_swa(r.swa_base + int(hit[0]), r.swa_base + int(hit[-1]) + 1)
            moved = True
    return moved


def _replan_replay(shadows: Shadows, r: Request) -> None:
    """The pending window rebuild of a replayed admission, under the request's new ids (its
    tables are still those of its admission: nothing extended it)."""
    old = r.replay_allocation
    assert old is not None
    first = r.swa_base
    run = Run(old.starts[0], old.ends[0], r.vpages[first:], first, list(r.swa_pages))
    r.replay_allocation = shadows.allocation((r.id,), [run], old.evicted, replay=True)
