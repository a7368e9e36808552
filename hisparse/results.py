"""Typed records the coordinator returns. Copy batches' page and slot arrays are int64 and
read-only.

`plan_step` builds these records on every layer-step, so it bypasses the frozen dataclasses'
``__init__`` (``object.__setattr__`` per field, ~1.5 µs a record): `new_batch` and `new_plan`
fill a new instance's ``__dict__`` directly. The records stay frozen; their arrays are fresh
(or the shared read-only empty array) and made read-only by the coordinator.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .ids import DeviceSlot, DeviceSlotArray, HostPage, HostPageArray


class CopyKind(enum.Enum):
    """Direction of a copy batch."""

    #: host mirror → device buffer, issued before the step's reads and writes
    SWAP_IN = "swap_in"
    #: device buffer → host mirror, issued after the step's writes
    BACKUP = "backup"


def _frozen(array: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    array.setflags(write=False)
    return array


@dataclass(frozen=True, eq=False)
class CopyBatch:
    """Page copies between one layer's host mirror and its device buffer.

    Element ``i`` moves host page ``host_pages[i]`` to or from device slot ``device_slots[i]``
    (direction: ``kind``); pages are distinct. The pages stay pinned — never evicted, never
    released — until `Coordinator.complete(ticket)`. Every batch, empty ones included, must be
    completed exactly once.
    """

    ticket: int
    layer: int
    kind: CopyKind
    host_pages: HostPageArray
    device_slots: DeviceSlotArray
    #: the layer step (1, 2, ...: `BufferStats.steps` after it) that planned the batch
    step: int

    def __post_init__(self) -> None:
        _frozen(self.host_pages)
        _frozen(self.device_slots)

    def __len__(self) -> int:
        return len(self.host_pages)

    def pairs(self) -> list[tuple[HostPage, DeviceSlot]]:
        """The copies as typed ``(host page, device slot)`` pairs (for tests and logging)."""
        return [
            (HostPage(int(p)), DeviceSlot(int(s)))
            for p, s in zip(self.host_pages, self.device_slots)
        ]


@dataclass(frozen=True, eq=False)
class StepPlan:
    """What one layer-step needs the adapter to do, in this order:

    1. issue ``swap_in`` (host → device), on a side stream;
    2. make the step's compute wait for it, write the new entries to ``write_slots`` and attend
       through ``read_slots``;
    3. issue ``backup`` (device → host) after those writes;
    4. call `Coordinator.complete` with each batch's ticket once its copies have finished.

    ``read_slots`` / ``write_slots`` have the shapes of ``reads`` / ``writes``.
    ``evicted_pages`` lost their device copy to make room; their data is on the host (they were
    backed up), so they need no copy — a later read swaps them in again.
    """

    layer: int
    swap_in: CopyBatch
    evicted_pages: HostPageArray
    read_slots: DeviceSlotArray
    write_slots: DeviceSlotArray
    backup: CopyBatch


@dataclass(frozen=True)
class BufferStats:
    """Occupancy and counters of one layer (``layer`` set) or all layers summed (``None``).

    ``resident_pages + free_slots == device_slots`` (per layer). ``pinned_pages`` are resident
    pages some pending copy uses. Counters are in pages, except ``reads`` / ``read_hits``, which
    count elements of the ``reads`` arrays (a hit: the page was resident when the step was
    planned).
    """

    layer: int | None
    device_slots: int
    resident_pages: int
    free_slots: int
    pinned_pages: int
    pending_tickets: int
    steps: int
    swap_ins: int
    evictions: int
    backups: int
    reads: int
    read_hits: int

    @property
    def hit_ratio(self) -> float | None:
        """``read_hits / reads``; ``None`` before any read."""
        return self.read_hits / self.reads if self.reads else None


_new = object.__new__


def new_batch(
    ticket: int,
    layer: int,
    kind: CopyKind,
    host_pages: HostPageArray,
    device_slots: DeviceSlotArray,
    step: int,
) -> CopyBatch:
    """`CopyBatch` without the dataclass ``__init__``; the arrays must already be read-only."""
    batch = _new(CopyBatch)
    fields = batch.__dict__
    fields["ticket"] = ticket
    fields["layer"] = layer
    fields["kind"] = kind
    fields["host_pages"] = host_pages
    fields["device_slots"] = device_slots
    fields["step"] = step
    return batch


def new_plan(
    layer: int,
    swap_in: CopyBatch,
    evicted_pages: HostPageArray,
    read_slots: DeviceSlotArray,
    write_slots: DeviceSlotArray,
    backup: CopyBatch,
) -> StepPlan:
    """`StepPlan` without the dataclass ``__init__``."""
    plan = _new(StepPlan)
    fields = plan.__dict__
    fields["layer"] = layer
    fields["swap_in"] = swap_in
    fields["evicted_pages"] = evicted_pages
    fields["read_slots"] = read_slots
    fields["write_slots"] = write_slots
    fields["backup"] = backup
    return plan
