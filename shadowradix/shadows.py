"""Shadow arithmetic: from virtual / SWA pages to the slots every pool writes or reads.

Compressed shadows are pure arithmetic on the virtual page holding a group's last token::

    slot(group g) = vpage(e) * slots_per_page + (e % page_size) // ratio,   e = (g + 1) * ratio - 1

(``page_size >= ratio``: ``page_size // ratio`` groups end in each page, this is ``e // ratio``
relative to the page; ``page_size < ratio``: at most one group ends in a page, one slot per page.)

Ring shadows are second-level arithmetic off the SWA page holding a position::

    ring_row(pos) = swa_page(pos) * ring_len + pos % ring_len

so freeing an SWA page invalidates its ring rows with no extra bookkeeping. Everything here is
vectorised over all tokens of a step; nothing loops per token in Python.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .config import CacheConfig, StreamSpec
from .results import Allocation, EvictionReport, ReadPlan, StreamReads, StreamWrites

if TYPE_CHECKING:
    from .request import Request

I64 = np.int64
_EMPTY = np.zeros(0, dtype=I64)
_EMPTY.flags.writeable = False


@dataclass
class Run:
    """One request's share of a step: new positions ``[start, end)`` and the page-table slices
    that cover them (``vpages`` from page ``start // P``, ``swa_pages`` from ``swa_first``)."""

    start: int
    end: int
    vpages: list[int]
    swa_first: int
    swa_pages: list[int]


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated ``arange(s, s + n)`` for each pair, and the owning index of each item."""
    total = int(lengths.sum())
    owner = np.repeat(np.arange(len(lengths), dtype=I64), lengths)
    offsets = np.cumsum(lengths) - lengths
    return starts[owner] + np.arange(total, dtype=I64) - offsets[owner], owner


def first_inflight(length: np.ndarray | int, stream: StreamSpec) -> np.ndarray | int:
    """First position whose in-flight row the compressor still needs at ``length``."""
    r = stream.ratio
    start = length // r * r
    if stream.overlap:
        start = start - r
    return np.maximum(start, 0) if isinstance(start, np.ndarray) else max(start, 0)


def compressed_slots(vslots: np.ndarray, ends: np.ndarray, stream: StreamSpec) -> np.ndarray:
    """Slots of the groups whose last token sits at ``ends`` (virtual slots ``vslots``)."""
    p = stream.page_size
    return vslots // p * stream.slots_per_page + ends % p // stream.ratio


def ring_rows(swa_pages: np.ndarray, positions: np.ndarray, stream: StreamSpec) -> np.ndarray:
    return swa_pages * stream.ring_len + positions % stream.ring_len


class Shadows:
    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.page_size = config.page_size
        self._ring_len_col = np.array([[s.ring_len] for s in config.streams], dtype=I64)
        self._ratio_col = np.array([[s.ratio] for s in config.streams], dtype=I64)

    def allocation(
        self, request_ids: tuple[int, ...], runs: list[Run], evicted: EvictionReport, replay: bool = False
    ) -> Allocation:
        """General step: any number of new tokens per request."""
        p = self.page_size
        starts = np.fromiter((r.start for r in runs), I64, len(runs))
        ends = np.fromiter((r.end for r in runs), I64, len(runs))
        lengths = ends - starts
        pos, owner = _ranges(starts, lengths)
        vflat, vbase = self._flatten([r.vpages for r in runs], starts // p)
        swa_first = np.fromiter((r.swa_first for r in runs), I64, len(runs))
        sflat, sbase = self._flatten([r.swa_pages for r in runs], swa_first)
        page = pos // p
        vslots = vflat[vbase[owner] + page] * p + pos % p
        spages = sflat[sbase[owner] + page]

        def swa_page_of(req: np.ndarray, positions: np.ndarray) -> np.ndarray:
            return sflat[sbase[req] + positions // p]

        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(I64)
        return self._build(request_ids, offsets, pos, owner, ends[owner], vslots, spages, starts, swa_page_of, evicted, replay)

    def decode_allocation(
        self,
        requests: Sequence[Request],
        starts: list[int],
        vpages: list[int],
        spages: list[int],
        evicted: EvictionReport,
    ) -> Allocation:
        """Batched decode: exactly one new token per request; all streams computed together."""
        p, n = self.page_size, len(starts)
        pos = np.array(starts, dtype=I64)
        off = pos % p
        vslots = np.array(vpages, dtype=I64) * p + off
        spage_arr = np.array(spages, dtype=I64)
        owner = np.arange(n, dtype=I64)
        # One decode token is always the newest row of its run: every ring row is kept.
        rows = spage_arr * self._ring_len_col + pos % self._ring_len_col
        done = (pos + 1) % self._ratio_col == 0
        streams = []
        for i, s in enumerate(self.config.streams):
            if done[i].any():
                idx = np.flatnonzero(done[i])
                ends = pos[idx]
                carry = self._carry_decode(s, requests, idx, starts)
                entries = (idx, (ends + 1) // s.ratio - 1, compressed_slots(vslots[idx], ends, s))
            else:
                carry = entries = (_EMPTY, _EMPTY, _EMPTY)
            streams.append(StreamWrites(s.ratio, owner, pos, rows[i], *carry, *entries))
        return Allocation(
            request_ids=tuple(r.id for r in requests),
            token_offsets=np.arange(n + 1, dtype=I64),
            positions=pos,
            virtual_slots=vslots,
            swa_slots=spage_arr * p + off,
            streams=tuple(streams),
            evicted=evicted,
        )

    def _carry_decode(
        self, s: StreamSpec, requests: Sequence[Request], idx: np.ndarray, starts: list[int]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        p = self.page_size
        req, pos, pages = [], [], []
        for i in idx.tolist():
            r, start = requests[i], starts[i]
            first = first_inflight(start, s)
            req.extend([i] * (start - first))
            pos.extend(range(first, start))
            pages.extend(r.swa_pages[k // p - r.swa_base] for k in range(first, start))
        pos_arr = np.array(pos, dtype=I64)
        return np.array(req, dtype=I64), pos_arr, ring_rows(np.array(pages, dtype=I64), pos_arr, s)

    @staticmethod
    def _flatten(tables: list[list[int]], first_pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Concatenate page-table slices; ``flat[base[i] + page]`` is request ``i``'s page."""
        sizes = np.fromiter((len(t) for t in tables), I64, len(tables))
        flat = np.fromiter((x for t in tables for x in t), I64, int(sizes.sum()))
        return flat, np.cumsum(sizes) - sizes - first_pages

    def _build(
        self,
        request_ids: tuple[int, ...],
        offsets: np.ndarray,
        pos: np.ndarray,
        owner: np.ndarray,
        run_end: np.ndarray,
        vslots: np.ndarray,
        spages: np.ndarray,
        starts: np.ndarray,
        swa_page_of: Callable[[np.ndarray, np.ndarray], np.ndarray],
        evicted: EvictionReport,
        replay: bool,
    ) -> Allocation:
        p = self.page_size
        streams = tuple(
            self._stream_writes(s, pos, owner, run_end, vslots, spages, starts, swa_page_of, replay)
            for s in self.config.streams
        )
        return Allocation(
            request_ids=request_ids,
            token_offsets=offsets,
            positions=pos,
            virtual_slots=vslots,
            swa_slots=spages * p + pos % p,
            streams=streams,
            evicted=evicted,
            replay=replay,
        )

    def _stream_writes(
        self,
        s: StreamSpec,
        pos: np.ndarray,
        owner: np.ndarray,
        run_end: np.ndarray,
        vslots: np.ndarray,
        spages: np.ndarray,
        starts: np.ndarray,
        swa_page_of: Callable[[np.ndarray, np.ndarray], np.ndarray],
        replay: bool,
    ) -> StreamWrites:
        p, r = self.page_size, s.ratio
        # Keep only rows still needed later: the last ring_len of each page (or of the run).
        keep = pos >= np.minimum((pos // p + 1) * p, run_end) - s.ring_len
        if keep.all():
            ring_req, ring_pos, ring_sp = owner, pos, spages
        else:
            ring_req, ring_pos, ring_sp = owner[keep], pos[keep], spages[keep]
        rows = ring_rows(ring_sp, ring_pos, s)
        # A replay rebuilds window state only: it never rewrites compressed KV.
        done = np.flatnonzero((pos + 1) % r == 0) if not replay else np.zeros(0, I64)
        entry_req = owner[done]
        entry_groups = (pos[done] + 1) // r - 1
        entry_slots = compressed_slots(vslots[done], pos[done], s)
        carry_req, carry_pos, carry_rows = self._carry(s, entry_req, starts, swa_page_of)
        return StreamWrites(
            r, ring_req, ring_pos, rows, carry_req, carry_pos, carry_rows, entry_req, entry_groups, entry_slots
        )

    @staticmethod
    def _carry(
        s: StreamSpec,
        entry_req: np.ndarray,
        starts: np.ndarray,
        swa_page_of: Callable[[np.ndarray, np.ndarray], np.ndarray],
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """In-flight rows from before each run that its completing groups read."""
        if len(entry_req) == 0:
            return _EMPTY, _EMPTY, _EMPTY
        reqs = np.unique(entry_req)
        first = first_inflight(starts[reqs], s)
        carry_pos, local = _ranges(first, starts[reqs] - first)
        carry_req = reqs[local]
        return carry_req, carry_pos, ring_rows(swa_page_of(carry_req, carry_pos), carry_pos, s)

    def read_plan(
        self, length: int, vpages: list[int], swa_first: int, swa_pages: list[int], replay_start: int | None
    ) -> ReadPlan:
        p, w = self.page_size, self.config.window
        swa_pos = np.arange(max(0, length - w), length, dtype=I64)
        stable = np.asarray(swa_pages, dtype=I64)
        swa_slots = stable[swa_pos // p - swa_first] * p + swa_pos % p
        vtable = np.asarray(vpages, dtype=I64)
        streams = []
        for s in self.config.streams:
            ends = np.arange(1, length // s.ratio + 1, dtype=I64) * s.ratio - 1
            slots = compressed_slots(vtable[ends // p] * p + ends % p, ends, s)
            inflight = np.arange(first_inflight(length, s), length, dtype=I64)
            rows = ring_rows(stable[inflight // p - swa_first], inflight, s)
            streams.append(StreamReads(s.ratio, slots, inflight, rows))
        return ReadPlan(length, swa_pos, swa_slots, tuple(streams), replay_start)
