"""Device block tables kept current from the core's page-table deltas, never by diffing.

Row ``i`` of each table belongs to the request a step placed there: ``vtable[i, j]`` is virtual
page ``j`` of its positions, ``stable[i, j]`` its SWA page ``j`` (absolute pages, live from its
``swa_base``). What changes a request's tables, the core reports (`StepPlan.deltas` of every
extend, `TableChanges.deltas` of `cache_unfinished` / `finish` / `abort` / `rollback`); the
owner of those results hands them to `DeviceTables.apply`, in order, and nothing else writes::

    apply(deltas)    a delta of a request holding a row: its ids written from ``first_page``
                     (pages cut or dropped before the base stay as stale ids nobody reads)
    place(requests)  a request new to its row: its whole tables written once (the delta from
                     an empty table); one already there: checked, not rewritten

Writes are queued and flushed as one scatter per table. A row's extent after its deltas must
equal the request's tables (``len(vpages)``, ``swa_base``, the SWA end): a missed extend or
rollback delta changes an extent and `place` raises `TableSyncError` instead of letting a step
read pages another request may hold. A missed rewrite that keeps the extents (cache_unfinished
deduplicating a prefix) is not detectable at that cost; `check` compares whole tables (tests).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from adapters.memory.device import upload
from shadowradix import PageTableDelta
from shadowradix.locks import Pool
from shadowradix.request import Request

I64 = np.int64
#: page ids: a delta's tuple, a request's table or an array
Pages = Sequence[int] | np.ndarray


class TableSyncError(RuntimeError):
    """A device row disagrees with its request's tables: a delta was not applied."""


@dataclass
class _Row:
    request_id: int
    v_end: int  # virtual pages [0, v_end)
    s_base: int  # SWA pages [s_base, s_end)
    s_end: int


class DeviceTables:
    """The two block tables of ``max_batch`` rows (``num_pages`` columns) on ``device``."""

    def __init__(self, max_batch: int, num_pages: int, device: torch.device | str) -> None:
        self.vtable = torch.zeros(max_batch, num_pages, device=device, dtype=torch.long)
        self.stable = torch.zeros(max_batch, num_pages, device=device, dtype=torch.long)
        self.num_pages = num_pages
        self._rows: list[_Row | None] = [None] * max_batch
        self._row_of: dict[int, int] = {}  # request id -> its row
        self._writes: dict[Pool, list[tuple[int, int, Pages]]] = {
            Pool.FULL: [],
            Pool.SWA: [],
        }

    def apply(self, deltas: Iterable[PageTableDelta]) -> None:
        """Queues the writes of ``deltas`` (in order) for the requests holding a row; deltas of
        other requests are dropped: `place` writes a newcomer's row whole."""
        for d in deltas:
            i = self._row_of.get(d.request_id)
            if i is None:
                continue
            row = self._rows[i]
            assert row is not None and row.request_id == d.request_id
            if d.num_pages > self.num_pages:
                raise ValueError(f"request {d.request_id}: {d.num_pages} pages exceed the tables")
            if d.pages:
                self._writes[d.pool].append((i, d.first_page, d.pages))
            if d.pool is Pool.FULL:
                row.v_end = d.num_pages
            else:
                row.s_base, row.s_end = d.base_page, d.num_pages

    def place(self, requests: Sequence[Request]) -> None:
        """Row ``i`` holds ``requests[i]`` for this step; flushes every queued write.
        Raises `TableSyncError` if a row kept from an earlier step disagrees in extent with its
        request (a delta was not applied), ValueError if a request exceeds the tables."""
        for i, r in enumerate(requests):
            row = self._rows[i]
            if row is None or row.request_id != r.id or self._row_of.get(r.id) != i:
                self._load_row(i, r)
            elif (row.v_end, row.s_base, row.s_end) != _extent(r):
                raise TableSyncError(
                    f"request {r.id}: device row {i} covers virtual pages [0, {row.v_end}) and "
                    f"SWA pages [{row.s_base}, {row.s_end}), the request {_extent(r)}: "
                    "a page-table delta was not applied"
                )
        self._flush()

    def _load_row(self, i: int, r: Request) -> None:
        old = self._rows[i]
        if old is not None and self._row_of.get(old.request_id) == i:
            del self._row_of[old.request_id]
        prev = self._row_of.get(r.id)
        if prev is not None:  # the request moved: its old row is stale
            self._rows[prev] = None
        v_end, s_base, s_end = _extent(r)
        if max(v_end, s_end) > self.num_pages:
            raise ValueError(f"request {r.id}: {max(v_end, s_end)} pages exceed the tables")
        self._writes[Pool.FULL].append((i, 0, r.vpages.tolist()))
        self._writes[Pool.SWA].append((i, s_base, list(r.swa_pages)))
        self._rows[i] = _Row(r.id, v_end, s_base, s_end)
        self._row_of[r.id] = i

    def _flush(self) -> None:
        for pool, table in ((Pool.FULL, self.vtable), (Pool.SWA, self.stable)):
            writes = self._writes[pool]
            if not writes:
                continue
            self._writes[pool] = []
            idx = _scatter_index(writes, self.num_pages)
            if idx.shape[1]:
                dev = upload(idx, table.device)  # never waits for the step in flight
                table[dev[0], dev[1]] = dev[2]

    def check(self, requests: Sequence[Request]) -> None:
        """Raises `TableSyncError` unless each ``requests[i]``'s tables equal row ``i`` over
        their extent (a host sync: tests and debugging)."""
        for i, r in enumerate(requests):
            v = self.vtable[i, : len(r.vpages)].tolist()
            top = r.swa_base + len(r.swa_pages)
            s = self.stable[i, r.swa_base : top].tolist()
            if v != list(r.vpages) or s != list(r.swa_pages):
                raise TableSyncError(f"request {r.id}: row {i} holds {v} / {s}")


def _extent(r: Request) -> tuple[int, int, int]:
    return len(r.vpages), r.swa_base, r.swa_base + len(r.swa_pages)


def _scatter_index(writes: list[tuple[int, int, Pages]], num_pages: int) -> np.ndarray:
    """``(3, n)`` rows, columns and ids of ``writes`` (row, first column, ids), later writes
    winning where two hit one entry (a scatter with duplicate indices is unordered). Built
    with list appends: a decode step's writes are one id each."""
    rows: list[int] = []
    cols: list[int] = []
    vals: list[int] = []
    for i, first, pages in writes:
        n = len(pages)
        rows += [i] * n
        cols += range(first, first + n)
        vals += pages
    idx = np.array([rows, cols, vals], dtype=I64)
    if len({w[0] for w in writes}) < len(writes):  # a row written twice: keep the last ids
        keys = idx[0] * num_pages + idx[1]
        _, last = np.unique(keys[::-1], return_index=True)
        idx = idx[:, len(keys) - 1 - last]
    return idx
