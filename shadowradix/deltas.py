"""Page-table deltas: what a call changed in a request's two page tables, so an engine keeping
its own (device) block table applies them instead of diffing.

A request has a virtual table (``request.vpages``: page ``i`` of its positions, from 0) and an
SWA table (``request.swa_pages``: page ``swa_base + i``; pages before ``swa_base`` have left the
window). Indices in a delta are absolute pages (position // page_size) in both::

    before   [ base .......... first ........................ end )
    after         [ base' .... first | pages ......... | kept | num_pages )
                  ^ base_page         written now        unchanged

Applying a delta drops the entries before ``base_page``, writes ``pages`` from ``first_page``
on, and cuts the table at ``num_pages`` (entries in between keep their ids). The deltas of a
request, applied in order to a copy of its tables taken at `admit`, reproduce them exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .locks import Pool


@dataclass(frozen=True, slots=True)
class PageTableDelta:
    """One request's change of one table (``pool``: `Pool.FULL` for ``request.vpages``, `Pool.SWA`
    for ``request.swa_pages``). ``first_page``: the first entry written (``num_pages`` when only
    the ends moved); ``pages``: the ids from there; ``num_pages``: the table's new end;
    ``base_page``: its new first page (``request.swa_base`` for SWA, 0 for the virtual table).
    Entries that lost their id went back to the free list unless the tree holds them."""

    request_id: int
    pool: Pool
    first_page: int
    pages: tuple[int, ...]
    num_pages: int
    base_page: int = 0

    def apply(self, table: list[int], base: int = 0) -> int:
        """Apply to ``table`` in place (``table[i]`` is page ``base + i``); returns the new base.
        For the virtual table ``base`` is always 0."""
        del table[: self.base_page - base]
        lo = self.first_page - self.base_page
        table[lo : lo + len(self.pages)] = self.pages
        del table[self.num_pages - self.base_page :]
        return self.base_page


@dataclass(frozen=True, slots=True)
class TableChanges:
    """What `cache_unfinished`, `finish`, `abort` or `rollback` changed in the request's tables:
    its deltas, virtual table first (none when nothing moved)."""

    request_id: int
    deltas: tuple[PageTableDelta, ...] = ()


def step_deltas(records: Sequence[tuple[int, int, list[int], int, list[int], int, int]]) -> tuple[
    PageTableDelta, ...
]:  # fmt: skip
    """The deltas of an extend step, from what it recorded per request that changed:
    ``(request id, first new virtual page, new virtual pages, first new SWA page, new SWA pages,
    SWA base before, SWA base after)``. An extend only appends and drops window pages."""
    out = []
    for rid, v_first, vpages, s_first, spages, base_before, base in records:
        if vpages:
            out.append(
                PageTableDelta(rid, Pool.FULL, v_first, tuple(vpages), v_first + len(vpages))
            )
        if spages or base != base_before:
            end = s_first + len(spages)
            out.append(PageTableDelta(rid, Pool.SWA, s_first, tuple(spages), end, base))
    return tuple(out)
