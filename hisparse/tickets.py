"""Tickets of in-flight copy batches: issued by `plan_step`, redeemed once by `complete`."""

from __future__ import annotations

import numpy as np

from .errors import TicketError, require
from .ids import DeviceSlotArray, HostPageArray
from .results import CopyBatch, CopyKind


class TicketBook:
    """Pending copy batches by ticket. Tickets are 1, 2, 3, ... in issue order, never reused."""

    def __init__(self) -> None:
        self._pending: dict[int, CopyBatch] = {}
        self._next = 1

    def __len__(self) -> int:
        return len(self._pending)

    def issue(
        self, layer: int, step: int, kind: CopyKind, pages: HostPageArray, slots: DeviceSlotArray
    ) -> CopyBatch:
        batch = CopyBatch(self._next, layer, kind, pages, slots, step)
        self._pending[self._next] = batch
        self._next += 1
        return batch

    def redeem(self, ticket: object) -> CopyBatch:
        """Remove and return the pending batch of ``ticket``; raises `TicketError` if it was
        never issued or was already completed (then nothing changes)."""
        if isinstance(ticket, bool) or not isinstance(ticket, (int, np.integer)):
            raise TicketError(f"ticket must be an int, got {ticket!r}")
        ticket = int(ticket)
        batch = self._pending.pop(ticket, None)
        if batch is None:
            issued = 1 <= ticket < self._next
            raise TicketError(f"ticket {ticket} {'already completed' if issued else 'unknown'}")
        return batch

    def pending(self, layer: int | None = None) -> list[CopyBatch]:
        """Pending batches (of one layer, or all), in issue order."""
        return [b for b in self._pending.values() if layer is None or b.layer == layer]

    def holding(self, layer: int, pages: set[int]) -> list[int]:
        """Tickets of ``layer`` whose batches copy one of ``pages``."""
        return [b.ticket for b in self.pending(layer) if pages.intersection(b.host_pages.tolist())]

    def snapshot(self) -> tuple[object, ...]:
        batches = tuple(
            (t, b.layer, b.kind.value, b.host_pages.tobytes(), b.device_slots.tobytes())
            for t, b in self._pending.items()
        )
        return (self._next, batches)

    def check_invariants(self) -> None:
        for ticket, batch in self._pending.items():
            require(batch.ticket == ticket and 1 <= ticket < self._next, "ticket book corrupt")
            require(len(batch.host_pages) == len(batch.device_slots), "ragged copy batch")
