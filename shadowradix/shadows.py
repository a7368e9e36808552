"""Shadow arithmetic: from virtual / SWA pages to the slots every pool writes or reads.

Compressed shadows are pure arithmetic on the virtual page holding a group's last token, ring
shadows second-level arithmetic off the SWA page holding a position (so freeing an SWA page
invalidates its ring rows with no extra bookkeeping). The formulas are `slots`' (shared with the
graph metadata on the device); this module applies them to a step's page-table slices, vectorised
over all its tokens: nothing loops per token in Python.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from types import ModuleType

import numpy as np

from . import slots
from .config import CacheConfig, StreamSpec
from .page_table import page_array
from .results import (
    Allocation,
    EvictionReport,
    ReadPlan,
    StepArrays,
    StreamReads,
    StreamWrites,
)

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
    if len(lengths) == 1:
        n = int(lengths[0])
        return np.arange(starts[0], starts[0] + n, dtype=I64), np.zeros(n, dtype=I64)
    total = int(lengths.sum())
    owner = np.repeat(np.arange(len(lengths), dtype=I64), lengths)
    offsets = np.cumsum(lengths) - lengths
    return starts[owner] + np.arange(total, dtype=I64) - offsets[owner], owner


def first_inflight(
    length: slots.Ints, stream: StreamSpec, xp: ModuleType | None = None
) -> slots.Ints:
    """`slots.first_inflight` of ``stream`` (``xp=np`` for an array of lengths)."""
    return slots.first_inflight(length, stream.ratio, stream.overlap, xp)


def compressed_slots(vslots: np.ndarray, ends: np.ndarray, stream: StreamSpec) -> np.ndarray:
    """Slots of the groups whose last token sits at ``ends`` (virtual slots ``vslots``)."""
    p = stream.page_size
    return slots.compressed_slot(
        slots.page_of(vslots, p), ends, p, stream.ratio, stream.slots_per_page
    )


def ring_rows(swa_pages: np.ndarray, positions: np.ndarray, stream: StreamSpec) -> np.ndarray:
    return slots.ring_row(swa_pages, positions, stream.ring_len)


def _flatten(tables: list[list[int]], first_pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate page-table slices; ``flat[base[i] + page]`` is request ``i``'s page."""
    if len(tables) == 1:
        flat = page_array(tables[0])
        return flat, -first_pages
    sizes = np.fromiter(map(len, tables), I64, len(tables))
    flat = np.fromiter(chain.from_iterable(tables), I64, int(sizes.sum()))
    return flat, np.cumsum(sizes) - sizes - first_pages


@dataclass(frozen=True)
class _Step:
    """Per-token arrays of one step (concatenated over requests) and per-run bounds."""

    offsets: np.ndarray
    pos: np.ndarray
    owner: np.ndarray
    vslots: np.ndarray
    spages: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    swa_page_of: Callable[[np.ndarray, np.ndarray], np.ndarray]


class Shadows:
    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.page_size = config.page_size
        self._shift = slots.log2(config.page_size)
        # one row per stream, shape (streams, 1) even with none (an SWA-only model)
        self._ring_len_col = np.array([s.ring_len for s in config.streams], dtype=I64)[:, None]
        self._ratio_col = np.array([s.ratio for s in config.streams], dtype=I64)[:, None]
        #: a decode token completes a group of some stream iff ``(pos + 1) & mask == 0``
        self.group_mask = min(config.ratios, default=1 << 62) - 1

    def allocation(
        self,
        request_ids: tuple[int, ...],
        runs: list[Run],
        evicted: EvictionReport,
        replay: bool = False,
    ) -> Allocation:
        """General step: any number of new tokens per request (``runs`` are private copies)."""
        starts = [r.start for r in runs]
        ends = [r.end for r in runs]
        return Allocation(request_ids, starts, ends, evicted, replay, self.expander(runs, replay))

    def expander(self, runs: list[Run], replay: bool = False) -> Callable[[], StepArrays]:
        """The deferred per-token arrays of a general step (``runs`` are private copies)."""
        return lambda: self._expand_runs(runs, replay)

    def decode_expander(
        self,
        starts: list[int],
        vpages: list[int],
        spages: list[int],
        carry_tables: dict[int, tuple[int, list[int]]],
    ) -> Callable[[], StepArrays]:
        """The deferred arrays of a batched decode step: one new token per request.
        ``carry_tables`` maps the index of each request whose token completes a group to a copy
        of its window table (first page, pages), for the in-flight rows that group reads."""
        return lambda: self._expand_decode(starts, vpages, spages, carry_tables)

    def _expand_runs(self, runs: list[Run], replay: bool) -> StepArrays:
        if len(runs) == 1:
            return self._expand_one(runs[0], replay)
        return self._expand_many(runs, replay)

    def _expand_many(self, runs: list[Run], replay: bool) -> StepArrays:
        p = self.page_size
        starts = np.fromiter((r.start for r in runs), I64, len(runs))
        ends = np.fromiter((r.end for r in runs), I64, len(runs))
        lengths = ends - starts
        pos, owner = _ranges(starts, lengths)
        vflat, vbase = _flatten([r.vpages for r in runs], starts >> self._shift)
        swa_first = np.fromiter((r.swa_first for r in runs), I64, len(runs))
        sflat, sbase = _flatten([r.swa_pages for r in runs], swa_first)
        page = pos >> self._shift
        vslots = slots.page_slot(vflat[vbase[owner] + page], pos, p)
        spages = sflat[sbase[owner] + page]

        def swa_page_of(req: np.ndarray, positions: np.ndarray) -> np.ndarray:
            return sflat[sbase[req] + (positions >> self._shift)]

        # Keep only ring rows still needed later: the last ring_len of each page (or of the run).
        keep = pos >= np.minimum((page + 1) * p, ends[owner]) - self._ring_len_col
        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(I64)
        step = _Step(offsets, pos, owner, vslots, spages, starts, ends, swa_page_of)
        return self._assemble(step, keep, replay)

    def _expand_one(self, run: Run, replay: bool) -> StepArrays:
        """`_expand_runs` for one request (a prefill chunk, a replay): the same arrays, with
        the per-request indexing and masks replaced by ranges (a third of the NumPy calls)."""
        p, shift, start, end = self.page_size, self._shift, run.start, run.end
        pos = np.arange(start, end, dtype=I64)
        owner = np.zeros(end - start, dtype=I64)
        vtab = page_array(run.vpages)
        stab = page_array(run.swa_pages)
        keep = None  # page 1: ring_len is 1, every row is the last of its page and kept
        if p == 1:  # a slot a page and ring_len 1: the slots and ring rows are the page ids
            vslots, spages = vtab.copy(), stab[start - run.swa_first :]  # vtab may be read-only
            rows = (spages,) * len(self.config.streams)
        else:
            page = pos >> shift
            vslots = slots.page_slot(vtab[page - (start >> shift)], pos, p)
            spages = stab[page - run.swa_first]
            keep = pos >= np.minimum((page + 1) * p, end) - self._ring_len_col
            rows = slots.ring_row(spages, pos, self._ring_len_col)
        streams = []
        for i, s in enumerate(self.config.streams):
            if keep is None or keep[i].all():
                ring = (owner, pos, rows[i])
            else:
                ring = (owner[keep[i]], pos[keep[i]], rows[i][keep[i]])
            g0, g1 = start // s.ratio, end // s.ratio  # groups completing now: [g0, g1)
            entries = carry = (_EMPTY, _EMPTY, _EMPTY)
            if g1 > g0 and not replay:
                groups = np.arange(g0, g1, dtype=I64)
                e0, e1 = slots.group_end(g0, s.ratio), slots.group_end(g1, s.ratio)
                ends = np.arange(e0, e1, s.ratio, dtype=I64)  # group_end(groups)
                first = first_inflight(start, s)
                cpos = np.arange(first, start, dtype=I64)
                if p == 1:  # one slot and one ring row a page: the formulas are the page ids
                    entry_slots = vslots[e0 - start : e1 - start : s.ratio].copy()
                    crows = stab[first - run.swa_first : start - run.swa_first]
                else:
                    entry_slots = compressed_slots(vslots[ends - start], ends, s)
                    crows = ring_rows(stab[(cpos >> shift) - run.swa_first], cpos, s)
                entries = (np.zeros(g1 - g0, dtype=I64), groups, entry_slots)
                carry = (np.zeros(start - first, dtype=I64), cpos, crows)
            streams.append(StreamWrites(s.ratio, *ring, *carry, *entries))
        swa_slots = spages.copy() if p == 1 else slots.page_slot(spages, pos, p)
        offsets = np.array([0, end - start], dtype=I64)
        return StepArrays(offsets, pos, vslots, swa_slots, tuple(streams))

    def _expand_decode(
        self,
        starts: list[int],
        vpages: list[int],
        spages: list[int],
        carry_tables: dict[int, tuple[int, list[int]]],
    ) -> StepArrays:
        p, n = self.page_size, len(starts)
        pos = np.array(starts, dtype=I64)
        vslots = slots.page_slot(np.array(vpages, dtype=I64), pos, p)

        def swa_page_of(req: np.ndarray, positions: np.ndarray) -> np.ndarray:
            reqs = np.unique(req)
            tables = [carry_tables[i] for i in reqs.tolist()]
            first = np.fromiter((t[0] for t in tables), I64, len(tables))
            flat, base = _flatten([t[1] for t in tables], first)
            return flat[base[np.searchsorted(reqs, req)] + (positions >> self._shift)]

        step = _Step(
            np.arange(n + 1, dtype=I64),
            pos,
            np.arange(n, dtype=I64),
            vslots,
            np.array(spages, dtype=I64),
            pos,
            pos + 1,
            swa_page_of,
        )
        return self._assemble(step, None, False)  # a decode token's ring row is always kept

    def _assemble(self, step: _Step, keep: np.ndarray | None, replay: bool) -> StepArrays:
        """Per-stream writes, computed for all streams at once (one row per stream)."""
        pos, owner = step.pos, step.owner
        rows = slots.ring_row(step.spages, pos, self._ring_len_col)
        # A replay rebuilds window state only: it never rewrites compressed KV.
        done = None if replay else slots.completes_group(pos, self._ratio_col)
        streams = []
        for i, s in enumerate(self.config.streams):
            if keep is None or keep[i].all():
                ring = (owner, pos, rows[i])
            else:
                ring = (owner[keep[i]], pos[keep[i]], rows[i][keep[i]])
            if done is not None and done[i].any():
                idx = np.flatnonzero(done[i])
                ends = pos[idx]
                entries = (
                    owner[idx],
                    slots.group_of(ends, s.ratio),
                    compressed_slots(step.vslots[idx], ends, s),
                )
                carry = self._carry(s, step)
            else:
                entries = carry = (_EMPTY, _EMPTY, _EMPTY)
            streams.append(StreamWrites(s.ratio, *ring, *carry, *entries))
        swa_slots = slots.page_slot(step.spages, pos, self.page_size)
        return StepArrays(step.offsets, pos, step.vslots, swa_slots, tuple(streams))

    @staticmethod
    def _carry(s: StreamSpec, step: _Step) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """In-flight rows from before each run that its completing groups read."""
        reqs = np.flatnonzero(step.ends // s.ratio > step.starts // s.ratio)
        starts = step.starts[reqs]
        first = first_inflight(starts, s, np)
        carry_pos, local = _ranges(first, starts - first)
        carry_req = reqs[local]
        return carry_req, carry_pos, ring_rows(step.swa_page_of(carry_req, carry_pos), carry_pos, s)

    def read_plan(
        self,
        length: int,
        window_end: int,
        vpages: Sequence[int],
        swa_first: int,
        swa_pages: list[int],
        replay_start: int | None,
    ) -> ReadPlan:
        p, w = self.page_size, self.config.window
        first = slots.clamp_low(slots.window_first(window_end, w))
        swa_pos = np.arange(first, length, dtype=I64)
        stable = np.asarray(swa_pages, dtype=I64)
        swa_slots = slots.page_slot(stable[(swa_pos >> self._shift) - swa_first], swa_pos, p)
        vtable = np.asarray(vpages, dtype=I64)
        streams = []
        for s in self.config.streams:
            ends = slots.group_end(np.arange(length // s.ratio, dtype=I64), s.ratio)
            entry_slots = slots.compressed_slot(
                vtable[ends >> self._shift], ends, p, s.ratio, s.slots_per_page
            )
            inflight = np.arange(first_inflight(length, s), length, dtype=I64)
            rows = ring_rows(stable[(inflight >> self._shift) - swa_first], inflight, s)
            streams.append(StreamReads(s.ratio, entry_slots, inflight, rows))
        return ReadPlan(length, swa_pos, swa_slots, tuple(streams), replay_start)
