"""A structural, comparable picture of a `Coordinator`: tests use it to prove that a call which
raised changed nothing (LRU stamps and frontier included)."""

from __future__ import annotations

from dataclasses import astuple
from typing import Any

from .coordinator import Coordinator
from .layer import LayerState


def _layer(state: LayerState) -> tuple[Any, ...]:
    buf, f = state.buffer, state.buffer.lru.frontier
    return (
        buf.slot_of_page.tobytes(),
        buf.page_of_slot.tobytes(),
        buf.pins.tobytes(),
        buf.free[: buf.num_free].tobytes(),
        state.pending_copies,
        buf.lru.last_use.tobytes(),
        (f.slots.tobytes(), f.last_use.tobytes(), f.limit, f.pos),
        state.has_host_data.tobytes(),
        state.clock,
        astuple(state.counters),
    )


def snapshot(coordinator: Coordinator) -> tuple[Any, ...]:
    layers = tuple(_layer(s) for s in coordinator._layers)
    return (layers, coordinator._tickets.snapshot())
