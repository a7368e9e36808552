"""Issue #14 item 5, the core: ids in use stay below the live capacity; shrinking relocates them.

A rebalance that shrinks a pool evicts what does not fit by count, then moves every id in use at
or above the new capacity to a free id below it, rewriting tree nodes and request tables; the
report names the moves and the requests' deltas. The stateful machines (tests/test_stateful.py,
tests/test_step_plan.py) drive `rebalance` among every other verb with the fingerprint oracle
copying the moved pages; here: the cases one can state exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

from shadowradix import (
    CacheConfig,
    CapacityError,
    InvariantError,
    KvEventKind,
    PageAllocator,
    Pool,
    ShadowRadixCache,
)
from shadowradix.testing.machines import TableMirror, same_reads

P = 4
CFG = dict(page_size=P, window=8, compress_ratios=(0, 4, 8), overlap_ratios=(4,),
           full_capacity=32 * P, swa_capacity=24 * P, max_full_capacity=64 * P,
           max_swa_capacity=48 * P, debug=True)  # fmt: skip


def _cache(kv_events: bool = False) -> ShadowRadixCache:
    return ShadowRadixCache(CacheConfig(**CFG), kv_events=kv_events)  # type: ignore[arg-type]


def _fill(cache: ShadowRadixCache) -> tuple[list[int], object]:
    """Three finished prompts, a running request on the last one's prefix, then the two oldest
    evicted: the low ids are free, the ids in use sit high."""
    for s in range(3):
        r = cache.admit([s] * 24)
        cache.extend(r, r.prompt_remaining)
        cache.finish(r)
    running = cache.admit([2] * 24 + [5] * 20)  # resumes after the last prompt's pages
    cache.extend(running, running.prompt_remaining)
    assert cache.evict(full_tokens=12 * P).nodes_removed == 2
    return [2] * 24, running


def test_allocator_hands_out_ids_below_its_capacity_only() -> None:
    alloc = PageAllocator("full", 3, 8)
    assert sorted(alloc.allocate(3)) == [0, 1, 2]
    with pytest.raises(CapacityError):
        alloc.allocate(1)
    alloc.grow(5)
    assert sorted(alloc.allocate(2)) == [3, 4] and alloc.num_free == 0
    alloc.free([1, 4])
    with pytest.raises(Exception, match="in use"):
        alloc.set_capacity(3)  # id 3 is in use: only a relocation may shrink past it
    assert alloc.capacity == 5
    alloc.free([3])
    alloc.set_capacity(3)
    assert alloc.capacity == 3 and alloc.free_snapshot() == (1,)


def test_shrink_relocates_tree_and_request_pages_below_the_new_capacity() -> None:
    cache = _cache()
    prompt, running = _fill(cache)
    mirror = TableMirror()
    mirror.admitted(running)
    reads = cache.read_plan(running)
    used_v = cache._full.num_used
    old_v, old_s = list(running.vpages), list(running.swa_pages)
    target_v = used_v + 1  # barely more than what is used: the high ids must move
    report = cache.rebalance(full_capacity=target_v * P, swa_capacity=14 * P)
    assert report.full_capacity_pages == (32, target_v)
    assert len(report.full_moves) > 0 and report.full_moves.pool is Pool.FULL
    # every id in use is below the capacities, and each move renamed one page
    assert max(running.vpages) < target_v and max(running.swa_pages) < 14
    moved = dict(zip(report.full_moves.src, report.full_moves.dst))
    assert list(running.vpages) == [moved.get(v, v) for v in old_v]
    smoved = dict(zip(report.swa_moves.src, report.swa_moves.dst))
    assert running.swa_pages == [smoved.get(s, s) for s in old_s]
    # the deltas carry an engine's copy of the tables to the new ids
    mirror.apply(report.deltas)
    mirror.check(running)
    assert {c.request_id for c in report.changes} == {running.id}
    # what the request reads is the same positions, at the moved pages' slots
    after = cache.read_plan(running)
    assert not same_reads(reads, after) and np.array_equal(reads.swa_positions, after.swa_positions)
    assert cache.match_prefix(prompt).cached_len == 24  # nothing evicted: all still fits
    assert report.nodes_removed == 0
    cache.extend(running, [1, 2, 3])  # allocation goes on below the capacity
    assert max(running.vpages) < target_v
    cache.finish(running)
    cache.check_invariants()


def test_shrink_below_the_locked_pages_is_refused_unchanged() -> None:
    cache = _cache()
    _, running = _fill(cache)
    held = len(running.vpages)
    before = (list(running.vpages), cache._full.free_snapshot(), cache._full.capacity)
    with pytest.raises(CapacityError):
        cache.rebalance(full_capacity=(held - 1) * P)
    assert (list(running.vpages), cache._full.free_snapshot(), cache._full.capacity) == before
    cache.rebalance(full_capacity=held * P)  # exactly the held pages: the rest evicted
    assert cache.stats().full.free_pages == 0
    cache.check_invariants()


def test_grow_after_shrink_hands_out_the_new_ids() -> None:
    cache = _cache()
    _fill(cache)
    cache.rebalance(full_capacity=cache._full.num_used * P)
    cache.rebalance(full_capacity=64 * P, swa_capacity=48 * P)
    st = cache.stats()
    assert (st.full.capacity_pages, st.swa.capacity_pages) == (64, 48)
    r = cache.admit([7] * 100)
    cache.extend(r, r.prompt_remaining)
    assert max(r.vpages) >= 32  # ids past the initial capacity are in use now
    cache.check_invariants()


def test_check_invariants_fires_on_an_id_at_or_above_the_capacity() -> None:
    cache = _cache()
    _, running = _fill(cache)
    cache.check_invariants()
    node = running.terminal
    node.vpages = (cache._full.capacity, *node.vpages[1:])  # an id with no physical row
    with pytest.raises(InvariantError, match="outside"):
        cache.check_invariants()


def test_kv_events_report_a_move_as_evicted_then_inserted_with_the_same_hashes() -> None:
    cache = _cache(kv_events=True)
    _fill(cache)
    before = {}
    for e in cache.take_events():
        if e.kind is KvEventKind.INSERTED:
            before.update(zip(e.page_hashes, e.vpages))
    report = cache.rebalance(full_capacity=(cache._full.num_used + 1) * P)
    moved = dict(zip(report.full_moves.src, report.full_moves.dst))
    events = cache.take_events()
    kinds = [e.kind for e in events]
    assert kinds and set(kinds) == {KvEventKind.EVICTED, KvEventKind.INSERTED, KvEventKind.FREED}
    freed = [v for e in events if e.kind is KvEventKind.FREED for v in e.vpages]
    private = set(moved) - set(before.values())  # the running request's own pages
    assert private and sorted(freed) == sorted(private)  # their old ids leave use: FREED
    after = dict(before)
    for e in events:
        if e.kind is KvEventKind.INSERTED:
            after.update(zip(e.page_hashes, e.vpages))
    assert set(after) == set(before)  # the same hashes (tokens), under the new ids
    assert any(after[h] != v for h, v in before.items())
    assert all(after[h] == moved.get(v, v) for h, v in before.items())


def test_eviction_ages_name_the_next_victims() -> None:
    cache = _cache()
    assert cache.eviction_ages() == (None, None)  # nothing evictable
    for s in range(2):
        r = cache.admit([s + 1] * 24)
        cache.extend(r, r.prompt_remaining)
        cache.finish(r)
    full_age, swa_age = cache.eviction_ages()
    assert full_age is not None and full_age > 0  # the first prompt, used a while ago
    cache.admit([1] * 24 + [3])  # touches the first prompt: the second is the oldest now
    assert cache.eviction_ages()[0] < full_age + 1
