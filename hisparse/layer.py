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
from .device_buffer import BACKUP, DeviceBuffer
from .errors import DeviceBufferFull, InvariantError, MissingPageDataError, require
from .ids import DeviceSlotArray, HostPageArray
from .inputs import StepInput, distinct
from .results import CopyBatch, CopyKind

_NONE = np.zeros(0, np.int64)


@dataclass
class Counters:
    steps: int = 0
    swap_ins: int = 0
    evictions: int = 0
    backups: int = 0
    reads: int = 0
    read_hits: int = 0


@dataclass(frozen=True)
class Placement:
    """What `LayerState.plan` decided; the coordinator wraps it into tickets and a `StepPlan`."""

    swap_pages: HostPageArray
    swap_slots: DeviceSlotArray
    evicted_pages: HostPageArray
    read_slots: DeviceSlotArray
    write_slots: DeviceSlotArray
    backup_pages: HostPageArray
    backup_slots: DeviceSlotArray


def _has_negative(slots: DeviceSlotArray) -> bool:
    return len(slots) > 0 and int(slots.min()) < 0


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
        """
        table = self.buffer.slot_of_page
        read_slots, write_slots = table.take(step.reads), table.take(step.writes)
        self._check_fresh(step)
        if _has_negative(read_slots) or _has_negative(write_slots):
            return self._plan_missing(step, read_slots, write_slots)
        now = self.clock + 1
        self.buffer.lru.touch(read_slots, now)
        self.buffer.lru.touch(write_slots, now)
        backup_pages, backup_slots = self._pin_writes(step)
        self._count(step, len(read_slots), 0, 0, len(backup_pages))
        reads, writes = read_slots.reshape(step.read_shape), write_slots.reshape(step.write_shape)
        return Placement(_NONE, _NONE, _NONE, reads, writes, backup_pages, backup_slots)

    def _check_fresh(self, step: StepInput) -> None:
        fresh = step.fresh_pages
        if len(fresh):
            held = fresh[(self.buffer.slot_of_page[fresh] >= 0) | self.has_host_data[fresh]]
            if len(held):
                reason = "marked fresh but still holds data (release the page before reusing it)"
                raise MissingPageDataError(self.index, held.tolist(), reason)

    def _plan_missing(
        self, step: StepInput, read_slots: DeviceSlotArray, write_slots: DeviceSlotArray
    ) -> Placement:
        """`plan` when some pages are not resident: place them (free slots first, then least
        recently used victims), swap in those that are not fresh, then translate."""
        read_miss = np.flatnonzero(read_slots < 0)
        missing_reads = step.reads.take(read_miss)
        pages, fresh = self._missing(missing_reads, step.writes[write_slots < 0], step)
        slots, victims = self._allocate(len(pages), read_slots, write_slots)
        evicted = self.buffer.evict(victims)
        self.buffer.place(pages, slots)
        self.buffer.lru.touch(slots, self.clock + 1)
        swap_pages, swap_slots = (pages, slots) if fresh is None else (pages[~fresh], slots[~fresh])
        self.buffer.pin(swap_slots, backup=False)
        table = self.buffer.slot_of_page
        hits = len(read_slots) - len(missing_reads)
        read_slots[read_miss] = table.take(missing_reads)
        write_slots = table.take(step.writes)
        backup_pages, backup_slots = self._pin_writes(step)
        self._count(step, hits, len(swap_pages), len(evicted), len(backup_pages))
        reads, writes = read_slots.reshape(step.read_shape), write_slots.reshape(step.write_shape)
        return Placement(swap_pages, swap_slots, evicted, reads, writes, backup_pages, backup_slots)

    def _missing(
        self, missing_reads: HostPageArray, missing_writes: HostPageArray, step: StepInput
    ) -> tuple[HostPageArray, np.ndarray | None]:
        """The distinct non-resident pages (sorted) and which are fresh (``None``: none is);
        raises `MissingPageDataError` for one that holds no data and is not written fresh."""
        pages = distinct(np.concatenate((missing_reads, missing_writes)))
        fresh = np.isin(pages, step.fresh_pages) if len(step.fresh_pages) else None
        no_data = ~self.has_host_data[pages]
        lost = pages[no_data if fresh is None else no_data & ~fresh]
        if len(lost):
            reason = (
                "no data on host or device (never written, or released); mark first writes fresh"
            )
            raise MissingPageDataError(self.index, lost.tolist(), reason)
        return pages, fresh

    def _allocate(
        self, count: int, read_slots: DeviceSlotArray, write_slots: DeviceSlotArray
    ) -> tuple[DeviceSlotArray, DeviceSlotArray]:
        """``count`` slots for new pages: free slots first, then the least recently used movable
        slots. Stamps the step's resident slots first (``-1`` entries hit the LRU's sink) so
        they cannot be chosen. Returns (all slots, the victims among them); on
        `DeviceBufferFull` the stamps are rolled back."""
        buf, now = self.buffer, self.clock + 1
        short = count - min(count, buf.num_free)
        # the step holds at most one distinct slot per element: beyond that, no rollback needed
        movable_at_least = buf.num_resident - self.pending_copies
        sure = short <= movable_at_least - len(read_slots) - len(write_slots)
        saved = None if short == 0 or sure else buf.lru.last_use.copy()
        buf.lru.touch(read_slots, now)
        buf.lru.touch(write_slots, now)
        if short == 0:
            return buf.take_free(count), _NONE
        selection = buf.lru.select(short, now, buf.movable, buf.resident)
        if selection is None:
            needed = count + buf.num_resident - self._movable_untouched(now)
            if saved is None:
                raise InvariantError("the step was sure to fit, yet found no victims")
            buf.lru.last_use[:] = saved
            raise DeviceBufferFull(self.index, needed, buf.num_slots)
        buf.lru.commit(selection)
        if count == short:
            return selection.victims, selection.victims
        free = buf.take_free(count - short)
        return np.concatenate((free, selection.victims)), selection.victims

    def _movable_untouched(self, now: int) -> int:
        buf = self.buffer
        every = np.arange(buf.num_slots)
        return int(np.count_nonzero(buf.movable(every) & (buf.lru.last_use[every] < now)))

    def _pin_writes(self, step: StepInput) -> tuple[HostPageArray, DeviceSlotArray]:
        if not len(step.writes):
            return _NONE, _NONE
        pages = distinct(step.writes)
        slots = self.buffer.slot_of_page.take(pages)
        self.buffer.pin(slots, backup=True)
        self.has_host_data[pages] = False  # the host copy is stale until the backup completes
        return pages, slots

    def _count(self, step: StepInput, hits: int, swapped: int, evicted: int, backed: int) -> None:
        c = self.counters
        self.clock += 1
        c.steps += 1
        c.reads += len(step.reads)
        c.read_hits += hits
        c.swap_ins += swapped
        c.evictions += evicted
        c.backups += backed
        self.pending_copies += swapped + backed

    # -- copies and release ----------------------------------------------------------------------

    def finish(self, batch: CopyBatch) -> None:
        """A copy batch of this layer finished: unpin; a completed backup makes the host copy
        current again once no later backup of the page is pending."""
        if not len(batch):
            return
        self.pending_copies -= len(batch)
        backup = batch.kind is CopyKind.BACKUP
        self.buffer.unpin(batch.device_slots, backup, batch.step)
        if backup:
            slots = batch.device_slots
            done = batch.host_pages[self.buffer.pins[slots] < BACKUP]
            self.has_host_data[done] = True

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
