"""Model-based stateful test of the HiSparse coordinator.

A plain-Python model keeps, per layer, the newest version of every page that holds data, which
page sits in which slot, LRU stamps and the pending copies. A simulated device buffer and host
mirror hold fingerprints ``(page, version)`` and change only through what the plans say:

* a swap-in copies host → device when planned (the step's compute waits for it);
* the step then writes new versions into its write slots and reads through its read slots;
* a backup copies device → host when it completes — the latest moment the copy may run, so a
  slot reused before its backup completed hands the host another page's data.

Checked: every read slot holds its page's newest data; an evicted page's newest data is on the
host (demoted, not lost) and it was the least recently used unpinned page outside the step;
swap-ins are exactly the missing non-fresh pages; `DeviceBufferFull` exactly when the step's
distinct pages plus pinned pages exceed the buffer; failed calls change nothing (snapshot);
`check_invariants()` after every step. Tiny buffers (1-8 slots) keep eviction constant.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from hypothesis import HealthCheck, event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)
from hypothesis.stateful import (
    run_state_machine_as_test as run_machine,
)

from hisparse import (
    Coordinator,
    CopyBatch,
    CopyKind,
    DeviceBufferFull,
    HiSparseConfig,
    MissingPageDataError,
    PinnedPageError,
    StepPlan,
    TicketError,
)
from hisparse.snapshot import snapshot

Fingerprint = tuple[int, int]  # (host page, version)


@dataclass
class LayerModel:
    latest: dict[int, int] = field(default_factory=dict)  # page -> newest version
    host: dict[int, int] = field(default_factory=dict)  # simulated host mirror
    device: dict[int, Fingerprint] = field(default_factory=dict)  # simulated device buffer
    where: dict[int, int] = field(default_factory=dict)  # resident page -> slot
    stamp: dict[int, int] = field(default_factory=dict)  # page -> step of last read / write


def _ids(array: np.ndarray) -> list[int]:
    return [int(x) for x in array.reshape(-1)]


class HiSparseMachine(RuleBasedStateMachine):
    tickets = Bundle("tickets")
    #: steps executed by every instance (checked by `test_machine_really_steps`)
    steps_run = 0

    @initialize(
        num_layers=st.integers(1, 2),
        device_slots=st.integers(1, 8),
        extra_pages=st.integers(1, 8),
    )
    def setup(self, num_layers: int, device_slots: int, extra_pages: int) -> None:
        self.config = HiSparseConfig(num_layers, device_slots, device_slots + extra_pages)
        self.coord = Coordinator(self.config)
        self.models = [LayerModel() for _ in range(num_layers)]
        self.pending: dict[int, CopyBatch] = {}
        self.completed: list[int] = []
        self.version = 0
        self.clock = 0
        note(f"config={self.config}")

    # -- helpers -------------------------------------------------------------------------------

    def _pinned(self, layer: int) -> set[int]:
        return {p for b in self.pending.values() if b.layer == layer for p in _ids(b.host_pages)}

    def _expect_unchanged(self, error: type[Exception], call, *args) -> Exception:  # type: ignore[no-untyped-def]
        before = snapshot(self.coord)
        try:
            call(*args)
        except error as raised:
            assert snapshot(self.coord) == before, f"{error.__name__} changed the coordinator"
            return raised
        raise AssertionError(f"expected {error.__name__}")

    def _draw_step(self, data: st.DataObject, m: LayerModel, mode: str) -> tuple:
        """Random top-k rows over pages holding data (``demoted``: mostly pages whose device
        copy was evicted), plus writes of held pages and fresh ones (a page may repeat;
        ``fresh``: at least one fresh page)."""
        known = sorted(m.latest)
        new = [p for p in range(self.config.max_host_pages) if p not in m.latest]
        least = 1 if mode == "fresh" else 0
        fresh = (
            data.draw(st.lists(st.sampled_from(new), min_size=least, max_size=3, unique=True))
            if new
            else []
        )
        old = data.draw(st.lists(st.sampled_from(known), max_size=2)) if known else []
        writes = [(p, False) for p in old] + [(p, True) for p in fresh]
        writes += [(p, False) for p in fresh[:1]] * data.draw(st.integers(0, 1))
        writes = data.draw(st.permutations(writes))
        away = [p for p in known if p not in m.where]
        readable = (away if mode == "demoted" and away else known) + fresh
        k = data.draw(st.integers(0, 4)) if readable else 0
        row = st.lists(st.sampled_from(readable), min_size=k, max_size=k) if k else st.just([])
        reads = data.draw(st.lists(row, min_size=1, max_size=3), label="reads")
        return reads, [p for p, _ in writes], [f for _, f in writes]

    # -- rules ---------------------------------------------------------------------------------

    @rule(target=tickets, data=st.data())
    def step(self, data: st.DataObject):  # type: ignore[no-untyped-def]
        return self._step(data, "mixed")

    @rule(target=tickets, data=st.data())
    def step_writing_new_pages(self, data: st.DataObject):  # type: ignore[no-untyped-def]
        return self._step(data, "fresh")

    @rule(target=tickets, data=st.data())
    def step_reading_demoted_pages(self, data: st.DataObject):  # type: ignore[no-untyped-def]
        return self._step(data, "demoted")

    def _step(self, data: st.DataObject, mode: str):  # type: ignore[no-untyped-def]
        layer = data.draw(st.integers(0, self.config.num_layers - 1), label="layer")
        m = self.models[layer]
        reads, writes, fresh = self._draw_step(data, m, mode)
        read_array = np.array(reads, np.int64).reshape(len(reads), -1)
        pages = set(_ids(read_array)) | set(writes)
        needed = len(pages) + len(self._pinned(layer) - pages)
        args = (layer, read_array, np.array(writes, np.int64), np.array(fresh, np.bool_))
        note(f"plan layer {layer}: reads={reads} writes={writes} fresh={fresh}")
        if needed > self.config.device_slots:
            error = self._expect_unchanged(DeviceBufferFull, self.coord.plan_step, *args)
            assert isinstance(error, DeviceBufferFull) and error.needed_slots == needed
            event("device buffer full")
            return multiple()
        plan = self.coord.plan_step(*args)
        self._observe(m, plan, read_array, writes, fresh)
        # copies that finish before the next call (or have nothing to copy) complete at once
        settled = data.draw(st.booleans(), label="copies finish at once")
        batches = data.draw(st.permutations([plan.swap_in, plan.backup]))
        for batch in batches:
            if settled or not len(batch):
                self._complete(batch)
            else:
                self.pending[batch.ticket] = batch
        return multiple(*(b for b in batches if b.ticket in self.pending))

    def _observe(
        self, m: LayerModel, plan: StepPlan, reads: np.ndarray, writes: list, fresh: list
    ) -> None:
        step_pages = set(_ids(reads)) | set(writes)
        missing = sorted(p for p in step_pages if p not in m.where)
        fresh_pages = {p for p, f in zip(writes, fresh) if f}
        assert _ids(plan.swap_in.host_pages) == [p for p in missing if p not in fresh_pages], (
            "swap-ins are not exactly the missing pages that hold data"
        )
        self._check_evictions(m, plan, step_pages, len(missing))
        self._apply_placement(m, plan, missing, writes)
        for page in sorted(set(writes)):  # the step's writes land after its swap-ins
            slots = {int(s) for p, s in zip(writes, plan.write_slots) if p == page}
            assert slots == {m.where[page]}, f"page {page} written to slots {slots}"
            self.version += 1
            m.latest[page] = self.version
            m.device[m.where[page]] = (page, self.version)
        for page, slot in zip(_ids(reads), _ids(plan.read_slots)):
            assert m.device.get(slot) == (page, m.latest[page]), (
                f"slot {slot} read for page {page} holds {m.device.get(slot)}"
            )
        backup = list(zip(_ids(plan.backup.host_pages), _ids(plan.backup.device_slots)))
        assert backup == [(p, m.where[p]) for p in sorted(set(writes))], "wrong backup batch"
        self.clock += 1
        for page in step_pages:
            m.stamp[page] = self.clock
        event(
            "step" + " swap-in" * bool(len(plan.swap_in)) + " evict" * bool(len(plan.evicted_pages))
        )

    def _check_evictions(
        self, m: LayerModel, plan: StepPlan, step_pages: set[int], num_missing: int
    ) -> None:
        """The eviction observer: exactly as many victims as free slots lack, taken in LRU
        order (ties: lower slot) among resident pages outside the step and not pinned."""
        pinned = self._pinned(plan.layer)
        candidates = sorted(
            (p for p in m.where if p not in step_pages and p not in pinned),
            key=lambda p: (m.stamp[p], m.where[p]),
        )
        free = self.config.device_slots - len(m.where)
        expected = candidates[: max(0, num_missing - free)]
        assert _ids(plan.evicted_pages) == expected, f"evicted {plan.evicted_pages}, LRU {expected}"
        for page in expected:
            assert m.host.get(page) == m.latest[page], f"evicted page {page} lost its data"

    def _apply_placement(self, m: LayerModel, plan: StepPlan, missing: list, writes: list) -> None:
        free = set(range(self.config.device_slots)) - set(m.where.values())
        freed = {m.where.pop(p) for p in _ids(plan.evicted_pages)}
        for page, slot in zip(_ids(plan.swap_in.host_pages), _ids(plan.swap_in.device_slots)):
            assert m.host.get(page) == m.latest[page], f"swap-in of page {page} from a stale host"
            m.device[slot] = (page, m.host[page])
            m.where[page] = slot
        for page, slot in zip(writes, _ids(plan.write_slots)):
            m.where.setdefault(page, slot)  # fresh pages: a slot, no copy
        placed = {m.where[p] for p in missing}
        assert len(placed) == len(missing) and placed <= free | freed, "reused a busy slot"

    @precondition(lambda self: self.pending)
    @rule(batches=st.lists(consumes(tickets), min_size=1, max_size=6))
    def complete(self, batches: list[CopyBatch]) -> None:
        """Copies finish in any order."""
        for batch in batches:
            self._complete(batch)

    def _complete(self, batch: CopyBatch) -> None:
        self.coord.complete(batch.ticket)
        self.pending.pop(batch.ticket, None)
        self.completed.append(batch.ticket)
        m = self.models[batch.layer]
        if batch.kind is CopyKind.BACKUP:
            for page, slot in zip(_ids(batch.host_pages), _ids(batch.device_slots)):
                held = m.device[slot]
                assert held[0] == page, f"backup of page {page} copied page {held[0]}'s slot"
                m.host[page] = held[1]
        note(f"complete {batch.kind.value} ticket {batch.ticket}")

    @rule(pages=st.lists(st.integers(0, 15), max_size=2))
    def release(self, pages: list[int]) -> None:
        pages = [p % self.config.max_host_pages for p in pages]
        pinned = set().union(*(self._pinned(i) for i in range(self.config.num_layers)))
        if pinned & set(pages):
            self._expect_unchanged(PinnedPageError, self.coord.release, pages)
            event("release refused: pinned")
            return
        self.coord.release(pages)
        for m in self.models:
            for page in pages:
                for table in (m.latest, m.host, m.where, m.stamp):
                    table.pop(page, None)
        note(f"release {pages}")

    @rule(data=st.data(), call=st.sampled_from(["read", "write", "fresh", "ticket"]))
    def bad_call(self, data: st.DataObject, call: str) -> None:
        """Reads / non-fresh writes of pages holding no data, fresh writes of pages holding
        data, completing a completed ticket: each raises and changes nothing."""
        layer = data.draw(st.integers(0, self.config.num_layers - 1))
        held = sorted(self.models[layer].latest)
        empty = [p for p in range(self.config.max_host_pages) if p not in held]
        if call == "ticket" and self.completed:
            ticket = data.draw(st.sampled_from(self.completed))
            self._expect_unchanged(TicketError, self.coord.complete, ticket)
        elif call in ("read", "write") and empty:
            page = data.draw(st.sampled_from(empty))
            reads, writes = ([page], []) if call == "read" else ([], [page])
            self._expect_unchanged(MissingPageDataError, self.coord.plan_step, layer, reads, writes)
        elif call == "fresh" and held:
            args = (layer, [], [data.draw(st.sampled_from(held))], [True])
            self._expect_unchanged(MissingPageDataError, self.coord.plan_step, *args)

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def structure_holds(self) -> None:
        HiSparseMachine.steps_run += 1
        self.coord.check_invariants()

    @invariant()
    def device_and_host_hold_the_newest_data(self) -> None:
        every = np.arange(self.config.max_host_pages)
        for layer, m in enumerate(self.models):
            resident = [p for p in every.tolist() if p in m.where]
            assert _ids(every[self.coord.resident(layer, every)]) == resident
            for page, slot in m.where.items():
                assert m.device[slot] == (page, m.latest[page]), f"slot of page {page} is stale"
            for page in set(m.latest) - set(m.where):
                assert m.host.get(page) == m.latest[page], f"demoted page {page} lost data"

    @invariant()
    def stats_agree(self) -> None:
        for layer, m in enumerate(self.models):
            stats = self.coord.stats(layer)
            assert stats.resident_pages == len(m.where)
            assert stats.free_slots == self.config.device_slots - len(m.where)
            assert stats.pinned_pages == len(self._pinned(layer))
        assert self.coord.pending_tickets == tuple(sorted(self.pending))


TestHiSparse = HiSparseMachine.TestCase


def test_machine_really_steps() -> None:
    """Guards the guard: a machine whose rules never fire would pass vacuously."""
    before = HiSparseMachine.steps_run
    run_machine(
        HiSparseMachine,
        settings=settings(
            max_examples=5,
            stateful_step_count=20,
            derandomize=True,
            database=None,  # derandomized guards replay no saved examples of other runs
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    assert HiSparseMachine.steps_run - before >= 5 * 5
