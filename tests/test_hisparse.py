"""Unit tests of the HiSparse coordinator: every rule and every error of hisparse/, one at a time.

Most tests build a tiny buffer (a few device slots) so that eviction is forced, and compare
`snapshot`s to prove that a call which raised changed nothing.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

import hisparse
import hisparse.lru
from hisparse import (
    BufferStats,
    ConfigError,
    Coordinator,
    CopyBatch,
    CopyKind,
    DeviceBufferFull,
    DeviceSlot,
    HiSparseConfig,
    HiSparseError,
    HostPage,
    InvalidInputError,
    InvariantError,
    MissingPageDataError,
    PinnedPageError,
    StepPlan,
    TicketError,
)
from hisparse.snapshot import snapshot


def make(slots: int = 3, pages: int = 16, layers: int = 1, debug: bool = True) -> Coordinator:
    return Coordinator(HiSparseConfig(layers, slots, pages, debug=debug))


def done(coord: Coordinator, plan: StepPlan) -> StepPlan:
    """Complete both tickets of ``plan`` (its copies finished)."""
    coord.complete(plan.swap_in.ticket)
    coord.complete(plan.backup.ticket)
    return plan


def write_new(coord: Coordinator, *pages: int, layer: int = 0) -> StepPlan:
    """First write of ``pages`` (fresh), copies completed."""
    return done(coord, coord.plan_step(layer, [], list(pages), [True] * len(pages)))


def read(coord: Coordinator, *pages: int, layer: int = 0) -> StepPlan:
    return done(coord, coord.plan_step(layer, list(pages), []))


def ids(array: np.ndarray) -> list[int]:
    return [int(x) for x in array.reshape(-1)]


def expect_unchanged(coord: Coordinator, error: type[Exception], call, *args) -> Exception:  # type: ignore[no-untyped-def]
    before = snapshot(coord)
    with pytest.raises(error) as info:
        call(*args)
    assert snapshot(coord) == before, f"{call.__name__} raised {error.__name__} but changed state"
    return info.value


# -- API surface and configuration -------------------------------------------------------------


def test_public_names() -> None:
    for name in (
        "HiSparseConfig Coordinator HostPage DeviceSlot StepPlan CopyBatch HiSparseError "
        "DeviceBufferFull"
    ).split():
        assert name in hisparse.__all__
    assert issubclass(DeviceBufferFull, HiSparseError)
    for error in (InvalidInputError, MissingPageDataError, TicketError, PinnedPageError):
        assert issubclass(error, HiSparseError)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_layers=0, device_slots=1, max_host_pages=1),
        dict(num_layers=1, device_slots=0, max_host_pages=1),
        dict(num_layers=1, device_slots=1, max_host_pages=0),
        dict(num_layers=1, device_slots=1, max_host_pages=1, entries_per_page=0),
        dict(num_layers=1.0, device_slots=1, max_host_pages=1),
        dict(num_layers=True, device_slots=1, max_host_pages=1),
        dict(num_layers=1, device_slots=1, max_host_pages=1, debug=1),
    ],
)
def test_config_rejects_bad_fields(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        HiSparseConfig(**kwargs)


def test_config_is_frozen_with_derived_sizes() -> None:
    config = HiSparseConfig(num_layers=2, device_slots=8, max_host_pages=100, entries_per_page=16)
    assert (config.device_entries, config.host_entries, config.debug) == (128, 1600, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.device_slots = 9  # type: ignore[misc]
    with pytest.raises(ConfigError):
        Coordinator({"num_layers": 1})  # type: ignore[arg-type]


def test_host_page_and_device_slot_are_distinct_types() -> None:
    """sgl#31482 mixed the two id spaces; here mypy rejects a slot passed as a page."""
    assert HostPage is not DeviceSlot
    assert (HostPage.__name__, DeviceSlot.__name__) == ("HostPage", "DeviceSlot")
    plan = make().plan_step(0, [], [4], [True])
    ((page, slot),) = plan.backup.pairs()
    assert (page, slot) == (4, 0) and type(page) is int and type(slot) is int
    api = pytest.importorskip("mypy.api")
    source = (
        "from hisparse import HostPage, DeviceSlot\n"
        "def slot_of(page: HostPage) -> DeviceSlot:\n"
        "    return DeviceSlot(int(page))\n"
        "slot_of(HostPage(1))\n"
        "slot_of(DeviceSlot(3))\n"
    )
    flags = ["--config-file=/dev/null", "--no-incremental", "--ignore-missing-imports"]
    stdout, _, status = api.run([*flags, "-c", source])
    assert status == 1 and stdout.count("error:") == 1, stdout
    assert '<string>:5: error: Argument 1 to "slot_of" has incompatible type "DeviceSlot"' in stdout


def test_copy_batches_built_by_hand_are_read_only_too() -> None:
    pages, slots = np.array([4, 5]), np.array([0, 1])
    batch = CopyBatch(7, 0, CopyKind.BACKUP, pages, slots, step=3)
    assert len(batch) == 2 and not pages.flags.writeable and not slots.flags.writeable
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.step = 4  # type: ignore[misc]


def test_copy_batches_are_read_only_records() -> None:
    coord = make()
    plan = coord.plan_step(0, [], [1, 2], [True, True])
    assert isinstance(plan.backup, CopyBatch) and plan.backup.kind is CopyKind.BACKUP
    assert plan.swap_in.kind is CopyKind.SWAP_IN and len(plan.swap_in) == 0
    with pytest.raises(ValueError):
        plan.backup.host_pages[0] = 7
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.backup.ticket = 99  # type: ignore[misc]
    assert plan.swap_in.ticket != plan.backup.ticket
    assert coord.pending_tickets == (plan.swap_in.ticket, plan.backup.ticket)


# -- placement, translation, reuse -------------------------------------------------------------


def test_fresh_write_gets_a_slot_without_swap_in_and_a_backup() -> None:
    coord = make()
    plan = coord.plan_step(0, [], [5, 5, 9], [True, False, True])
    assert len(plan.swap_in) == 0 and len(plan.evicted_pages) == 0
    assert plan.write_slots[0] == plan.write_slots[1] != plan.write_slots[2]
    assert ids(plan.backup.host_pages) == [5, 9]
    assert ids(plan.backup.device_slots) == [plan.write_slots[0], plan.write_slots[2]]
    assert plan.write_slots.dtype == np.int64 and plan.backup.host_pages.dtype == np.int64


def test_read_slots_translate_every_element_and_keep_the_shape() -> None:
    coord = make(slots=4)
    write_new(coord, 3, 7, 11)
    reads = np.array([[3, 7, 3], [11, 11, 7]], np.int64)
    plan = done(coord, coord.plan_step(0, reads, np.zeros((0, 2), np.int64)))
    assert plan.read_slots.shape == (2, 3) and plan.write_slots.shape == (0, 2)
    slot = {p: int(read(coord, p).read_slots[0]) for p in (3, 7, 11)}  # one-page reads
    assert plan.read_slots.tolist() == [[slot[p] for p in row] for row in reads.tolist()]
    assert len(set(slot.values())) == 3


def test_reuse_of_resident_pages_costs_no_copy_and_counts_hits() -> None:
    coord = make()
    write_new(coord, 1, 2)
    plan = read(coord, 1, 2, 2, 1)
    assert len(plan.swap_in) == 0 and len(plan.evicted_pages) == 0
    stats = coord.stats(0)
    assert (stats.reads, stats.read_hits, stats.hit_ratio) == (4, 4, 1.0)
    assert stats.swap_ins == 0 and stats.backups == 2 and stats.steps == 2


def test_shared_prefix_pages_share_one_slot_and_one_copy() -> None:
    """Two requests reading the same host pages (a shared prefix) use the same device slots."""
    coord = make(slots=4)
    write_new(coord, 1, 2, 3, 4)
    plan = coord.plan_step(0, [[1, 2, 3], [2, 3, 4]], [])
    assert plan.read_slots[0, 1] == plan.read_slots[1, 0]
    assert plan.read_slots[0, 2] == plan.read_slots[1, 1]
    assert len(set(ids(plan.read_slots))) == 4


def test_shared_pages_swapped_in_once() -> None:
    coord = make(slots=2)
    write_new(coord, 1)
    write_new(coord, 2)
    write_new(coord, 3)  # evicts 1
    plan = coord.plan_step(0, [[1, 3], [1, 3]], [])
    assert ids(plan.swap_in.host_pages) == [1]
    assert plan.read_slots[0, 0] == plan.read_slots[1, 0] == plan.swap_in.device_slots[0]


# -- LRU ---------------------------------------------------------------------------------------


def test_lru_evicts_the_least_recently_used_page() -> None:
    coord = make(slots=3)
    for page in (0, 1, 2):
        write_new(coord, page)
    read(coord, 0)  # 1 is now the oldest
    plan = write_new(coord, 3)
    assert ids(plan.evicted_pages) == [1]
    read(coord, 2, 0)  # 3 is now the oldest
    plan = write_new(coord, 4)
    assert ids(plan.evicted_pages) == [3]


def test_lru_ties_go_to_the_lower_slot_and_free_slots_go_first() -> None:
    coord = make(slots=3)
    write_new(coord, 5, 6)  # slots 0, 1 in one step: same stamp
    plan = write_new(coord, 7)
    assert len(plan.evicted_pages) == 0 and ids(plan.write_slots) == [2]
    plan = write_new(coord, 8)
    assert ids(plan.evicted_pages) == [5] and ids(plan.write_slots) == [0]


def test_pages_of_the_current_step_are_never_evicted_by_it() -> None:
    coord = make(slots=3)
    for page in (0, 1, 2):
        write_new(coord, page)
    write_new(coord, 3)  # evicts 0
    plan = read(coord, 1, 0)  # 1 is the oldest resident, but this step reads it
    assert ids(plan.evicted_pages) == [2]
    assert ids(plan.swap_in.host_pages) == [0]


def test_evicted_page_is_demoted_not_lost() -> None:
    coord = make(slots=1)
    write_new(coord, 4)
    plan = write_new(coord, 5)
    assert ids(plan.evicted_pages) == [4]
    assert not coord.resident(0, [4])[0]
    plan = read(coord, 4)  # its data is on the host: swapped in again
    assert ids(plan.swap_in.host_pages) == [4] and ids(plan.evicted_pages) == [5]
    assert ids(plan.read_slots) == ids(plan.swap_in.device_slots)


def test_wide_stamp_span_takes_the_merge_sort_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The frontier rebuild sorts stamps by radix when they span < 2**16 steps; the fallback
    must pick the same victims."""

    def run() -> list[list[int]]:
        coord = make(slots=4, pages=32)
        rng = np.random.default_rng(7)
        evicted = []
        for page in range(32):
            write_new(coord, page)
            plan = read(coord, *rng.integers(0, page + 1, 3).tolist())
            evicted.append(ids(plan.evicted_pages))
        return evicted

    reference = run()
    monkeypatch.setattr(hisparse.lru, "_RADIX_SPAN", 2)
    assert run() == reference


# -- pinning: swap-ins and backups -------------------------------------------------------------


def test_swap_in_pins_its_page_until_complete() -> None:
    coord = make(slots=2)
    for page in (0, 1, 2):
        write_new(coord, page)  # 0 demoted to the host
    swap = coord.plan_step(0, [0], [])  # swap-in of 0 in flight
    coord.complete(swap.backup.ticket)
    read(coord, 2)  # now 0 is the least recently used page, but pinned
    plan = read(coord, 1)
    assert ids(plan.evicted_pages) == [2], "evicted a page whose swap-in is in flight"
    assert coord.stats(0).pinned_pages == 1
    coord.complete(swap.swap_in.ticket)
    plan = read(coord, 2)
    assert ids(plan.evicted_pages) == [0], "completed swap-in page must become evictable (LRU)"


def test_device_buffer_full_when_pinned_pages_leave_no_room() -> None:
    coord = make(slots=1)
    write_new(coord, 0)
    write_new(coord, 1)  # 0 on the host
    swap = coord.plan_step(0, [0], [])
    error = expect_unchanged(coord, DeviceBufferFull, coord.plan_step, 0, [1], [])
    assert isinstance(error, DeviceBufferFull)
    assert (error.layer, error.needed_slots, error.device_slots) == (0, 2, 1)
    done(coord, swap)
    assert ids(read(coord, 1).evicted_pages) == [0]


def test_device_buffer_full_counts_distinct_step_pages() -> None:
    coord = make(slots=3)
    write_new(coord, 0, 1, 2)
    write_new(coord, 3)
    error = expect_unchanged(coord, DeviceBufferFull, coord.plan_step, 0, [[0, 1], [2, 3]], [0])
    assert isinstance(error, DeviceBufferFull) and error.needed_slots == 4
    plan = read(coord, 0, 0, 1, 1, 3)  # three distinct pages fit
    assert ids(plan.evicted_pages) == [2]


def test_written_page_stays_on_device_until_its_backup_completes() -> None:
    coord = make(slots=2)
    write_new(coord, 0)
    pending = coord.plan_step(0, [], [1], [True])  # backup of 1 in flight
    coord.complete(pending.swap_in.ticket)
    read(coord, 0)  # 1 is now the least recently used page
    plan = write_new(coord, 2)
    assert ids(plan.evicted_pages) == [0], "evicted a page whose only copy is on the device"
    expect_unchanged(coord, DeviceBufferFull, coord.plan_step, 0, [0, 2], [])
    coord.complete(pending.backup.ticket)
    plan = read(coord, 0)
    assert ids(plan.evicted_pages) == [1]
    assert ids(read(coord, 1).swap_in.host_pages) == [1], "backed-up page lost its host data"


def test_page_with_two_pending_backups_waits_for_both_in_any_order() -> None:
    coord = make(slots=1)
    write_new(coord, 0)
    first = coord.plan_step(0, [0], [0])
    second = coord.plan_step(0, [0], [0])
    for plan in (first, second):
        coord.complete(plan.swap_in.ticket)
    coord.complete(second.backup.ticket)
    expect_unchanged(coord, DeviceBufferFull, coord.plan_step, 0, [], [1], [True])
    coord.complete(first.backup.ticket)
    assert ids(write_new(coord, 1).evicted_pages) == [0]
    assert ids(read(coord, 0).swap_in.host_pages) == [0]


def test_a_large_fresh_write_then_a_large_rewrite() -> None:
    """Hundreds of written pages in one step (a prefill chunk), fresh, then written again."""
    coord = make(slots=300, pages=400)
    pages = np.arange(100, 300, dtype=np.int64)
    plan = done(coord, coord.plan_step(0, [], pages, np.ones(200, bool)))
    assert ids(plan.backup.host_pages) == ids(pages) and len(plan.swap_in) == 0
    plan = done(coord, coord.plan_step(0, pages[::-1], pages[::-1].reshape(20, 10)))
    assert ids(plan.read_slots) == ids(plan.write_slots) and len(plan.swap_in) == 0
    assert ids(plan.backup.host_pages) == ids(pages) and plan.write_slots.shape == (20, 10)


def test_write_of_a_host_only_page_swaps_it_in_first() -> None:
    coord = make(slots=1)
    write_new(coord, 0)
    write_new(coord, 1)
    plan = coord.plan_step(0, [], [0])
    assert ids(plan.swap_in.host_pages) == [0] and ids(plan.backup.host_pages) == [0]
    assert ids(plan.write_slots) == ids(plan.swap_in.device_slots)
    assert coord.stats(0).pinned_pages == 1


def test_fresh_page_read_in_the_step_that_writes_it() -> None:
    coord = make()
    plan = coord.plan_step(0, [7, 7], [7], [True])
    assert len(plan.swap_in) == 0 and ids(plan.read_slots) == [plan.write_slots[0]] * 2


# -- tickets -----------------------------------------------------------------------------------


def test_completions_in_any_order() -> None:
    coord = make(slots=4)
    plans = [coord.plan_step(0, [], [p], [True]) for p in range(4)]
    tickets = [t for plan in plans for t in (plan.swap_in.ticket, plan.backup.ticket)]
    for ticket in reversed(tickets[::2] + tickets[1::2]):
        coord.complete(ticket)
    assert coord.pending_tickets == () and coord.stats().pinned_pages == 0


def test_complete_unknown_or_twice_raises_and_changes_nothing() -> None:
    coord = make()
    plan = coord.plan_step(0, [], [1], [True])
    coord.complete(np.int64(plan.backup.ticket))  # numpy ints are tickets too
    error = expect_unchanged(coord, TicketError, coord.complete, plan.backup.ticket)
    assert "already completed" in str(error)
    assert "unknown" in str(expect_unchanged(coord, TicketError, coord.complete, 10**6))
    expect_unchanged(coord, TicketError, coord.complete, 0)
    expect_unchanged(coord, TicketError, coord.complete, "1")
    expect_unchanged(coord, TicketError, coord.complete, True)
    coord.complete(plan.swap_in.ticket)


def test_empty_step_still_issues_two_tickets() -> None:
    coord = make()
    plan = coord.plan_step(0, [], [], [])
    assert len(plan.swap_in) == len(plan.backup) == 0 and plan.read_slots.shape == (0,)
    assert len(coord.pending_tickets) == 2
    for batch in (plan.swap_in, plan.backup):
        assert batch.host_pages.dtype == np.int64 and not batch.host_pages.flags.writeable
    done(coord, plan)


# -- bad input ---------------------------------------------------------------------------------


def test_read_of_a_page_without_data_raises_and_changes_nothing() -> None:
    coord = make()
    write_new(coord, 1)
    error = expect_unchanged(coord, MissingPageDataError, coord.plan_step, 0, [1, 2], [])
    assert isinstance(error, MissingPageDataError) and error.pages == (2,)
    expect_unchanged(coord, MissingPageDataError, coord.plan_step, 0, [], [3])  # not fresh
    expect_unchanged(coord, MissingPageDataError, coord.plan_step, 0, [], [3], [False])


def test_fresh_write_of_a_page_that_holds_data_raises() -> None:
    coord = make(slots=1)
    write_new(coord, 1)
    expect_unchanged(coord, MissingPageDataError, coord.plan_step, 0, [], [1], [True])
    write_new(coord, 2)  # 1 now only on the host
    expect_unchanged(coord, MissingPageDataError, coord.plan_step, 0, [], [1], [True])


@pytest.mark.parametrize(
    "layer, reads, writes, fresh",
    [
        (-1, [], [], None),
        (2, [], [], None),
        (1.0, [], [], None),
        (True, [], [], None),
        ("0", [], [], None),
        (0, [16], [], None),
        (0, [-1], [], None),
        (0, [1.0], [], None),
        (0, np.array([1], np.float32), [], None),
        (0, [], [99], None),
        (0, [], np.array([3, 99], np.int64), None),
        (0, [], np.array([[-1, 3]], np.int64), None),
        (0, np.array([[3, 16]], np.int64), [], None),
        (0, [], [1, 2], [True]),
        (0, [], [1, 2], [1, 0]),
        (0, [], [[1, 2]], [True, True]),
    ],
)
def test_invalid_input_raises_and_changes_nothing(layer, reads, writes, fresh) -> None:  # type: ignore[no-untyped-def]
    coord = make(layers=2)
    write_new(coord, 1, 2)
    expect_unchanged(coord, InvalidInputError, coord.plan_step, layer, reads, writes, fresh)


def test_layer_and_page_checks_of_the_other_calls() -> None:
    coord = make(layers=2)
    expect_unchanged(coord, InvalidInputError, coord.resident, 2, [0])
    expect_unchanged(coord, InvalidInputError, coord.resident, 0, [16])
    expect_unchanged(coord, InvalidInputError, coord.release, [-3])
    expect_unchanged(coord, InvalidInputError, coord.stats, -1)
    expect_unchanged(coord, InvalidInputError, coord.release, ["a"])


def test_unsigned_and_narrow_integer_pages_are_accepted() -> None:
    coord = make()
    plan = coord.plan_step(np.int32(0), [], np.array([3], np.uint16), np.array([True]))
    assert plan.backup.host_pages.dtype == np.int64 and ids(plan.backup.host_pages) == [3]


# -- release -----------------------------------------------------------------------------------


def test_release_drops_residency_and_host_data() -> None:
    coord = make(slots=2, layers=2)
    write_new(coord, 1, 2)
    write_new(coord, 1, layer=1)
    coord.release([[2, 1], [1, 9]])  # any shape; duplicates and pages holding nothing are fine
    assert not coord.resident(0, [1, 2]).any() and not coord.resident(1, [1]).any()
    assert coord.stats().free_slots == 4 and coord.stats(0).resident_pages == 0
    expect_unchanged(coord, MissingPageDataError, coord.plan_step, 0, [1], [])
    plan = write_new(coord, 2, 1)  # a released page is fresh again; slots are free
    assert len(plan.evicted_pages) == 0


def test_release_of_a_demoted_page_forgets_its_host_data() -> None:
    coord = make(slots=1)
    write_new(coord, 1)
    write_new(coord, 2)
    coord.release([1])
    expect_unchanged(coord, MissingPageDataError, coord.plan_step, 0, [1], [])


def test_release_of_a_pinned_page_raises_and_changes_nothing() -> None:
    coord = make(layers=2)
    write_new(coord, 1)
    pending = coord.plan_step(1, [], [1], [True])  # backup in flight in layer 1
    error = expect_unchanged(coord, PinnedPageError, coord.release, [0, 1])
    assert isinstance(error, PinnedPageError)
    assert error.pages == (1,) and error.tickets == (pending.backup.ticket,)
    done(coord, pending)
    coord.release([0, 1])
    assert not coord.resident(1, [1])[0]


# -- stats, layers, resident -------------------------------------------------------------------


def test_layers_are_independent_and_stats_sum() -> None:
    coord = make(slots=2, layers=2)
    write_new(coord, 1, 2, layer=0)
    write_new(coord, 3, layer=1)
    read(coord, 1, layer=0)
    assert coord.resident(0, [[1, 2], [3, 4]]).tolist() == [[True, True], [False, False]]
    assert coord.resident(1, np.array([3])).dtype == np.bool_
    s0, s1, total = coord.stats(0), coord.stats(1), coord.stats()
    assert isinstance(total, BufferStats) and total.layer is None
    assert (s0.resident_pages, s1.resident_pages, total.resident_pages) == (2, 1, 3)
    assert total.device_slots == 4 and total.backups == 3 and total.steps == 3
    assert total.hit_ratio == 1.0 and coord.stats(1).hit_ratio is None
    expect_unchanged(coord, MissingPageDataError, coord.plan_step, 1, [1], [])


def test_stats_count_swap_ins_evictions_and_misses() -> None:
    coord = make(slots=1)
    write_new(coord, 1)
    write_new(coord, 2)
    read(coord, 1, 1)
    stats = coord.stats(0)
    assert (stats.swap_ins, stats.evictions, stats.reads, stats.read_hits) == (1, 2, 2, 0)
    assert stats.pending_tickets == 0 and stats.pinned_pages == 0


# -- a failing call changes nothing: differential ----------------------------------------------


def test_failed_step_leaves_the_same_future_as_no_call() -> None:
    """A twin that never saw the failing calls evicts exactly the same pages afterwards."""
    coord = make(slots=4, pages=32, debug=False)
    rng = np.random.default_rng(3)
    for page in range(10):
        write_new(coord, page)
    read(coord, 9, 1, 3)
    twin = copy.deepcopy(coord)
    pin = coord.plan_step(0, [0], [])
    twin.plan_step(0, [0], [])
    for reads in ([2, 4, 5, 6], [7, 8, 1, 2], [4, 5, 6, 7]):
        expect_unchanged(coord, DeviceBufferFull, coord.plan_step, 0, reads, [])
    expect_unchanged(coord, MissingPageDataError, coord.plan_step, 0, [3, 20], [])
    for _ in range(20):
        pages = rng.integers(0, 10, 2).tolist()
        a, b = coord.plan_step(0, pages, []), twin.plan_step(0, pages, [])
        assert ids(a.evicted_pages) == ids(b.evicted_pages)
        assert ids(a.read_slots) == ids(b.read_slots)
        done(coord, a)
        done(twin, b)
    done(coord, pin)


# -- check_invariants can fail -----------------------------------------------------------------


def _busy() -> Coordinator:
    coord = make(slots=3, debug=False)
    for page in (0, 1, 2, 3):
        write_new(coord, page)
    read(coord, 1)
    coord.plan_step(0, [0], [2])  # swap-in and backup in flight
    coord.check_invariants()
    return coord


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda L: L.buffer.slot_of_page.__setitem__(1, 2), "owned by two pages"),
        (lambda L: L.buffer.page_of_slot.__setitem__(L.buffer.slot_of_page[1], 9), "slot table"),
        (lambda L: L.buffer.pins.__setitem__(int(L.buffer.slot_of_page[0]), 0), "pins"),
        (lambda L: L.has_host_data.__setitem__(1, False), "only copy is on the device"),
        (lambda L: setattr(L.buffer, "num_free", 1), "free"),
        (lambda L: L.buffer.lru.last_use.__setitem__(0, 10**9), "future"),
        (lambda L: setattr(L, "pending_copies", 0), "pending copy count"),
        (lambda L: setattr(L.counters, "read_hits", 10**6), "counters"),
        (lambda L: setattr(L.counters, "steps", 99), "clock"),
    ],
)
def test_check_invariants_catches_corruption(corrupt, message: str) -> None:  # type: ignore[no-untyped-def]
    coord = _busy()
    corrupt(coord._layers[0])
    with pytest.raises(InvariantError, match=message):
        coord.check_invariants()


def test_check_invariants_catches_a_frontier_that_lost_a_page() -> None:
    coord = make(slots=4, debug=False)
    for page in range(6):
        write_new(coord, page)  # evictions built a frontier
    lru = coord._layers[0].buffer.lru
    assert lru.frontier.limit >= 0
    lru.frontier = dataclasses.replace(lru.frontier, pos=len(lru.frontier.slots))
    with pytest.raises(InvariantError, match="escaped the frontier"):
        coord.check_invariants()


def test_check_invariants_catches_a_moved_pinned_page() -> None:
    coord = _busy()
    batch = coord._tickets.pending()[0]
    slot = int(batch.device_slots[0])
    other = (slot + 1) % 3
    buf = coord._layers[0].buffer
    a, b = int(buf.page_of_slot[slot]), int(buf.page_of_slot[other])
    buf.page_of_slot[[slot, other]] = [b, a]
    buf.slot_of_page[[a, b]] = [other, slot]
    with pytest.raises(InvariantError, match="moved while pinned"):
        coord.check_invariants()


def test_debug_mode_checks_after_every_mutating_call() -> None:
    coord = make(debug=True)
    plan = coord.plan_step(0, [], [1], [True])
    coord._layers[0].pending_copies = 5
    with pytest.raises(InvariantError):
        coord.complete(plan.swap_in.ticket)
    quiet = make(debug=False)
    quiet.plan_step(0, [], [1], [True])
    quiet._layers[0].pending_copies = 5
    quiet.release([2])  # no check without debug


# -- the hot path: no aliasing, no partial writes, one behaviour on every numpy path -----------


def _random_steps(coord: Coordinator, steps: int, seed: int) -> list[tuple[list[int], ...]]:
    """Random decode-like steps on 24 pages (one layer): reads as int64 arrays, now and then a
    fresh write of a new page; every plan's decisions, copies completed in between."""
    rng = np.random.default_rng(seed)
    written = [0, 1, 2, 3]
    write_new(coord, *written)
    out = []
    for step in range(steps):
        reads = rng.choice(written, (2, 3)).astype(np.int64)
        writes = np.array([len(written)] if step % 3 == 0 and len(written) < 24 else [], np.int64)
        plan = coord.plan_step(0, reads, writes, np.ones(len(writes), bool))
        written += ids(writes)
        out.append(
            (
                ids(plan.read_slots),
                ids(plan.write_slots),
                ids(plan.evicted_pages),
                ids(plan.swap_in.host_pages),
                ids(plan.swap_in.device_slots),
                ids(plan.backup.device_slots),
            )
        )
        done(coord, plan)
    return out


def test_both_miss_checks_plan_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stamp scatter that raises on a missing page (numpy validates a fancy assignment's
    indices before its first store) and the explicit ``min`` check give the same plans."""
    import hisparse.layer

    reference = _random_steps(make(slots=8, pages=24), 80, seed=5)
    monkeypatch.setattr(hisparse.layer, "_SCATTER_VALIDATES_FIRST", False)
    assert _random_steps(make(slots=8, pages=24), 80, seed=5) == reference


@pytest.mark.parametrize("missing_at", [0, 8191, 16383])
def test_a_large_failing_step_writes_no_stamp(missing_at: int) -> None:
    """16K reads, one of them a page without data (or one too many for the buffer), anywhere in
    the array: the error leaves every LRU stamp as it was."""
    coord = make(slots=4, pages=64, debug=False)
    write_new(coord, 0, 1, 2, 3)
    write_new(coord, 4)  # 0 now only on the host
    reads = np.resize(np.array([1, 2, 3, 4], np.int64), 16384)
    reads[missing_at] = 9  # never written
    expect_unchanged(coord, MissingPageDataError, coord.plan_step, 0, reads, [])
    reads[missing_at] = 0  # on the host, but five distinct pages do not fit four slots
    expect_unchanged(coord, DeviceBufferFull, coord.plan_step, 0, reads.reshape(128, 128), [])


def test_results_own_their_arrays_and_inputs_are_never_written() -> None:
    """Returned arrays are fresh (later steps do not change them); copy batches' are
    read-only; the caller's reads / writes / fresh arrays are left as they were."""
    coord = make(slots=4, pages=16, debug=False)
    for page in range(5):
        write_new(coord, page)
    kept = []
    for step in range(12):
        reads = np.array([[step % 5, (step + 1) % 5], [(step + 2) % 5, step % 5]], np.int64)
        writes = np.array([5 + step if step < 5 else step % 5], np.int64)
        fresh = np.array([step < 5])
        inputs = (reads.copy(), writes.copy(), fresh.copy())
        plan = coord.plan_step(0, reads, writes, fresh)
        assert all(np.array_equal(a, b) for a, b in zip((reads, writes, fresh), inputs))
        for batch in (plan.swap_in, plan.backup):
            assert not batch.host_pages.flags.writeable and not batch.device_slots.flags.writeable
            assert batch.host_pages.dtype == batch.device_slots.dtype == np.int64
        arrays = (plan.read_slots, plan.write_slots, plan.evicted_pages, plan.swap_in.host_pages)
        arrays += (plan.swap_in.device_slots, plan.backup.host_pages, plan.backup.device_slots)
        kept.append((arrays, [a.copy() for a in arrays]))
        done(coord, plan)
    assert any(len(arrays[2]) for arrays, _ in kept), "no step evicted: a weak test"
    for arrays, copies in kept:
        assert all(np.array_equal(a, c) for a, c in zip(arrays, copies))


def test_a_released_slot_left_in_the_frontier_is_never_a_victim() -> None:
    """`release` frees a slot the LRU frontier still lists; the next step that must evict
    skips it (it is free, not resident) and takes the oldest resident page."""
    coord = make(slots=4, pages=16)
    write_new(coord, 0, 1, 2, 3)
    read(coord, 1, 2, 3)
    write_new(coord, 4)  # evicts 0: builds a frontier listing the slots of 1, 2, 3
    released = int(coord._layers[0].buffer.slot_of_page[2])
    assert released in coord._layers[0].buffer.lru.frontier.slots.tolist()
    coord.release([2])
    plan = write_new(coord, 5, 6)  # one free slot, one victim
    assert ids(plan.evicted_pages) == [1]
    assert released in ids(plan.write_slots)
