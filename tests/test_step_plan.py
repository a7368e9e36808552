"""Step plans and page-table deltas (issue #13, build item 1) and the FREED events (item 2).

The stateful machines of tests/test_stateful.py keep every live request's tables only by
applying deltas (`TableMirror`) and compare them after every step; here: the issue's example,
the plan's reads, staleness, and a machine that accounts for every page id a consumer sees
leave use (deltas for request tables, events for the tree and for freed private pages).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from shadowradix import (
    Allocation,
    CacheConfig,
    KvEventKind,
    PageTableDelta,
    Pool,
    ShadowRadixCache,
    StalePlanError,
    StepPlan,
    TableChanges,
)
from shadowradix.testing import CacheMachine
from shadowradix.testing.machines import TableMirror, same_reads

P = 4
CFG = dict(page_size=P, window=8, compress_ratios=(4,), overlap_ratios=(4,),
           full_capacity=64 * P, swa_capacity=32 * P, speculative=True)  # fmt: skip


def _cache(**overrides: object) -> ShadowRadixCache:
    return ShadowRadixCache(CacheConfig(**{**CFG, **overrides}), kv_events=True)


def test_issue_example_dedup_names_the_changed_entries():
    """Two requests with the same 29-token prompt, page 4: b's private pages [8..15] become the
    tree's [0..6] + its own 15 on ``cache_unfinished(b)``, and the delta says exactly that."""
    cache = _cache()
    prompt = list(range(29))
    a, b = cache.admit(prompt), cache.admit(prompt)
    cache.extend(a, a.prompt_remaining)
    cache.extend(b, b.prompt_remaining)
    engine = TableMirror()  # the engine's block table, as it was after the extends
    engine.admitted(b)
    assert list(b.vpages) == list(range(8, 16))
    assert cache.cache_unfinished(a) == TableChanges(
        a.id,
        (PageTableDelta(a.id, Pool.SWA, 8, (), 8, 5),),  # only its window moved on
    )
    cache.take_events()
    changes = cache.cache_unfinished(b)
    full, swa = changes.deltas
    assert full == PageTableDelta(b.id, Pool.FULL, 0, (0, 1, 2, 3, 4, 5, 6), 8)
    assert list(b.vpages) == [0, 1, 2, 3, 4, 5, 6, 15]
    assert swa == PageTableDelta(b.id, Pool.SWA, 5, (5, 6), 8, 5)
    engine.apply(changes.deltas)
    engine.check(b)
    # the ids b no longer holds went back to the free lists, and the events say so
    (freed,) = [e for e in cache.take_events() if e.kind is KvEventKind.FREED]
    # (the window copies too: a inserted its whole window, since trimmed to pages [5, 8))
    assert freed.vpages == freed.swa_pages == tuple(range(8, 15))
    assert set(freed.vpages) <= set(cache._full._free)


def test_plan_is_an_allocation_with_reads_and_deltas():
    cache = _cache()
    a = cache.admit(list(range(13)))
    plan = cache.extend(a, a.prompt_remaining[:6])
    assert isinstance(plan, StepPlan) and isinstance(plan, Allocation)
    assert plan.positions.tolist() == list(range(6)) and plan.stream(4).ratio == 4
    assert plan.deltas == (
        PageTableDelta(a.id, Pool.FULL, 0, (0, 1), 2),
        PageTableDelta(a.id, Pool.SWA, 0, (0, 1), 2, 0),
    )
    (reads,) = plan.reads
    assert same_reads(reads, cache.read_plan(a, start=0))
    plan = cache.extend(a, a.prompt_remaining)  # positions 6..12: window [0, 8) left behind
    assert plan.deltas == (
        PageTableDelta(a.id, Pool.FULL, 2, (2, 3), 4),
        PageTableDelta(a.id, Pool.SWA, 2, (2, 3), 4, 0),
    )
    assert same_reads(plan.reads[0], cache.read_plan(a, start=6))
    decode = cache.extend_batch([a], [[1]])  # position 13, on page 3: no new page
    assert decode.deltas == (PageTableDelta(a.id, Pool.SWA, 4, (), 4, 1),)  # page 0 left
    assert same_reads(decode.reads[0], cache.read_plan(a, start=13))
    assert cache.extend_batch([a], [[1]]).deltas == ()  # nothing moved at all


def test_batched_steps_report_each_request_in_batch_order():
    cache = _cache()
    reqs = [cache.admit(list(range(b, b + 11))) for b in (0, 100, 200)]
    cache.extend_batch(reqs, [r.prompt_remaining for r in reqs])
    engine = TableMirror()
    for r in reqs:
        engine.admitted(r)
    pools = set()
    for step in range(9):  # crosses pages 3 and 4, trims the windows
        plan = cache.extend_batch(reqs, [[step]] * 3)
        pools |= {d.pool for d in plan.deltas}
        order = [d.request_id for d in plan.deltas]
        assert order == sorted(order, key=[r.id for r in reqs].index)
        engine.apply(plan.deltas)
        for r, start, reads in zip(reqs, plan.starts, plan.reads):
            engine.check(r)
            assert same_reads(reads, cache.read_plan(r, start=start))
    assert pools == {Pool.FULL, Pool.SWA}
    draft = cache.extend_draft_batch(reqs, [[1, 2, 3, 4, 5]] * 3)
    engine.apply(draft.deltas)
    for r, start, reads in zip(reqs, draft.starts, draft.reads):
        assert same_reads(reads, cache.read_plan(r, start=start))
    for r in reversed(reqs):
        changes = cache.rollback(r, 5)
        assert [d.pages for d in changes.deltas] == [(), ()]  # cut only
        engine.apply(changes.deltas)
        engine.check(r)


def test_reads_refuse_once_a_request_changed():
    cache = _cache()
    a, b = cache.admit(list(range(9))), cache.admit(list(range(50, 59)))
    plan_a = cache.extend(a, a.prompt_remaining)
    plan_b = cache.extend(b, b.prompt_remaining)  # another request: a's plan still reads
    assert same_reads(plan_a.reads[0], cache.read_plan(a, start=0))
    first = cache.extend(a, [1])
    second = cache.extend(a, [2])
    with pytest.raises(StalePlanError, match=f"request {a.id} changed"):
        _ = first.reads
    assert first.deltas == () and second.reads  # deltas stay valid; the latest plan reads
    cache.cache_unfinished(b)
    with pytest.raises(StalePlanError):
        _ = plan_b.reads
    draft = cache.extend_draft(a, [3, 4])
    cache.rollback(a, 1)
    with pytest.raises(StalePlanError):
        _ = draft.reads


def test_finish_and_abort_leave_the_tables_they_end_with():
    cache = _cache()
    a, b = cache.admit(list(range(11))), cache.admit(list(range(50, 61)))
    cache.extend_batch([a, b], [a.prompt_remaining, b.prompt_remaining])
    engine = TableMirror()
    for r in (a, b):
        engine.admitted(r)
    engine.apply(cache.finish(a).deltas)
    engine.check(a)
    assert (list(a.vpages), a.swa_pages) == ([0, 1], [])  # the tree's pages, no window
    engine.apply(cache.abort(b).deltas)
    engine.check(b)
    assert (list(b.vpages), b.swa_pages) == ([], [])


def test_eviction_never_changes_a_live_request_table():
    """Full eviction removes unlocked leaves only; SWA eviction tombstones unprotected pages
    only, and a running request's window is SWA-locked: a request's tables cannot change,
    so `evict` reports no deltas; nor does a `rebalance` that moves no page (one that shrinks
    a pool below ids in use renames them: tests/test_relocation.py)."""
    cache = _cache(swa_capacity=12 * P)
    prompt = list(range(24))
    done = cache.admit(prompt)
    cache.extend(done, done.prompt_remaining)
    cache.finish(done)
    r = cache.admit(prompt + [7, 7])  # resumes after the cached pages, reading their window
    assert r.length == 24 and not any(r.swa_owned)
    tables = (list(r.vpages), r.swa_base, list(r.swa_pages))
    report = cache.evict(full_tokens=64 * P, swa_tokens=32 * P)
    assert report.nodes_tombstoned and not report.nodes_removed
    cache.rebalance(swa_capacity=10 * P)
    assert (list(r.vpages), r.swa_base, list(r.swa_pages)) == tables


class AccountedCache(ShadowRadixCache):
    """A cache that, after every call, checks what a connector writing pages through would see
    (KV events on): the pages in use, derived from nothing but the returned deltas (request
    tables) and the events (tree pages), are exactly the allocators' pages in use; every id
    that left use was named by an event that frees it (FREED, EVICTED, or TOMBSTONED for SWA);
    and no page reported FREED is in use. (`extend` and `extend_draft` go through the batch
    verbs overridden here.)"""

    def __init__(self, config: CacheConfig) -> None:
        super().__init__(config, kv_events=True)
        self.mirror = TableMirror()
        self.tree_v: set[int] = set()
        self.tree_s: dict[int, int] = {}  # virtual page -> its live SWA page
        self.used: tuple[set[int], set[int]] = (set(), set())

    def admit(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        request = super().admit(*args, **kwargs)
        self.mirror.admitted(request)
        return self._accounted(request)

    def extend_batch(self, *args):  # type: ignore[no-untyped-def]
        return self._accounted(super().extend_batch(*args))

    def extend_draft_batch(self, *args):  # type: ignore[no-untyped-def]
        return self._accounted(super().extend_draft_batch(*args))

    def rollback(self, *args):  # type: ignore[no-untyped-def]
        return self._accounted(super().rollback(*args))

    def cache_unfinished(self, *args):  # type: ignore[no-untyped-def]
        return self._accounted(super().cache_unfinished(*args))

    def finish(self, request):  # type: ignore[no-untyped-def]
        return self._accounted(super().finish(request), request)

    def abort(self, request):  # type: ignore[no-untyped-def]
        return self._accounted(super().abort(request), request)

    def evict(self, *args):  # type: ignore[no-untyped-def]
        return self._accounted(super().evict(*args))

    def rebalance(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self._accounted(super().rebalance(*args, **kwargs))

    def _accounted(self, result, ended=None):  # type: ignore[no-untyped-def]
        self.mirror.apply(getattr(result, "deltas", ()))
        if ended is not None:
            self.mirror.check(ended)
            del self.mirror.tables[ended.id]
        freed_v, freed_s, private = self._replay()
        used_v, used_s = set(self.tree_v), set(self.tree_s.values())
        for vpages, _, swa in self.mirror.tables.values():
            used_v |= set(vpages)
            used_s |= set(swa)
        for used, alloc in ((used_v, self._full), (used_s, self._swa)):
            assert used == set(range(alloc.capacity)) - set(alloc._free), alloc.name
        assert self.used[0] - used_v <= freed_v, "a virtual page left use unreported"
        assert self.used[1] - used_s <= freed_s, "an SWA page left use unreported"
        assert not (private[0] & used_v or private[1] & used_s), "FREED a page in use"
        self.used = (used_v, used_s)
        return result

    def _replay(self) -> tuple[set[int], set[int], tuple[set[int], set[int]]]:
        """Apply the events; the virtual and SWA ids they free, and those FREED."""
        freed_v, freed_s, private = set(), set(), (set(), set())
        for e in self.take_events():
            live = e.vpages[len(e.vpages) - len(e.swa_pages) :]
            if e.kind is KvEventKind.INSERTED:
                self.tree_v |= set(e.vpages)
                self.tree_s.update(zip(live, e.swa_pages))
            elif e.kind is KvEventKind.REVIVED:
                self.tree_s.update(zip(e.vpages, e.swa_pages))
            elif e.kind is KvEventKind.EVICTED:
                self.tree_v -= set(e.vpages)
                for v in e.vpages:
                    self.tree_s.pop(v, None)
            elif e.kind is KvEventKind.TOMBSTONED:
                for v in e.vpages:
                    del self.tree_s[v]
            else:
                private[0].update(e.vpages)
                private[1].update(e.swa_pages)
            if e.kind is not KvEventKind.INSERTED and e.kind is not KvEventKind.REVIVED:
                freed_v |= set(e.vpages) if e.kind is not KvEventKind.TOMBSTONED else set()
                freed_s |= set(e.swa_pages)
        return freed_v, freed_s, private


class EventAccountingMachine(CacheMachine):
    """`CacheMachine` over an `AccountedCache`: every call's deltas and events are checked."""

    def make_cache(self, config: CacheConfig) -> ShadowRadixCache:
        return AccountedCache(config)


TestEventAccounting = EventAccountingMachine.TestCase
TestEventAccounting.settings = settings(
    max_examples=30, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
)


def test_page_table_delta_apply_covers_every_shape():
    table = [10, 11, 12, 13]
    assert PageTableDelta(0, Pool.SWA, 4, (14, 15), 6, 2).apply(table, 0) == 2
    assert table == [12, 13, 14, 15]  # dropped two at the front, appended two
    PageTableDelta(0, Pool.SWA, 3, (7,), 6, 2).apply(table, 2)  # one entry rewritten
    assert table == [12, 7, 14, 15]
    PageTableDelta(0, Pool.SWA, 4, (), 4, 2).apply(table, 2)  # cut
    assert table == [12, 7]
    vpages = list(range(5))
    PageTableDelta(0, Pool.FULL, 1, (9, 9), 3).apply(vpages)  # rewritten and cut at once
    assert vpages == [0, 9, 9]


def test_mirror_catches_a_missing_delta():
    """Guards the guard: a mirror that missed a step's deltas is told apart."""
    mirror, cache = TableMirror(), _cache()
    r = cache.admit(list(range(9)))
    mirror.admitted(r)
    cache.extend(r, r.prompt_remaining)
    with pytest.raises(AssertionError, match="virtual table"):
        mirror.check(r)
