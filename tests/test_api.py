"""API contract: configuration validation and input validation.

Every rejected call raises the documented typed error and leaves the cache exactly as before:
the structural `snapshot` *and* the statistics are compared before / after.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from shadowradix import (
    CacheConfig,
    CapacityError,
    ConfigError,
    InvalidRequestError,
    LockError,
    PageAllocator,
    ShadowRadixCache,
    ShadowRadixError,
    StaleMatchError,
)
from shadowradix.testing import snapshot

W = 128
RATIOS = (0, 4, 128)


def small(page: int = 4, **kw: Any) -> CacheConfig:
    base: dict[str, Any] = dict(
        page_size=page,
        window=W,
        compress_ratios=RATIOS,
        overlap_ratios=(4,),
        full_capacity=200 * page,
        swa_capacity=100 * page,
    )
    base.update(kw)
    return CacheConfig(**base)


def seq(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, n).tolist()


def assert_rejected(
    cache: ShadowRadixCache, error: type[Exception], call: Callable[..., object], *args: Any
) -> Exception:
    """``call(*args)`` raises ``error`` and changes nothing observable."""
    before, stats = snapshot(cache), cache.stats()
    with pytest.raises(error) as info:
        call(*args)
    assert snapshot(cache) == before, "a rejected call changed the cache"
    assert cache.stats() == stats, "a rejected call changed the statistics"
    cache.check_invariants()
    return info.value


# ==========================================================================================
# Configuration
# ==========================================================================================

BAD_CONFIGS: dict[str, dict[str, Any]] = {
    "page_size_not_pow2": dict(page_size=3),
    "page_size_zero": dict(page_size=0),
    "page_size_too_big": dict(page_size=512, full_capacity=512 * 8, swa_capacity=512 * 8),
    "page_size_negative": dict(page_size=-4),
    "window_zero": dict(window=0),
    "window_negative": dict(window=-128),
    "window_float": dict(window=128.0),
    "no_layers": dict(compress_ratios=()),
    "ratio_not_pow2": dict(compress_ratios=(0, 3, 128)),
    "ratio_negative": dict(compress_ratios=(0, -4)),
    "overlap_not_pow2": dict(overlap_ratios=(6,)),
    "overlap_zero": dict(overlap_ratios=(0,)),
    "c128_span_exceeds_window": dict(window=64),
    "c4_overlap_span_exceeds_window": dict(window=6, compress_ratios=(0, 4)),
    "full_capacity_not_page_multiple": dict(full_capacity=4 * 200 + 2),
    "full_capacity_zero": dict(full_capacity=0),
    "full_capacity_below_page": dict(page_size=64, full_capacity=32, swa_capacity=64 * 8),
    "full_capacity_float": dict(full_capacity=800.0),
    "swa_capacity_not_page_multiple": dict(swa_capacity=4 * 100 + 1),
    "swa_capacity_negative": dict(swa_capacity=-400),
    "swa_capacity_below_one_window": dict(swa_capacity=4 * (W // 4 + 1)),
    "max_full_below_live": dict(max_full_capacity=4 * 100),
    "max_full_not_page_multiple": dict(max_full_capacity=4 * 300 + 1),
    "max_swa_below_live": dict(max_swa_capacity=4 * 50),
    "max_swa_not_page_multiple": dict(max_swa_capacity=4 * 300 + 3),
    "speculative_with_bounded_replay": dict(speculative=True, bounded_replay=True),
}


@pytest.mark.parametrize("kwargs", BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_invalid_config_raises_config_error(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        small(**kwargs)


def test_config_error_is_a_value_error_and_a_shadowradix_error() -> None:
    with pytest.raises(ValueError):
        small(page_size=3)
    assert issubclass(ConfigError, ShadowRadixError)


@pytest.mark.parametrize("page", [1, 2, 4, 8, 16, 32, 64, 128, 256])
def test_every_supported_page_size_accepted_at_its_minimum_swa(page: int) -> None:
    window_pages = -(-W // page)
    cfg = small(page, full_capacity=page, swa_capacity=(window_pages + 2) * page)
    assert cfg.num_full_pages == 1 and cfg.num_swa_pages == window_pages + 2
    assert cfg.max_full_capacity == cfg.full_capacity and cfg.max_swa_capacity == cfg.swa_capacity
    assert cfg.window_pages == window_pages + 1
    assert cfg.min_hit_granularity == page
    ShadowRadixCache(cfg).check_invariants()


def test_span_equal_to_window_is_accepted() -> None:
    cfg = small(1, window=7, compress_ratios=(0, 4), full_capacity=64, swa_capacity=64)
    assert cfg.stream(4).span == 7


def test_config_is_frozen() -> None:
    cfg = small()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.page_size = 8  # type: ignore[misc]


def test_unknown_stream_raises_config_error() -> None:
    with pytest.raises(ConfigError):
        small().stream(8)


@pytest.mark.parametrize(
    "args",
    [
        dict(total_bytes=0, swa_full_tokens_ratio=0.1),
        dict(total_bytes=-1, swa_full_tokens_ratio=0.1),
        dict(total_bytes=10**9, swa_full_tokens_ratio=0.0),
        dict(total_bytes=10**9, swa_full_tokens_ratio=0.1, full_bytes_per_token=0.0),
        dict(total_bytes=10**9, swa_full_tokens_ratio=0.1, swa_bytes_per_token=-1.0),
        dict(total_bytes=1000, swa_full_tokens_ratio=0.1),  # too small for one window
    ],
)
def test_from_budget_rejects_bad_budgets(args: dict[str, Any]) -> None:
    kwargs: dict[str, Any] = dict(full_bytes_per_token=100.0, swa_bytes_per_token=1000.0)
    kwargs.update(args)
    with pytest.raises(ConfigError):
        CacheConfig.from_budget(**kwargs)


def test_from_budget_splits_whole_pages() -> None:
    cfg = CacheConfig.from_budget(
        10**9, 0.1, full_bytes_per_token=100.0, swa_bytes_per_token=1000.0, page_size=64
    )
    # per full token: 100 + 0.1 * 1000 = 200 bytes -> 5e6 full tokens, 5e5 SWA tokens
    assert cfg.full_capacity == 5_000_000 // 64 * 64
    assert cfg.swa_capacity == 500_000 // 64 * 64


@pytest.mark.parametrize("capacity, max_pages", [(0, 4), (5, 4), (-1, 4)])
def test_page_allocator_rejects_bad_capacity(capacity: int, max_pages: int) -> None:
    with pytest.raises(ConfigError):
        PageAllocator("full", capacity, max_pages)


@pytest.mark.parametrize("capacity", [0, 5])
def test_page_allocator_set_capacity_validates(capacity: int) -> None:
    alloc = PageAllocator("swa", 2, 4)
    with pytest.raises(ConfigError):
        alloc.set_capacity(capacity)
    assert alloc.capacity == 2


# ==========================================================================================
# A populated cache to reject calls against
# ==========================================================================================


class World:
    """A cache with a tree, a running request on a hit, a finished and an aborted request,
    plus a live request of another cache."""

    def __init__(self, **kw: Any) -> None:
        self.cache = ShadowRadixCache(small(**kw))
        self.x = seq(300, 1)
        done = self.cache.admit(self.x)
        self.cache.extend(done, self.x[:7])
        self.cache.extend(done, self.x[7:])
        self.cache.finish(done)
        self.done = done
        self.running = self.cache.admit(self.x[:200] + [5, 6])
        self.cache.extend(self.running, [5, 6, 7])
        self.gone = self.cache.admit(seq(20, 2))
        self.cache.abort(self.gone)
        self.other_cache = ShadowRadixCache(small(**kw))
        self.foreign = self.other_cache.admit(seq(10, 3))
        self.cache.check_invariants()


@pytest.fixture
def world() -> World:
    return World()


@pytest.fixture
def spec_world() -> World:
    w = World(page=64, full_capacity=64 * 40, swa_capacity=64 * 20, speculative=True)
    assert w.cache.config.max_draft_len == 9
    return w


BAD_TOKENS: dict[str, Any] = {
    "empty_list": [],
    "empty_array": np.zeros(0, dtype=np.int64),
    "two_dimensional": [[1, 2], [3, 4]],
    "two_dimensional_array": np.ones((2, 2), dtype=np.int64),
    "ragged": [[1], [2, 3]],
    "floats": [1.5, 2.0],
    "float_array": np.array([1.0, 2.0]),
    "integral_floats": [1.0],
    "bools": [True, False],
    "negative": [1, -2, 3],
    "negative_array": np.array([-1], dtype=np.int32),
    "strings": ["a", "b"],
    "string": "abc",
    "none": None,
    "scalar": 5,
    "objects": [object()],
}


@pytest.mark.parametrize("tokens", BAD_TOKENS.values(), ids=BAD_TOKENS.keys())
def test_bad_tokens_rejected_everywhere(world: World, tokens: Any) -> None:
    c, r = world.cache, world.running
    assert_rejected(c, InvalidRequestError, lambda: c.match_prefix(tokens))
    assert_rejected(c, InvalidRequestError, lambda: c.admit(tokens))
    assert_rejected(c, InvalidRequestError, lambda: c.extend(r, tokens))
    assert_rejected(c, InvalidRequestError, lambda: c.extend_batch([r], [tokens]))


@pytest.mark.parametrize("tokens", BAD_TOKENS.values(), ids=BAD_TOKENS.keys())
def test_bad_tokens_rejected_by_extend_draft(spec_world: World, tokens: Any) -> None:
    c, r = spec_world.cache, spec_world.running
    assert_rejected(c, InvalidRequestError, lambda: c.extend_draft(r, tokens))


def test_bad_token_in_a_decode_batch_rejects_the_whole_batch(world: World) -> None:
    c, r = world.cache, world.running
    s = c.admit(seq(5, 9))
    for bad in ([-1], [1.5], [True], [1, -1]):
        assert_rejected(c, InvalidRequestError, c.extend_batch, [r, s], [[3], bad])
        assert_rejected(c, InvalidRequestError, c.extend_batch, [s, r], [bad, [3]])


def test_token_id_beyond_int64_rejected_by_match_and_admit(world: World) -> None:
    c = world.cache
    for big in ([2**64], [1, 2**64]):
        assert_rejected(c, InvalidRequestError, c.match_prefix, big)
        assert_rejected(c, InvalidRequestError, c.admit, big)


@pytest.mark.parametrize("big", [2**63, 2**64])
@pytest.mark.parametrize("length", [3, 4], ids=["mid_page", "page_boundary"])
def test_token_id_beyond_int64_rejected_by_decode(big: int, length: int) -> None:
    c = ShadowRadixCache(small())
    r = c.admit([1])
    c.extend(r, list(range(1, length + 1)))
    assert_rejected(c, InvalidRequestError, lambda: c.extend(r, [big]))
    assert_rejected(c, InvalidRequestError, lambda: c.extend_batch([r], [[big]]))


def test_uint64_token_id_beyond_int64_rejected() -> None:
    c = ShadowRadixCache(small())
    r = c.admit([1])
    big = np.array([2**63], dtype=np.uint64)
    assert_rejected(c, InvalidRequestError, c.match_prefix, big)
    assert_rejected(c, InvalidRequestError, lambda: c.extend(r, big))


def test_tokens_accepted_in_every_documented_form(world: World) -> None:
    c, r = world.cache, world.running
    n = r.length
    c.extend(r, np.array([1, 2], dtype=np.int32))
    c.extend(r, np.array([3], dtype=np.uint16))
    c.extend(r, (4, 5))
    c.extend_batch([r], np.array([[6]], dtype=np.int64))
    assert r.length == n + 6 == 209
    c.cache_unfinished(r)
    stored = world.x[:200] + [5, 6, 7, 1, 2, 3, 4, 5, 6]
    assert c.match_prefix(stored).cached_len == 208
    c.check_invariants()


# -- requests that are not ours / not active ------------------------------------------------

REQUEST_CALLS: dict[str, Callable[[ShadowRadixCache, Any], object]] = {
    "extend": lambda c, r: c.extend(r, [1]),
    "extend_multi": lambda c, r: c.extend(r, [1, 2, 3]),
    "extend_batch": lambda c, r: c.extend_batch([r], [[1]]),
    "cache_unfinished": lambda c, r: c.cache_unfinished(r),
    "finish": lambda c, r: c.finish(r),
    "abort": lambda c, r: c.abort(r),
    "read_plan": lambda c, r: c.read_plan(r),
    "rollback": lambda c, r: c.rollback(r, 0),
}


@pytest.mark.parametrize("call", REQUEST_CALLS.values(), ids=REQUEST_CALLS.keys())
@pytest.mark.parametrize("which", ["finished", "aborted", "foreign", "not_a_request"])
def test_inactive_or_foreign_request_rejected(world: World, which: str, call: Callable) -> None:  # type: ignore[type-arg]
    target = {
        "finished": world.done,
        "aborted": world.gone,
        "foreign": world.foreign,
        "not_a_request": "request-0",
    }[which]
    assert_rejected(world.cache, InvalidRequestError, lambda: call(world.cache, target))
    if which == "foreign":  # and the other cache did not notice either
        world.other_cache.check_invariants()
        assert world.foreign.is_active


@pytest.mark.parametrize("which", ["finished", "aborted", "foreign"])
def test_inactive_or_foreign_request_in_a_batch_rejects_the_batch(world: World, which: str) -> None:
    target = {"finished": world.done, "aborted": world.gone, "foreign": world.foreign}[which]
    c, r = world.cache, world.running
    assert_rejected(c, InvalidRequestError, lambda: c.extend_batch([r, target], [[1], [2]]))
    assert_rejected(c, InvalidRequestError, lambda: c.extend_batch([r, target], [[1, 2], [3]]))


def test_inactive_request_rejected_by_extend_draft(spec_world: World) -> None:
    c = spec_world.cache
    for target in (spec_world.done, spec_world.gone, spec_world.foreign):
        assert_rejected(c, InvalidRequestError, c.extend_draft, target, [1])


def test_finished_request_state(world: World) -> None:
    assert not world.done.is_active and not world.gone.is_active
    assert world.done.state.value == "finished" and world.gone.state.value == "aborted"
    assert world.done.full_receipt is None and world.done.swa_receipt is None


# -- batches -------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [[[1], [2]], [[1, 2], [3]]], ids=["decode", "prefill"])
def test_duplicate_request_in_batch_rejected(world: World, tokens: list[list[int]]) -> None:
    c, r = world.cache, world.running
    assert_rejected(c, InvalidRequestError, lambda: c.extend_batch([r, r], tokens))


@pytest.mark.parametrize(
    "make",
    [
        lambda r: ([r], [[1], [2]]),
        lambda r: ([r, r], [[1]]),
        lambda r: ([], []),
        lambda r: ([r], []),
    ],
    ids=["more_tokens", "more_requests", "empty", "no_tokens"],
)
def test_batch_shape_mismatch_rejected(world: World, make: Callable) -> None:  # type: ignore[type-arg]
    c = world.cache
    requests, tokens = make(world.running)
    assert_rejected(c, InvalidRequestError, lambda: c.extend_batch(requests, tokens))


# -- drafts --------------------------------------------------------------------------------


def test_draft_without_speculative_rejected(world: World) -> None:
    c, r = world.cache, world.running
    assert c.config.max_draft_len == 0
    assert_rejected(c, InvalidRequestError, lambda: c.extend_draft(r, [1]))


def test_draft_too_long_rejected(spec_world: World) -> None:
    c, r = spec_world.cache, spec_world.running
    assert_rejected(c, InvalidRequestError, lambda: c.extend_draft(r, list(range(10))))
    c.extend_draft(r, list(range(9)))  # the limit itself is fine
    c.rollback(r, 9)
    c.check_invariants()


def test_pending_draft_blocks_everything_but_rollback(spec_world: World) -> None:
    c, r = spec_world.cache, spec_world.running
    c.extend_draft(r, [1, 2, 3])
    assert_rejected(c, InvalidRequestError, lambda: c.extend(r, [4]))
    assert_rejected(c, InvalidRequestError, lambda: c.extend(r, [4, 5]))
    assert_rejected(c, InvalidRequestError, lambda: c.extend_draft(r, [4]))
    assert_rejected(c, InvalidRequestError, lambda: c.finish(r))
    for n in (-1, 4):
        assert_rejected(c, InvalidRequestError, c.rollback, r, n)
    c.rollback(r, 3)
    assert r.num_draft == 0
    assert_rejected(c, InvalidRequestError, lambda: c.rollback(r, 1))


def test_rollback_rejects_non_integer_count(spec_world: World) -> None:
    c, r = spec_world.cache, spec_world.running
    c.extend_draft(r, [1, 2, 3])
    assert_rejected(c, InvalidRequestError, c.rollback, r, 1.5)


# -- matches -------------------------------------------------------------------------------


def test_a_match_survives_an_insert_off_its_path(world: World) -> None:
    """An insert elsewhere moves the tree's version on; the match still admits, as a fresh one
    would. (A change that moves its resume point makes it stale: tests/test_match_gaps.py.)"""
    c = world.cache
    y = seq(40, 5)
    m = c.match_prefix(world.x[:100] + [1])
    assert m.prefix_len == 100
    other = c.admit(y)
    c.extend(other, y)
    c.finish(other)  # inserts a new leaf: the tree changed, not on m's path
    assert m.version != c._tree.version
    r = c.admit(world.x[:100] + [1], m)
    assert r.length == 100 and r.vpages[:25] == list(c.match_prefix(world.x[:100]).node.vpages)
    c.check_invariants()


def test_match_from_another_cache_rejected(world: World) -> None:
    m = world.other_cache.match_prefix(world.x)
    c = world.cache
    assert_rejected(c, InvalidRequestError, lambda: c.admit(world.x, m))


def test_match_from_another_cache_with_equal_version_rejected() -> None:
    def build() -> ShadowRadixCache:
        c = ShadowRadixCache(small())
        r = c.admit(list(range(1, 41)))
        c.extend(r, list(range(1, 41)))
        c.finish(r)
        return c

    ours, theirs = build(), build()
    m = theirs.match_prefix(list(range(1, 45)))
    assert m.prefix_len == 40 and m.version == ours._tree.version
    theirs_before = snapshot(theirs)
    assert_rejected(ours, InvalidRequestError, lambda: ours.admit(list(range(1, 45)), m))
    assert snapshot(theirs) == theirs_before


@pytest.mark.parametrize(
    "prompt",
    [
        lambda x: [x[0] + 1] + x[1:],  # differs in the first token
        lambda x: x[:99] + [x[99] + 1] + x[100:],  # differs in the last matched token
        lambda x: x[:99],  # shorter than the matched prefix
        lambda x: [7],
    ],
    ids=["first_token", "last_matched_token", "shorter", "unrelated"],
)
def test_mismatched_prompt_rejected(world: World, prompt: Callable) -> None:  # type: ignore[type-arg]
    c = world.cache
    m = c.match_prefix(world.x[:100] + [1])
    assert m.prefix_len == 100
    bad = prompt(world.x)
    assert_rejected(c, InvalidRequestError, lambda: c.admit(bad, m))
    r = c.admit(world.x[:100] + [2, 3], m)  # same matched prefix, other tail: fine
    assert r.length == 100


def test_pure_match_changes_nothing(world: World) -> None:
    c = world.cache
    before, stats = snapshot(c), c.stats()
    for q in (world.x, world.x[:5], [1, 2, 3], world.x + [1] * 300):
        c.match_prefix(q)
    assert snapshot(c) == before and c.stats() == stats


# -- eviction, re-balancing, locks ----------------------------------------------------------


@pytest.mark.parametrize("full, swa", [(-1, 0), (0, -1), (-4, -4)])
def test_negative_eviction_rejected(world: World, full: int, swa: int) -> None:
    c = world.cache
    assert_rejected(c, InvalidRequestError, lambda: c.evict(full_tokens=full, swa_tokens=swa))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(full_capacity=0),
        dict(full_capacity=-4),
        dict(full_capacity=4 * 100 + 2),
        dict(full_capacity=4 * 201),
        dict(swa_capacity=4 * 101),
        dict(swa_capacity=4 * (W // 4 + 1)),
        dict(swa_capacity=3),
    ],
)
def test_invalid_rebalance_rejected(world: World, kwargs: dict[str, int]) -> None:
    c = world.cache
    assert_rejected(c, ConfigError, lambda: c.rebalance(**kwargs))


@pytest.mark.parametrize("kwargs", [dict(full_capacity=400.0), dict(swa_capacity=160.0)])
def test_rebalance_rejects_float_capacity(world: World, kwargs: dict[str, float]) -> None:
    c = world.cache
    assert_rejected(c, ConfigError, lambda: c.rebalance(**kwargs))


def test_rebalance_below_held_pages_rejected(world: World) -> None:
    c = world.cache
    st = c.stats()
    locked = st.full.protected_pages + st.full.held_pages
    err = assert_rejected(c, CapacityError, lambda: c.rebalance(full_capacity=4 * (locked - 1)))
    assert isinstance(err, CapacityError) and err.pool == "full"
    c.rebalance(full_capacity=4 * locked)  # exactly what is locked: evicts all the rest
    st = c.stats()
    assert (st.full.capacity_pages, st.full.free_pages, st.full.evictable_pages) == (locked, 0, 0)
    c.check_invariants()


def test_rebalance_swa_below_held_pages_rejected() -> None:
    c = ShadowRadixCache(small())  # 100 SWA pages
    x = seq(300, 4)
    done = c.admit(x)
    c.extend(done, x)
    c.finish(done)  # 75 live evictable SWA pages in the tree
    r = c.admit(seq(200, 5))
    c.extend(r, seq(200, 5))  # one chunk: holds all 50 of its SWA pages
    st = c.stats().swa
    assert (st.held_pages, st.free_pages) == (50, 0) and st.evictable_pages == 50
    err = assert_rejected(c, CapacityError, c.rebalance, None, 4 * 49)
    assert isinstance(err, CapacityError) and err.pool == "swa"
    c.rebalance(swa_capacity=4 * 50)
    st = c.stats().swa
    assert (st.capacity_pages, st.free_pages, st.evictable_pages, st.held_pages) == (50, 0, 0, 50)
    assert c.match_prefix(x).cached_len == 300  # tombstoned, not removed
    c.rebalance(swa_capacity=4 * 100)
    assert c.stats().swa.free_pages == 50
    c.check_invariants()


def test_foreign_receipt_rejected(world: World) -> None:
    for receipt in (world.running.full_receipt, world.running.swa_receipt):
        assert receipt is not None
        other = world.other_cache
        assert_rejected(other, LockError, other._locks.unlock, receipt)
    world.cache.check_invariants()


def test_all_errors_are_shadowradix_errors() -> None:
    for err in (ConfigError, CapacityError, LockError, InvalidRequestError, StaleMatchError):
        assert issubclass(err, ShadowRadixError)
    assert issubclass(StaleMatchError, InvalidRequestError)
    e = CapacityError("swa", 3, 1)
    assert (e.pool, e.needed_pages, e.available_pages) == ("swa", 3, 1)


def _tiny_spec_cache() -> ShadowRadixCache:
    return ShadowRadixCache(
        CacheConfig(
            page_size=4,
            window=8,
            compress_ratios=(0, 4, 8),
            overlap_ratios=(4,),
            full_capacity=4 * 64,
            swa_capacity=4 * 40,
            speculative=True,
            debug=True,
        )
    )


def test_uint64_decode_batch_beyond_int64_rejected_unchanged() -> None:
    c = _tiny_spec_cache()
    r = c.admit(list(range(1, 9)))
    c.extend(r, list(range(1, 9)))  # the next token opens a new page
    assert_rejected(
        c, InvalidRequestError, c.extend_batch, [r], np.array([[2**63]], dtype=np.uint64)
    )


def test_numpy_unsigned_sizes_behave_like_ints() -> None:
    """Sizes given as numpy unsigned ints must not wrap (rollback leaked, evict emptied)."""
    c = _tiny_spec_cache()
    r = c.admit(list(range(1, 11)))
    c.extend(r, list(range(1, 11)))
    c.extend_draft(r, [5, 5, 5])
    c.rollback(r, np.uint64(3))
    assert r.length == 10 and len(r.vpages) == 3
    c = _tiny_spec_cache()
    for s in range(4):
        q = c.admit([s] * 40)
        c.extend(q, [s] * 40)
        c.finish(q)
    report = c.evict(full_tokens=np.uint64(5))
    assert (report.nodes_removed, report.full_pages) == (1, 10)
    report = c.rebalance(full_capacity=np.uint64(256), swa_capacity=np.uint64(160))
    assert report.nodes_removed == 0
    c.check_invariants()


def test_admit_rejects_something_that_is_not_a_match() -> None:
    c = _tiny_spec_cache()
    assert_rejected(c, InvalidRequestError, c.admit, [1, 2, 3], "not a match")


def test_budget_split_can_be_moved_at_run_time() -> None:
    """SGLang's swa_full_tokens_ratio, re-balanced while serving within one byte budget."""
    from shadowradix import split_budget

    kw = dict(full_bytes_per_token=100.0, swa_bytes_per_token=1000.0)
    cfg = CacheConfig.from_budget(10**8, 0.1, page_size=64, **kw)  # type: ignore[arg-type]
    assert cfg.max_full_capacity == 10**6 // 64 * 64 and cfg.max_swa_capacity == 10**5 // 64 * 64
    cache = ShadowRadixCache(cfg)
    r = cache.admit(list(range(1, 3001)))
    cache.extend(r, r.prompt_remaining)
    cache.finish(r)
    full, swa = split_budget(10**8, 0.5, kw["full_bytes_per_token"], kw["swa_bytes_per_token"], 64)
    assert full < cfg.full_capacity and swa > cfg.swa_capacity
    cache.rebalance(full_capacity=full, swa_capacity=swa)
    stats = cache.stats()
    assert (stats.full.capacity_pages, stats.swa.capacity_pages) == (full // 64, swa // 64)
    assert cache.match_prefix(list(range(1, 3001))).cached_len == 2944
    assert stats.cached_tokens == 2944 and 0 < stats.cached_window_tokens <= 2944
    cache.check_invariants()


def test_zero_hit_rate_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    from shadowradix.cache import HIT_WATCH_WINDOW

    c = ShadowRadixCache(small())
    r = c.admit(list(range(1, 41)))
    c.extend(r, r.prompt_remaining)
    c.finish(r)
    with caplog.at_level("WARNING", logger="shadowradix"):
        for i in range(HIT_WATCH_WINDOW):
            q = c.admit([1000 + i, 1])  # never shares a page with the cached prefix
            c.abort(q)
    assert "hit rate is 0 over the last 256 admissions" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="shadowradix"):
        for _ in range(HIT_WATCH_WINDOW):
            q = c.admit(list(range(1, 41)))
            c.abort(q)
    assert caplog.text == ""


def test_read_plan_start_covers_every_query_window_of_a_chunk() -> None:
    from shadowradix import CacheConfig, InvalidRequestError, ShadowRadixCache

    config = CacheConfig(
        page_size=4,
        window=8,
        compress_ratios=(0, 4, 8),
        overlap_ratios=(4,),
        full_capacity=4 * 32,
        swa_capacity=4 * 12,
    )
    cache = ShadowRadixCache(config)
    r = cache.admit(list(range(1, 40)))
    cache.extend(r, list(range(1, 21)))
    alloc = cache.extend(r, list(range(21, 31)))  # chunk [20, 30)
    start = alloc.starts[0]
    plan = cache.read_plan(r, start=start)
    # the first query (position 20) attends to (20 - 8, 20]: the plan starts at start - window
    assert plan.swa_positions.tolist() == list(range(start - 8, 30))
    assert cache.read_plan(r).swa_positions.tolist() == list(range(22, 30))
    with pytest.raises(InvalidRequestError):
        cache.read_plan(r, start=start - 1)  # before released_at: window no longer held
    with pytest.raises(InvalidRequestError):
        cache.read_plan(r, start=31)


def test_match_prefix_max_len_bounds_the_match_and_zero_gives_the_empty_match() -> None:
    from shadowradix import CacheConfig, InvalidRequestError, ShadowRadixCache, WindowSource

    config = CacheConfig(
        page_size=1,
        window=8,
        compress_ratios=(0, 4),
        overlap_ratios=(4,),
        full_capacity=64,
        swa_capacity=32,
    )
    cache = ShadowRadixCache(config)
    r = cache.admit([7, 8, 9])
    cache.extend(r, [7, 8, 9])
    cache.finish(r)
    assert cache.match_prefix([7, 8, 9]).prefix_len == 3  # page 1: the whole prompt matches
    assert cache.match_prefix([7, 8, 9], max_len=2).prefix_len == 2
    empty = cache.match_prefix([7], max_len=0)
    assert (empty.prefix_len, empty.window) == (0, WindowSource.NONE)
    one = cache.admit([7], empty)  # a one-token prompt still has its token to compute
    assert one.length == 0 and one.prompt_remaining.tolist() == [7]
    for bad in (-1, 1.5, True):
        with pytest.raises(InvalidRequestError):
            cache.match_prefix([7, 8], max_len=bad)
