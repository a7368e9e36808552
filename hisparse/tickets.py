"""Tickets of in-flight copy batches: issued by `plan_step`, redeemed once by `complete`."""

from __future__ import annotations

import numpy as np

from .errors import TicketError, require
from .ids import DeviceSlotArray, HostPageArray
from .results import CopyBatch, CopyKind, new_batch

_SWAP_IN, _BACKUP = CopyKind.SWAP_IN, CopyKind.BACKUP


class TicketBook:
    """Pending copy batches by ticket. Tickets are 1, 2, 3, ... in issue order, never reused."""

    def __init__(self) -> None:
        #: pending batches by ticket, in issue order (`Coordinator.complete` pops from it)
        self.by_ticket: dict[int, CopyBatch] = {}
        self._next = 1

    def __len__(self) -> int:
        return len(self.by_ticket)

    def issue_step(
        self,
        layer: int,
        step: int,
        swap_pages: HostPageArray,
        swap_slots: DeviceSlotArray,
        backup_pages: HostPageArray,
        backup_slots: DeviceSlotArray,
    ) -> tuple[CopyBatch, CopyBatch]:
        """The swap-in and backup batches of one step (two tickets, in that order)."""
        ticket = self._next
        if len(swap_pages):
            swap_pages.setflags(write=False)
            swap_slots.setflags(write=False)
        if len(backup_pages):
            backup_pages.setflags(write=False)
            backup_slots.setflags(write=False)
        swap_in = new_batch(ticket, layer, _SWAP_IN, swap_pages, swap_slots, step)
        backup = new_batch(ticket + 1, layer, _BACKUP, backup_pages, backup_slots, step)
        by_ticket = self.by_ticket
        by_ticket[ticket] = swap_in
        by_ticket[ticket + 1] = backup
        self._next = ticket + 2
        return swap_in, backup

    def redeem(self, ticket: object) -> CopyBatch:
        """Remove and return the pending batch of ``ticket``; raises `TicketError` if it was
        never issued or was already completed (then nothing changes)."""
        if isinstance(ticket, bool) or not isinstance(ticket, (int, np.integer)):
            raise TicketError(f"ticket must be an int, got {ticket!r}")
        ticket = int(ticket)
        batch = self.by_ticket.pop(ticket, None)
        if batch is None:
            issued = 1 <= ticket < self._next
            raise TicketError(f"ticket {ticket} {'already completed' if issued else 'unknown'}")
        return batch

    def pending(self, layer: int | None = None) -> list[CopyBatch]:
        """Pending batches (of one layer, or all), in issue order."""
        return [b for b in self.by_ticket.values() if layer is None or b.layer == layer]

    def holding(self, layer: int, pages: set[int]) -> list[int]:
        """Tickets of ``layer`` whose batches copy one of ``pages``."""
        return [b.ticket for b in self.pending(layer) if pages.intersection(b.host_pages.tolist())]

    def snapshot(self) -> tuple[object, ...]:
        batches = tuple(
            (t, b.layer, b.kind.value, b.host_pages.tobytes(), b.device_slots.tobytes())
            for t, b in self.by_ticket.items()
        )
        return (self._next, batches)

    def check_invariants(self) -> None:
        for ticket, batch in self.by_ticket.items():
            require(batch.ticket == ticket and 1 <= ticket < self._next, "ticket book corrupt")
            require(len(batch.host_pages) == len(batch.device_slots), "ragged copy batch")
