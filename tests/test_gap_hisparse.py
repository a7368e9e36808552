"""Verification gaps of issue #13 in the HiSparse coordinator: a page a step only writes (no
read) is stamped in the LRU like a read one, and a page written twice in one step counts, pins
and backs up once. Each test fails on a copy of hisparse/ carrying the bug it names."""

from __future__ import annotations

import numpy as np

from hisparse import Coordinator, HiSparseConfig, StepPlan


def _done(coord: Coordinator, plan: StepPlan) -> StepPlan:
    coord.complete(plan.swap_in.ticket)
    coord.complete(plan.backup.ticket)
    return plan


def _pages(array: np.ndarray) -> list[int]:
    return [int(x) for x in array.reshape(-1)]


def test_a_page_only_written_becomes_the_most_recent() -> None:
    """Two slots. Page 0 is read at step 3, page 1 only written at step 4 (both resident, so
    every page of the step is a hit): a new page at step 5 must evict page 0, the least
    recently used. Without the write's stamp, page 1 (last used at step 2) would go."""
    coord = Coordinator(HiSparseConfig(1, 2, 16, debug=True))
    _done(coord, coord.plan_step(0, [], [0], [True]))  # step 1
    _done(coord, coord.plan_step(0, [], [1], [True]))  # step 2
    _done(coord, coord.plan_step(0, [0], []))  # step 3: read
    plan = _done(coord, coord.plan_step(0, [], [1]))  # step 4: write only, no swap-in
    assert len(plan.swap_in) == 0 and len(plan.evicted_pages) == 0
    plan = _done(coord, coord.plan_step(0, [], [2], [True]))  # step 5: needs a victim
    assert _pages(plan.evicted_pages) == [0], "the page written last step was evicted first"
    assert coord.resident(0, [0, 1, 2]).tolist() == [False, True, True]


def test_a_page_only_written_while_another_is_swapped_in_is_stamped_too() -> None:
    """The same on the slow path (the step also places a page): the written page is stamped,
    so the next step's victim is the page read before it."""
    coord = Coordinator(HiSparseConfig(1, 3, 16, debug=True))
    for page in (0, 1, 2):
        _done(coord, coord.plan_step(0, [], [page], [True]))  # steps 1..3
    _done(coord, coord.plan_step(0, [1], []))  # step 4: read page 1
    _done(coord, coord.plan_step(0, [2], []))  # step 5: read page 2 (page 0: step 1)
    plan = _done(coord, coord.plan_step(0, [], [0, 3], [False, True]))  # step 6: 3 evicts 1
    assert _pages(plan.evicted_pages) == [1]
    plan = _done(coord, coord.plan_step(0, [], [4], [True]))  # step 7: victim is page 2
    assert _pages(plan.evicted_pages) == [2], "the page written last step was evicted first"


def test_a_page_written_twice_in_a_step_counts_once() -> None:
    """Writes may repeat a page (several entries of one page in a step): one slot, one pin, one
    backup copy and one counted backup per distinct page; reads count every element."""
    coord = Coordinator(HiSparseConfig(1, 4, 16, debug=True))
    plan = coord.plan_step(0, [], [3, 3, 4, 3], [True, True, True, True])
    assert sorted(_pages(plan.backup.host_pages)) == [3, 4]
    slots = _pages(plan.write_slots)
    assert slots[0] == slots[1] == slots[3] != slots[2]
    stats = coord.stats(0)
    assert (stats.backups, stats.pinned_pages, stats.resident_pages) == (2, 2, 2)
    _done(coord, plan)
    plan = coord.plan_step(0, [3, 3], np.array([[4], [4]]))  # not fresh: 4 holds data now
    assert _pages(plan.backup.host_pages) == [4] and len(plan.swap_in) == 0
    assert plan.write_slots.shape == (2, 1)
    stats = coord.stats(0)
    assert (stats.backups, stats.pinned_pages) == (3, 1)
    assert (stats.reads, stats.read_hits, stats.swap_ins) == (2, 2, 0)
    _done(coord, plan)
    assert coord.stats(0).pinned_pages == 0
    coord.check_invariants()
