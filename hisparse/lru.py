"""Least-recently-used order over one layer's device slots.

Every slot carries ``last_use``, the layer clock of the last step that read or wrote its page;
touching is one vectorised scatter per step. Picking victims must not sort the buffer every
step, so the index keeps a *frontier*: the resident slots not touched at the step that built
it, sorted by ``key = last_use * num_slots + slot`` (unique; ties go to the lower slot), and a
cursor; each selection takes the next valid entries::

    frontier   [ consumed | slots[pos:] ........................ ]   keys ascending to `limit`

Claim kept between calls: every movable slot (resident, unpinned) whose key is ``<= limit`` is
in ``slots[pos:]`` with its current ``last_use``. Keys only grow (touching stamps the current
clock, above ``limit``), so entries whose ``last_use`` changed, or that are pinned now, are
skipped. An entry whose stamp is unchanged is still resident — a slot loses its page either
to a page of the step that evicts it (which stamps it) or to `DeviceBuffer.drop`, which sets
its stamp to ``-1`` (no frontier entry holds that) — so a walk checks stamps and pins only.
Pinned slots stay in the frontier, so unpinning them needs nothing — unless the cursor already
passed them: then `unpinned` drops the frontier and the next selection rebuilds it. A rebuild
is one stable radix sort of the stamps' ages (uint16) when they span < 2**16 steps, one merge
sort otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .errors import require
from .ids import DeviceSlotArray

#: ``resident()``: mask of the slots holding a page
Resident = Callable[[], npt.NDArray[np.bool_]]

_RADIX_SPAN = 1 << 16


@dataclass(eq=False)
class Frontier:
    """Resident slots ascending by key when last rebuilt, and a cursor; see the module doc.
    Only ``pos`` ever changes (`SlotLru.commit`)."""

    slots: DeviceSlotArray
    last_use: npt.NDArray[np.int64]
    limit: int
    pos: int = 0

    @classmethod
    def empty(cls) -> Frontier:
        none = np.zeros(0, np.int64)
        return cls(none, none, limit=-1)

    def cursor_key(self, num_slots: int) -> int:
        """Key of the next entry (``limit + 1`` once exhausted)."""
        if self.pos == len(self.slots):
            return self.limit + 1
        return int(self.last_use[self.pos]) * num_slots + int(self.slots[self.pos])


#: victims of one step (oldest first), the frontier they came from (the current one or a
#: rebuilt one) and its cursor after them: what `SlotLru.commit` installs if the step goes on
Selection = tuple[DeviceSlotArray, Frontier, int]


class SlotLru:
    """LRU clock of one device buffer; `select` is pure, `touch` / `commit` / `unpinned` mutate.

    ``last_use`` has one extra trailing entry, ``sink``: a step whose lookup found pages not
    resident points those elements there, so the whole lookup can be stamped without
    filtering.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.last_use = np.zeros(num_slots + 1, np.int64)
        self.sink = num_slots
        self.frontier = Frontier.empty()
        self._all = np.arange(num_slots, dtype=np.int64)

    def touch(self, slots: DeviceSlotArray, now: int) -> None:
        """Stamp ``now`` (above every earlier stamp) on ``slots``; duplicates and ``sink`` are
        fine."""
        self.last_use[slots] = now

    def select(
        self, count: int, now: int, pins: npt.NDArray[np.int64], resident: Resident
    ) -> Selection | None:
        """The ``count >= 1`` least recently used movable slots (``pins`` zero) not touched at
        ``now``, oldest first, or ``None`` when fewer exist. Mutates nothing (`commit` it)."""
        found = self._walk(self.frontier, count, pins)
        if found is not None:
            return found
        return self._walk(self._rebuild(now, resident), count, pins)

    def commit(self, selection: Selection) -> None:
        _, frontier, cut = selection
        frontier.pos = cut
        self.frontier = frontier

    def unpinned(self, slots: DeviceSlotArray) -> None:
        """``slots`` lost their last pin: drop the frontier if the cursor already passed one of
        them (the frontier must list every movable slot up to its limit). Nothing to do, and
        the caller may skip the call, when they were all stamped after ``frontier.limit``."""
        if len(slots):
            oldest = int((self.last_use[slots] * self.num_slots + slots).min())
            f = self.frontier
            if oldest <= f.limit and oldest < f.cursor_key(self.num_slots):
                self.frontier = Frontier.empty()

    def _walk(
        self, frontier: Frontier, count: int, pins: npt.NDArray[np.int64]
    ) -> Selection | None:
        pos = frontier.pos
        rest = frontier.slots[pos:]
        near = 2 * count + 16  # usually enough: try a short head before the whole rest
        for width in (near, len(rest)) if near < len(rest) else (len(rest),):
            head = rest[:width]
            unchanged = self.last_use.take(head) == frontier.last_use[pos : pos + width]
            found = (unchanged & (pins.take(head) == 0)).nonzero()[0]
            if len(found) >= count:
                return head.take(found[:count]), frontier, pos + int(found[count - 1]) + 1
        return None

    def _rebuild(self, now: int, resident: Resident) -> Frontier:
        stamps = self.last_use[: self.num_slots]
        slots = np.flatnonzero(resident() & (stamps < now))
        if not len(slots):
            return Frontier.empty()
        stamps = stamps[slots]
        low = int(stamps.min())
        if int(stamps.max()) - low < _RADIX_SPAN:
            order = np.argsort((stamps - low).astype(np.uint16), kind="stable")
        else:
            order = np.argsort(stamps, kind="stable")
        slots, stamps = slots[order], stamps[order]
        return Frontier(slots, stamps, limit=int(stamps[-1]) * self.num_slots + int(slots[-1]))

    def check_invariants(
        self,
        movable_mask: npt.NDArray[np.bool_],
        resident_mask: npt.NDArray[np.bool_],
        clock: int,
    ) -> None:
        """Stamps never exceed the clock; the frontier is sorted and lists every movable slot
        whose key is within its limit, with its current stamp; its entries with their current
        stamp are resident."""
        f, n = self.frontier, self.num_slots
        stamps = self.last_use[:n]
        require(int(stamps.max(initial=0)) <= clock, "a slot was touched in the future")
        require(0 <= f.pos <= len(f.slots) == len(f.last_use), "frontier cursor out of range")
        keys = f.last_use * n + f.slots
        require(bool(np.all(np.diff(keys) > 0)), "frontier not sorted by key")
        require(len(keys) == 0 or int(keys[-1]) == f.limit, "frontier limit is not its last key")
        rest = f.slots[f.pos :]
        live = rest[stamps[rest] == f.last_use[f.pos :]]
        gone = live[~resident_mask[live]]
        require(len(gone) == 0, f"free slots {gone[:8].tolist()} look valid in the frontier")
        covered = np.flatnonzero(movable_mask & (stamps * n + self._all <= f.limit))
        missing = np.setdiff1d(covered, live)
        require(len(missing) == 0, f"movable slots {missing[:8].tolist()} escaped the frontier")
