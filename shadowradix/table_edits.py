"""Recording what one call changes in a request's page tables, turned into `PageTableDelta`s
(`shadowradix.deltas`) read from the tables as the call left them."""

from __future__ import annotations

from .deltas import PageTableDelta, TableChanges
from .locks import Pool
from .request import Request


class TableEdits:
    """Records one call's changes to a request's tables and turns them into deltas, reading the
    tables as the call left them. Growth, truncation and a moved SWA base are found by comparing
    the ends; entries rewritten in place (deduplication) are reported with `wrote_*`."""

    __slots__ = ("request", "v_end", "s_base", "s_end", "v_lo", "v_hi", "s_lo", "s_hi")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.v_end = len(request.vpages)
        self.s_base = request.swa_base
        self.s_end = request.swa_base + len(request.swa_pages)
        self.v_lo = self.s_lo = 1 << 62
        self.v_hi = self.s_hi = -1

    def wrote_vpages(self, lo: int, hi: int) -> None:
        self.v_lo, self.v_hi = min(self.v_lo, lo), max(self.v_hi, hi)

    def wrote_swa(self, lo: int, hi: int) -> None:
        self.s_lo, self.s_hi = min(self.s_lo, lo), max(self.s_hi, hi)

    def changes(self) -> TableChanges:
        r = self.request
        v_end, s_base = len(r.vpages), r.swa_base
        s_end = s_base + len(r.swa_pages)
        out = []
        v = _span(self.v_lo, self.v_hi, self.v_end, v_end, 0)
        if v is not None:
            out.append(PageTableDelta(r.id, Pool.FULL, v[0], tuple(r.vpages.slice(*v)), v_end))
        s = _span(self.s_lo, self.s_hi, self.s_end, s_end, s_base)
        if s is not None or s_base != self.s_base:
            lo, hi = s if s is not None else (s_end, s_end)
            pages = tuple(r.swa_pages[lo - s_base : hi - s_base])
            out.append(PageTableDelta(r.id, Pool.SWA, lo, pages, s_end, s_base))
        return TableChanges(r.id, tuple(out))


def _span(lo: int, hi: int, end_before: int, end: int, base: int) -> tuple[int, int] | None:
    """The entries ``[lo, hi)`` to report: those written, plus those appended, clipped to what
    the table holds now; ``None`` when neither the entries nor the end changed."""
    if end > end_before:
        lo, hi = min(lo, end_before), end
    elif end < end_before:
        lo = min(lo, end)
    elif hi < 0:
        return None
    lo = max(lo, base)
    return (lo, max(lo, min(hi, end)))
