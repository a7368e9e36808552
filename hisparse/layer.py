"""One C4 layer: its device buffer, which host pages hold data on the host mirror, its clock and
counters, and the planning of one step (`LayerState.plan`).

A page's data lives in one of these places (per layer)::

    nowhere         never written, or released          reads raise; a write must be fresh
    host only       backed up, device copy evicted      a read or write swaps it in
    host + device   resident and backed up              evictable when unpinned
    device only     written, backup pending             pinned until the backup completes
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import HiSparseConfig
from .device_buffer import BACKUP, NOT_RESIDENT, DeviceBuffer
from .errors import DeviceBufferFull, InvariantError, MissingPageDataError, require
from .ids import DeviceSlotArray, HostPageArray
from .inputs import EMPTY, StepInput, distinct
from .results import CopyBatch, CopyKind


@dataclass
class Counters:
    steps: int = 0
    swap_ins: int = 0
    evictions: int = 0
    backups: int = 0
    reads: int = 0
    read_hits: int = 0


#: what `LayerState.plan` decided, wrapped by the coordinator into tickets and a `StepPlan`:
#: (swap pages, swap slots, evicted pages, read slots, write slots, backup pages, backup slots)
Placement = tuple[
    HostPageArray,
    DeviceSlotArray,
    HostPageArray,
    DeviceSlotArray,
    DeviceSlotArray,
    HostPageArray,
    DeviceSlotArray,
]


def _scatter_validates_first() -> bool:
    """Whether numpy checks every index of a fancy assignment before writing any (it does:
    ``mapiter_trivial_set``); then a stamp scatter that raises has changed nothing."""
    probe = np.zeros(4, np.int64)
    try:
        probe[np.array([0, 1, 2, NOT_RESIDENT], np.int64)] = 1
    except IndexError:
        return not probe.any()
    return False  # pragma: no cover - numpy raises for an out-of-bounds index


_SCATTER_VALIDATES_FIRST = _scatter_validates_first()

#: the ufunc reduction without `ndarray.min`'s Python wrapper
_min = np.minimum.reduce
#: pin weights as numpy scalars (no conversion of a Python int per call)
_BACKUP, _ONE = np.int64(BACKUP), np.int64(1)


def _any_negative(slots: DeviceSlotArray) -> bool:
    """Whether a slot array holds `NOT_RESIDENT` (on the few slots of a step's written pages
    Python's ``min`` beats a numpy reduction's fixed cost)."""
    if len(slots) <= 64:
        return bool(len(slots)) and min(slots.tolist()) < 0
    return int(_min(slots)) < 0


class LayerState:
    def __init__(self, index: int, config: HiSparseConfig) -> None:
        self.index = index
        self.buffer = DeviceBuffer(config.device_slots, config.max_host_pages)
        self.has_host_data = np.zeros(config.max_host_pages, np.bool_)
        self.clock = 0
        self.counters = Counters()
        #: pages of this layer's pending copy batches (>= pinned slots)
        self.pending_copies = 0

    # -- planning ------------------------------------------------------------------------------

    def plan(self, step: StepInput) -> Placement:
        """Make every page of ``step`` resident, pin swap-ins and written pages, stamp the LRU.

        Raises `MissingPageDataError` or `DeviceBufferFull` having changed nothing.

        When every page is resident this costs two passes over the reads: the page-table
        gather that is the translation (``mode="wrap"`` skips numpy's bounds check per index:
        the ids were range-checked; the result has the shape of ``reads``) and the LRU stamp
        scatter, which is also the miss check.
        """
        table = self.buffer.slot_of_page
        read_slots = table.take(step.reads, mode="wrap")
        page_slots = table.take(step.write_pages, mode="wrap")
        if len(step.fresh_pages):
            self._check_fresh(step.fresh_pages)
        if _any_negative(page_slots):
            return self._plan_missing(step, read_slots, page_slots, True)
        last_use, now = self.buffer.lru.last_use, self.clock + 1
        if _SCATTER_VALIDATES_FIRST:
            try:  # the stamp scatter is the miss check: NOT_RESIDENT is out of bounds
                last_use[read_slots] = now
            except IndexError:  # raised before anything was written
                return self._plan_missing(step, read_slots, page_slots, False)
        else:
            if read_slots.size and _min(read_slots, axis=None) < 0:
                return self._plan_missing(step, read_slots, page_slots, False)
            last_use[read_slots] = now
        last_use[page_slots] = now
        return self._finish_step(step, read_slots, page_slots, read_slots.size, EMPTY, EMPTY, EMPTY)

    def _finish_step(
        self,
        step: StepInput,
        read_slots: DeviceSlotArray,
        page_slots: DeviceSlotArray,
        hits: int,
        swap_pages: HostPageArray,
        swap_slots: DeviceSlotArray,
        evicted: HostPageArray,
    ) -> Placement:
        """Pin the written pages (now resident at ``page_slots``), count, translate."""
        pages = step.write_pages
        if len(pages):
            pins = self.buffer.pins
            pins[page_slots] = pins[page_slots] + _BACKUP  # distinct slots; `+=` is slower
            self.has_host_data[pages] = False  # the host copy is stale until the backup completes
            write_slots = self.buffer.slot_of_page.take(step.writes, mode="wrap")
            if write_slots.shape != step.write_shape:
                write_slots = write_slots.reshape(step.write_shape)
        else:
            write_slots = EMPTY.reshape(step.write_shape)
        c = self.counters
        self.clock += 1
        c.steps += 1
        c.reads += read_slots.size
        c.read_hits += hits
        if len(swap_pages) or len(evicted):
            c.swap_ins += len(swap_pages)
            c.evictions += len(evicted)
        c.backups += len(pages)
        self.pending_copies += len(swap_pages) + len(pages)
        if read_slots.shape != step.read_shape:
            read_slots = read_slots.reshape(step.read_shape)
        return swap_pages, swap_slots, evicted, read_slots, write_slots, pages, page_slots

    def _check_fresh(self, fresh: HostPageArray) -> None:
        held = fresh[(self.buffer.slot_of_page[fresh] >= 0) | self.has_host_data[fresh]]
        if len(held):
            reason = "marked fresh but still holds data (release the page before reusing it)"
            raise MissingPageDataError(self.index, held.tolist(), reason)

    def _plan_missing(
        self,
        step: StepInput,
        read_slots: DeviceSlotArray,
        page_slots: DeviceSlotArray,
        pages_missing: bool,
    ) -> Placement:
        """`plan` when some pages are not resident (`NOT_RESIDENT` in ``read_slots``, or in
        the written pages' ``page_slots`` if ``pages_missing``): place them (free slots first,
        then least recently used victims), swap in those that are not fresh, then patch their
        slots in."""
        buf = self.buffer
        sink = buf.lru.sink
        flat_slots = read_slots.reshape(-1)  # a view: the gather's result is contiguous
        read_miss = (flat_slots < 0).nonzero()[0]
        missing_reads = step.reads.take(read_miss)  # flat positions
        if pages_missing:
            page_miss = (page_slots < 0).nonzero()[0]
            missing_pages = step.write_pages.take(page_miss)
            missing = np.concatenate((missing_reads, missing_pages))
        else:
            missing = missing_reads
        pages, fresh = self._missing(missing, step.fresh_pages)
        flat_slots[read_miss] = sink  # so that the step's lookup can be stamped whole
        if pages_missing:
            page_slots[page_miss] = sink
        placed, victims = self._allocate(len(pages), read_slots, page_slots)
        evicted = buf.place(pages, placed, victims)
        buf.lru.last_use[placed] = self.clock + 1
        swap_pages, swap_slots = (
            (pages, placed) if fresh is None else (pages[~fresh], placed[~fresh])
        )
        buf.pins[swap_slots] = buf.pins[swap_slots] + _ONE
        table = buf.slot_of_page
        flat_slots[read_miss] = table.take(missing_reads)
        if pages_missing:
            page_slots[page_miss] = table.take(missing_pages)
        hits = read_slots.size - len(read_miss)
        return self._finish_step(
            step, read_slots, page_slots, hits, swap_pages, swap_slots, evicted
        )

    def _missing(
        self, missing: HostPageArray, fresh_pages: HostPageArray
    ) -> tuple[HostPageArray, np.ndarray | None]:
        """The distinct ``missing`` pages (sorted) and which are fresh (``None``: none is);
        raises `MissingPageDataError` for one that holds no data and is not written fresh."""
        pages = distinct(missing)
        usable = self.has_host_data.take(pages)
        fresh = None
        if len(fresh_pages):
            # every fresh page is missing (`_check_fresh`): locate them in the sorted pages
            fresh = np.zeros(len(pages), np.bool_)
            fresh[np.searchsorted(pages, fresh_pages)] = True
            usable = usable | fresh
        if np.count_nonzero(usable) < len(pages):
            lost = pages[~usable]
            reason = (
                "no data on host or device (never written, or released); mark first writes fresh"
            )
            raise MissingPageDataError(self.index, lost.tolist(), reason)
        return pages, fresh

    def _allocate(
        self, count: int, read_slots: DeviceSlotArray, page_slots: DeviceSlotArray
    ) -> tuple[DeviceSlotArray, DeviceSlotArray]:
        """``count`` slots for new pages: free slots first, then the least recently used movable
        slots. Stamps the step's resident slots first (missing ones point to the LRU's sink)
        so they cannot be chosen. Returns (all slots, the victims among them); on
        `DeviceBufferFull` the stamps are rolled back."""
        buf, now = self.buffer, self.clock + 1
        short = count - min(count, buf.num_free)
        # the step holds at most one distinct slot per element: beyond that, no rollback needed
        movable_at_least = buf.num_resident - self.pending_copies
        sure = short <= movable_at_least - read_slots.size - len(page_slots)
        saved = None if short == 0 or sure else buf.lru.last_use.copy()
        buf.lru.touch(read_slots, now)
        buf.lru.touch(page_slots, now)
        if short == 0:
            return buf.take_free(count), EMPTY
        selection = buf.lru.select(short, now, buf.pins, buf.resident)
        if selection is None:
            needed = count + buf.num_resident - self._movable_untouched(now)
            if saved is None:
                raise InvariantError("the step was sure to fit, yet found no victims")
            buf.lru.last_use[:] = saved
            raise DeviceBufferFull(self.index, needed, buf.num_slots)
        buf.lru.commit(selection)
        victims = selection[0]
        if count == short:
            return victims, victims
        free = buf.take_free(count - short)
        return np.concatenate((free, victims)), victims

    def _movable_untouched(self, now: int) -> int:
        buf = self.buffer
        every = np.arange(buf.num_slots)
        return int(np.count_nonzero(buf.movable(every) & (buf.lru.last_use[every] < now)))

    # -- copies and release ----------------------------------------------------------------------

    def finish(self, batch: CopyBatch) -> None:
        """A non-empty copy batch of this layer finished: unpin; a completed backup makes the
        host copy current again once no later backup of the page is pending."""
        slots = batch.device_slots
        self.pending_copies -= len(slots)
        buf = self.buffer
        backup = batch.kind is CopyKind.BACKUP
        left = buf.pins.take(slots) - (_BACKUP if backup else _ONE)
        buf.pins[slots] = left  # the slots are distinct: one gather, one scatter
        lru = buf.lru
        if batch.step * lru.num_slots <= lru.frontier.limit:  # else the frontier is unaffected
            lru.unpinned(slots[left == 0])
        if backup:
            # a page with a later backup pending has no host data yet, and keeps none: its
            # flag was cleared when that backup was planned
            self.has_host_data[batch.host_pages] = left < _BACKUP

    def pinned(self, pages: HostPageArray) -> HostPageArray:
        """Which of ``pages`` are resident and pinned by a pending copy."""
        slots = self.buffer.slot_of_page[pages]
        held = slots >= 0
        return pages[held][self.buffer.pins[slots[held]] > 0]

    def release(self, pages: HostPageArray) -> None:
        """Forget the distinct, unpinned ``pages``: device copy and host data."""
        self.buffer.drop(pages)
        self.has_host_data[pages] = False

    def resident(self, pages: HostPageArray) -> np.ndarray:
        return self.buffer.slot_of_page[pages] >= 0

    # -- checking --------------------------------------------------------------------------------

    def check_invariants(self, pending: list[CopyBatch]) -> None:
        """Buffer invariants with pins recomputed from ``pending`` (this layer's batches); every
        resident page without host data has a pending backup; counters sane."""
        buf = self.buffer
        pins = np.zeros(buf.num_slots, np.int64)
        for batch in pending:
            require(
                np.array_equal(buf.page_of_slot[batch.device_slots], batch.host_pages),
                f"layer {self.index}: ticket {batch.ticket} pages moved while pinned",
            )
            pins[batch.device_slots] += BACKUP if batch.kind is CopyKind.BACKUP else 1
        buf.check_invariants(pins, self.clock)
        copies = sum(len(b) for b in pending)
        require(self.pending_copies == copies, f"layer {self.index}: pending copy count drifted")
        owned = buf.page_of_slot >= 0
        device_only = owned & ~self.has_host_data[np.where(owned, buf.page_of_slot, 0)]
        require(
            bool(np.all(buf.pins[device_only] >= BACKUP)),
            f"layer {self.index}: a page whose only copy is on the device has no pending backup",
        )
        c = self.counters
        counts = (c.steps, c.swap_ins, c.evictions, c.backups, c.reads, c.read_hits)
        require(min(counts) >= 0 and c.read_hits <= c.reads, "counters went negative")
        require(c.steps == self.clock, "clock and step counter disagree")
