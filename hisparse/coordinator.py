"""`Coordinator`: the HiSparse working-set planner of every C4 layer. Pure: it decides which
host pages occupy which device slots and which copies to make; the adapter executes them."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .config import HiSparseConfig
from .errors import ConfigError, PinnedPageError, require
from .inputs import StepInput, as_host_pages, as_layer, distinct
from .layer import LayerState
from .results import BufferStats, StepPlan, new_plan
from .tickets import TicketBook


class Coordinator:
    """Plans each C4 layer-step's copies and slot translation; tracks in-flight copies by ticket.

    Every method validates its arguments before changing anything, and every error leaves the
    coordinator exactly as it was. With ``config.debug`` each mutating call (`plan_step`,
    `complete`, `release`) ends with `check_invariants`.
    """

    def __init__(self, config: HiSparseConfig) -> None:
        if not isinstance(config, HiSparseConfig):
            raise ConfigError(f"expected a HiSparseConfig, got {type(config).__name__}")
        self.config = config
        self._layers = [LayerState(i, config) for i in range(config.num_layers)]
        self._tickets = TicketBook()
        # hot-path copies of config fields (the config is frozen)
        self._num_layers = config.num_layers
        self._max_host_pages = config.max_host_pages
        self._debug = config.debug

    def plan_step(
        self,
        layer: int,
        reads: npt.ArrayLike,
        writes: npt.ArrayLike,
        fresh: npt.ArrayLike | None = None,
    ) -> StepPlan:
        """Plan one step of ``layer``: every page of ``reads`` and ``writes`` gets a device slot.

        ``reads``: host pages the step's attention reads (any shape, duplicates allowed).
        ``writes``: host pages receiving new entries (any shape, duplicates allowed).
        ``fresh``: bool mask aligned with ``writes``; ``True`` marks a page's first write since
        it was allocated (or released): it holds no data, so it gets a slot without a swap-in.

        Mutates: missing pages are placed (free slots first, then least recently used unpinned
        pages not in this step are evicted); swap-in pages and written pages are pinned until
        their tickets complete; written pages' host copies count as stale until then; the LRU
        stamps every page of the step. Raises `InvalidInputError` (bad layer, page out of range,
        non-integer array, mis-shaped ``fresh``), `MissingPageDataError` (a read or non-fresh
        write of a page holding no data, a fresh page that holds data) or `DeviceBufferFull`;
        all with nothing changed.
        """
        if type(layer) is int and 0 <= layer < self._num_layers:
            index = layer
        else:
            index = as_layer(layer, self._num_layers)
        step = StepInput.parse(reads, writes, fresh, self._max_host_pages)
        state = self._layers[index]
        swap_pages, swap_slots, evicted, read_slots, write_slots, backup_pages, backup_slots = (
            state.plan(step)
        )
        swap_in, backup = self._tickets.issue_step(
            index, state.clock, swap_pages, swap_slots, backup_pages, backup_slots
        )
        plan = new_plan(index, swap_in, evicted, read_slots, write_slots, backup)
        if self._debug:
            self.check_invariants()
        return plan

    def complete(self, ticket: int) -> None:
        """A copy batch finished: unpin its pages (a backup also makes the host copy current).

        Completions may come in any order. Raises `TicketError` for a ticket never issued or
        already completed (nothing changes).
        """
        batch = self._tickets.by_ticket.pop(ticket, None) if type(ticket) is int else None
        if batch is None:
            batch = self._tickets.redeem(ticket)  # validates; raises `TicketError`
        if len(batch.device_slots):  # an empty batch pinned nothing
            self._layers[batch.layer].finish(batch)
        if self._debug:
            self.check_invariants()

    def release(self, host_pages: npt.ArrayLike) -> None:
        """The cache freed these virtual pages: in every layer, drop their device copy (freeing
        the slot) and forget their host data; a later read raises, a later write must be fresh.

        Pages that hold nothing are ignored. Raises `InvalidInputError` for ids out of range and
        `PinnedPageError` if a pending copy still uses one of the pages in any layer — complete
        its ticket first (the copy may still be reading or writing the page); nothing changes.
        """
        pages = as_host_pages(host_pages, self.config.max_host_pages, "host_pages")
        pages = distinct(pages.reshape(-1))
        pinned = [(s.index, s.pinned(pages)) for s in self._layers]
        held = sorted({int(p) for _, ps in pinned for p in ps})
        if held:
            tickets = [t for i, ps in pinned for t in self._tickets.holding(i, set(ps.tolist()))]
            raise PinnedPageError(held, tickets)
        for state in self._layers:
            state.release(pages)
        self._debug_check()

    def resident(self, layer: int, host_pages: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """Whether each of ``host_pages`` (any shape) has a device slot in ``layer``."""
        index = as_layer(layer, self.config.num_layers)
        pages = as_host_pages(host_pages, self.config.max_host_pages, "host_pages")
        return self._layers[index].resident(pages)

    def slots(self, layer: int, host_pages: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """The device slot of each of ``host_pages`` (any shape) in ``layer``, ``-1`` where the
        page has none: what a device-resident copy of the page table holds (graph decode)."""
        index = as_layer(layer, self.config.num_layers)
        pages = as_host_pages(host_pages, self.config.max_host_pages, "host_pages")
        out = np.asarray(self._layers[index].buffer.slot_of_page[pages])  # a new array
        return np.maximum(out, -1, out=out)  # `NOT_RESIDENT` -> -1: one pass, no copy

    def holds(self, host_pages: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """Whether each of ``host_pages`` (any shape) holds data in any layer: a device copy,
        or current host data."""
        pages = as_host_pages(host_pages, self.config.max_host_pages, "host_pages")
        out = np.zeros(pages.shape, np.bool_)
        for state in self._layers:
            out |= state.resident(pages) | state.has_host_data[pages]
        return out

    @property
    def pending_tickets(self) -> tuple[int, ...]:
        """Tickets issued and not yet completed, in issue order."""
        return tuple(b.ticket for b in self._tickets.pending())

    def stats(self, layer: int | None = None) -> BufferStats:
        """Occupancy and counters of ``layer``, or summed over all layers (``layer=None``)."""
        if layer is None:
            parts = [self._layer_stats(s) for s in self._layers]
            totals = [sum(getattr(p, f) for p in parts) for f in _SUMMED]
            return BufferStats(None, *totals)
        return self._layer_stats(self._layers[as_layer(layer, self.config.num_layers)])

    def _layer_stats(self, state: LayerState) -> BufferStats:
        buf, c = state.buffer, state.counters
        return BufferStats(
            layer=state.index,
            device_slots=buf.num_slots,
            resident_pages=buf.num_resident,
            free_slots=buf.num_free,
            pinned_pages=int(np.count_nonzero(buf.pins)),
            pending_tickets=len(self._tickets.pending(state.index)),
            steps=c.steps,
            swap_ins=c.swap_ins,
            evictions=c.evictions,
            backups=c.backups,
            reads=c.reads,
            read_hits=c.read_hits,
        )

    def check_invariants(self) -> None:
        """Raise `InvariantError` unless, in every layer: page and slot tables are inverse on
        resident pages, no slot is owned twice, free + resident slots = ``device_slots``, pin
        counts equal the pending tickets' copies (so every pending ticket's pages are pinned and
        resident at its slots), a page whose only copy is on the device has a pending backup,
        the LRU frontier lists every old unpinned page, counters are >= 0."""
        self._tickets.check_invariants()
        for state in self._layers:
            state.check_invariants(self._tickets.pending(state.index))
        require(
            sum(len(self._tickets.pending(s.index)) for s in self._layers) == len(self._tickets),
            "a pending ticket names no layer",
        )

    def _debug_check(self) -> None:
        if self._debug:
            self.check_invariants()


_SUMMED = (
    "device_slots",
    "resident_pages",
    "free_slots",
    "pinned_pages",
    "pending_tickets",
    "steps",
    "swap_ins",
    "evictions",
    "backups",
    "reads",
    "read_hits",
)
