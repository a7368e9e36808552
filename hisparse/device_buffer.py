"""One layer's device buffer as an index: which host page each slot holds, the free slots, the
pins of in-flight copies and the LRU clock. The bytes live in the adapter's tensors.

Page table and slot table are inverse arrays (internal only)::

    slot_of_page  [max_host_pages]   host page -> slot, or NOT_RESIDENT
    page_of_slot  [device_slots]     slot -> host page, or -1 (free)
    pins          [device_slots]     pending copies using the slot: swap-ins + BACKUP * backups
    free[:num_free]                  free slots, a stack (pops slot 0 first when new)

Both kinds of pin share one counter (one scatter per batch): ``pins == 0`` is "unpinned",
``pins >= BACKUP`` is "a backup is pending" (the page's only current copy is on the device).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .errors import require
from .ids import DeviceSlotArray, HostPageArray
from .lru import SlotLru

#: weight of one pending backup in `DeviceBuffer.pins` (a pending swap-in weighs 1)
BACKUP = 1 << 32

#: `slot_of_page` of a page without a slot: negative, and out of bounds for every slot-indexed
#: array, so that indexing one with it raises (`LayerState.plan` relies on that)
NOT_RESIDENT = -(1 << 62)


class DeviceBuffer:
    def __init__(self, num_slots: int, max_host_pages: int) -> None:
        self.num_slots = num_slots
        self.max_host_pages = max_host_pages
        self.slot_of_page = np.full(max_host_pages, NOT_RESIDENT, np.int64)
        self.page_of_slot = np.full(num_slots, -1, np.int64)
        self.pins = np.zeros(num_slots, np.int64)
        self.free = np.arange(num_slots - 1, -1, -1, dtype=np.int64)
        self.num_free = num_slots
        self.lru = SlotLru(num_slots)

    @property
    def num_resident(self) -> int:
        return self.num_slots - self.num_free

    def resident(self) -> npt.NDArray[np.bool_]:
        """Mask of the slots that hold a page."""
        return self.page_of_slot >= 0

    def movable(self, slots: DeviceSlotArray) -> npt.NDArray[np.bool_]:
        """Which ``slots`` hold a resident page no pending copy uses (eviction candidates)."""
        return (self.page_of_slot[slots] >= 0) & (self.pins[slots] == 0)

    def take_free(self, count: int) -> DeviceSlotArray:
        """Pop ``count <= num_free`` free slots."""
        self.num_free -= count
        return self.free[self.num_free : self.num_free + count][::-1].copy()

    def place(
        self, pages: HostPageArray, slots: DeviceSlotArray, victims: DeviceSlotArray
    ) -> HostPageArray:
        """Map distinct non-resident ``pages`` to ``slots``: free slots and ``victims``, whose
        pages are evicted (unmapped) first. Returns the evicted pages."""
        evicted = self.page_of_slot.take(victims)
        if len(evicted):
            self.slot_of_page[evicted] = NOT_RESIDENT
        self.page_of_slot[slots] = pages
        self.slot_of_page[pages] = slots
        return evicted

    def drop(self, pages: HostPageArray) -> None:
        """Unmap whichever of the distinct, unpinned ``pages`` are resident; free their slots.
        Their LRU stamps become ``-1``, which invalidates their frontier entries."""
        slots = self.slot_of_page[pages]
        held = slots >= 0
        slots = slots[held]
        self.slot_of_page[pages[held]] = NOT_RESIDENT
        self.page_of_slot[slots] = -1
        self.lru.last_use[slots] = -1
        self.free[self.num_free : self.num_free + len(slots)] = slots
        self.num_free += len(slots)

    def check_invariants(self, expected_pins: npt.NDArray[np.int64], clock: int) -> None:
        """Tables inverse on resident pages, no slot owned twice, free + resident = slots, pins
        equal to what the pending copies account for, pinned slots resident, LRU sound."""
        pages = np.flatnonzero(self.slot_of_page >= 0)
        slots = self.slot_of_page[pages]
        negative = self.slot_of_page[self.slot_of_page < 0]
        require(bool(np.all(negative == NOT_RESIDENT)), "page table holds a negative slot")
        require(int(slots.max(initial=-1)) < self.num_slots, "page table slot out of range")
        require(len(np.unique(slots)) == len(slots), "a slot is owned by two pages")
        require(np.array_equal(self.page_of_slot[slots], pages), "slot table disagrees")
        owned = self.page_of_slot >= 0
        require(int(owned.sum()) == len(pages), "slot table holds pages the page table lacks")
        free = self.free[: self.num_free]
        require(np.array_equal(np.sort(free), np.flatnonzero(~owned)), "free stack is wrong")
        require(self.num_free + len(pages) == self.num_slots, "free + resident != device_slots")
        require(np.array_equal(self.pins, expected_pins), "pins differ from pending copies")
        require(bool(np.all(owned[self.pins > 0])), "a pinned slot is not resident")
        self.lru.check_invariants(owned & (self.pins == 0), owned, clock)
