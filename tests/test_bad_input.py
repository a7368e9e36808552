"""Bad input to the core: a typed error, the cache exactly as before (issue #13's gaps), and
`check_invariants` seen firing on corrupted states."""

from __future__ import annotations

import dataclasses
import heapq
import math

import numpy as np
import pytest

from shadowradix import (
    CacheConfig,
    ConfigError,
    InvalidRequestError,
    InvariantError,
    ShadowRadixCache,
)
from shadowradix.allocator import PageAllocator
from shadowradix.config import split_budget
from shadowradix.lru import full_key

SMALL = dict(page_size=4, window=8, compress_ratios=(4, 0), overlap_ratios=(4,),
             full_capacity=256, swa_capacity=64)  # fmt: skip


def _snapshot(cache: ShadowRadixCache):
    return (cache.stats(), cache._full.free_snapshot(), cache._swa.free_snapshot(),
            len(cache._tree.nodes()))  # fmt: skip


# -- configuration ---------------------------------------------------------------------------


def test_numpy_integers_are_plain_ints_in_the_config():
    """Sizes computed with NumPy are realistic: accepted, stored as ints."""
    sizes = dict(page_size=np.int64(4), window=np.int32(8), compress_ratios=(np.int64(4), 0),
                 full_capacity=np.int64(256))  # fmt: skip
    cfg = CacheConfig(**dict(SMALL, **sizes))
    assert type(cfg.page_size) is int and type(cfg.window) is int
    assert all(type(r) is int for r in cfg.compress_ratios)
    assert type(cfg.full_capacity) is int and cfg.ratios == (4,)
    cache = ShadowRadixCache(cfg)
    r = cache.admit(list(range(10)))
    cache.extend(r, [1, 2])
    cache.check_invariants()


@pytest.mark.parametrize(
    "field,value",
    [("page_size", True), ("page_size", 4.0), ("full_capacity", 256.0), ("swa_capacity", "64"),
     ("window", 8.5), ("compress_ratios", (4.0, 0)), ("overlap_ratios", (True,)),
     ("max_full_capacity", 512.0), ("speculative", "yes"), ("bounded_replay", 1),
     ("debug", None)],
)  # fmt: skip
def test_wrong_types_are_refused(field, value):
    with pytest.raises(ConfigError, match=field.split("_ratios")[0]):
        CacheConfig(**dict(SMALL, **{field: value}))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_budget_helpers_refuse_non_finite_numbers(bad):
    for args in ((bad, 0.5, 100.0, 10.0), (1e9, bad, 100.0, 10.0), (1e9, 0.5, bad, 10.0),
                 (1e9, 0.5, 100.0, bad)):  # fmt: skip
        with pytest.raises(ConfigError):
            split_budget(*args, page_size=4)
        with pytest.raises(ConfigError):
            CacheConfig.from_budget(args[0], args[1], full_bytes_per_token=args[2],
                                    swa_bytes_per_token=args[3], page_size=4, window=8,
                                    compress_ratios=(4,))  # fmt: skip


@pytest.mark.parametrize("page", [0, -4, 3, 4.0, True])
def test_split_budget_refuses_a_bad_page_size(page):
    with pytest.raises(ConfigError, match="page_size"):
        split_budget(1e9, 0.5, 100.0, 10.0, page_size=page)


def test_the_cache_needs_a_config():
    for bad in (None, dict(SMALL), "config"):
        with pytest.raises(ConfigError, match="CacheConfig"):
            ShadowRadixCache(bad)  # type: ignore[arg-type]


# -- calls -----------------------------------------------------------------------------------


def test_extend_batch_refuses_non_sequences_and_changes_nothing():
    cache = ShadowRadixCache(CacheConfig(**SMALL))
    r = cache.admit(list(range(9)))
    before = _snapshot(cache)
    for requests, tokens in ((None, [[1]]), ([r], None), (r, [[1]]), ([r], 5)):
        with pytest.raises(InvalidRequestError):
            cache.extend_batch(requests, tokens)  # type: ignore[arg-type]
    assert _snapshot(cache) == before
    cache.check_invariants()


@pytest.mark.parametrize("bad", [-1, -5, 1.0, True, "2"])
def test_allocator_refuses_a_bad_count_and_keeps_its_stack(bad):
    alloc = PageAllocator("full", 8, 8)
    alloc.allocate(2)
    before = alloc.free_snapshot()
    with pytest.raises(InvalidRequestError):
        alloc.allocate(bad)  # type: ignore[arg-type]
    assert alloc.free_snapshot() == before
    alloc.check_invariants(np.asarray([0, 1]))


def test_an_altered_match_is_refused_and_the_tree_is_unchanged():
    """`dataclasses.replace` keeps the version a stale check reads: the seal catches it."""
    cache = ShadowRadixCache(CacheConfig(**SMALL))
    a = cache.admit(list(range(20)))
    cache.extend(a, list(range(20)))
    cache.cache_unfinished(a)
    m = cache.match_prefix(list(range(20)) + [99])
    assert m.prefix_len > 0
    before = _snapshot(cache)
    for forged in (dataclasses.replace(m, node_pages=m.node_pages + 1),
                   dataclasses.replace(m, prefix_len=m.prefix_len + 4),
                   dataclasses.replace(m)):  # fmt: skip
        with pytest.raises(InvalidRequestError, match="match_prefix"):
            cache.admit(list(range(20)) + [99], forged)
    assert _snapshot(cache) == before
    cache.admit(list(range(20)) + [99], m)  # the real one still works
    cache.check_invariants()


def test_own_leaf_grows_in_place_past_the_prompt():
    """`cache_unfinished` twice past the prompt appends to the request's own leaf
    (`RadixTree.extend_leaf`) instead of hanging a chain of nodes under it."""
    cache = ShadowRadixCache(CacheConfig(**SMALL))
    r = cache.admit(list(range(8)))
    cache.extend(r, list(range(8)))  # the prompt's 8 tokens
    cache.extend(r, [50, 51, 52, 53])  # decoded: past the prompt
    cache.cache_unfinished(r)
    nodes = len(cache._tree.nodes())
    leaf = r.own_leaf
    pages = leaf.num_pages
    cache.extend(r, [54, 55, 56, 57])
    cache.cache_unfinished(r)
    assert len(cache._tree.nodes()) == nodes and r.own_leaf is leaf
    assert leaf.num_pages == pages + 1
    cache.check_invariants()
    m = cache.match_prefix(list(range(8)) + [50, 51, 52, 53, 54, 55, 56, 57, 1])
    assert m.cached_len == 16


# -- the checker fires -----------------------------------------------------------------------


def _busy_cache():
    cache = ShadowRadixCache(CacheConfig(**SMALL))
    a = cache.admit(list(range(16)))
    cache.extend(a, list(range(16)))
    cache.cache_unfinished(a)
    b = cache.admit(list(range(12)) + [7, 7, 7, 7])
    assert b.num_committed > 0  # it reuses a's pages
    cache.extend(b, b.prompt_remaining)
    cache.extend(b, [1])
    c = cache.admit(list(range(100, 108)))
    cache.extend(c, list(range(100, 108)))
    cache.finish(c)  # its pages stay cached, evictable: the LRU index holds them
    assert len(cache._index.full) > 0
    cache.check_invariants()
    return cache, a, b


def _corrupt_free_duplicate(cache, a, b):
    cache._full._free.append(cache._full._free[-1])


def _corrupt_owned_and_free(cache, a, b):
    cache._full._free.append(a.vpages[0])


def _corrupt_lock_count(cache, a, b):
    a.terminal.full_lock_ref += 1


def _corrupt_lru_keys(cache, a, b):
    index = cache._index
    node = index.oldest_full_leaf()
    stale = full_key(node.last_access + 1000, node.id)  # a stale recency stamp
    node.lru_keys = (stale, *node.lru_keys[1:])
    heapq.heappush(index.full, stale)


def _drop_lru_entry(cache, a, b):
    index = cache._index
    index.full.remove(index.oldest_full_leaf().lru_keys[0])  # an evictable leaf nobody can find
    heapq.heapify(index.full)


def _corrupt_page_table(cache, a, b):
    b.vpages.replace(0, 2, [b.vpages[1], b.vpages[0]])


@pytest.mark.parametrize("corrupt,message", [
    (_corrupt_free_duplicate, "duplicate ids in the free list|owned|leak"),
    (_corrupt_owned_and_free, "owned page is on the free list|duplicate"),
    (_corrupt_lock_count, "lock"),
    (_corrupt_lru_keys, "LRU"),
    (_drop_lru_entry, "LRU"),
    (_corrupt_page_table, "page table"),
])  # fmt: skip
def test_check_invariants_fires_on_a_corrupted_state(corrupt, message):
    cache, a, b = _busy_cache()
    corrupt(cache, a, b)
    with pytest.raises(InvariantError, match=message):
        cache.check_invariants()


def test_decode_with_numpy_ints_takes_the_fast_path(monkeypatch):
    """Sampled ids are often NumPy ints: a decode batch of them is still a decode step."""
    cache = ShadowRadixCache(CacheConfig(**SMALL))
    a, b = cache.admit(list(range(9))), cache.admit(list(range(20, 29)))
    cache.extend_batch([a, b], [list(range(9)), list(range(20, 29))])
    calls = []
    real = cache._extend_decode
    monkeypatch.setattr(cache, "_extend_decode", lambda *args: calls.append(1) or real(*args))
    step = cache.extend_batch([a, b], [[np.int64(5)], (np.int32(6),)])
    assert calls == [1] and step.arrays.positions.tolist() == [9, 9]
    with pytest.raises(InvalidRequestError, match="token ids"):
        cache.extend_batch([a, b], [[np.int64(-1)], [1]])
    cache.check_invariants()


def test_capacity_error_copies_and_pickles() -> None:
    """A failed request's result keeps its `CapacityError`; results are copied and pickled."""
    import copy
    import pickle

    from shadowradix import CapacityError

    err = CapacityError("swa", 3, 1)
    for twin in (copy.deepcopy(err), pickle.loads(pickle.dumps(err))):
        assert type(twin) is CapacityError and str(twin) == str(err)
        assert (twin.pool, twin.needed_pages, twin.available_pages) == ("swa", 3, 1)


def test_tokens_changed_in_place_after_a_call_are_checked_again():
    """The core keeps the caller's int64 arrays without copying them, so a later call is never
    spared its checks because it was given the same object: a prompt written to between
    `match_prefix` and `admit`, or between `admit` and the extend of its `prompt_remaining`
    (even reshaped in place), is refused with the cache unchanged."""
    cache = ShadowRadixCache(CacheConfig(**SMALL, debug=True))
    prompt = np.arange(1, 41, dtype=np.int64)
    match = cache.match_prefix(prompt, len(prompt) - 1)
    prompt[5] = -7
    before = _snapshot(cache)
    with pytest.raises(InvalidRequestError):
        cache.admit(prompt, match)
    assert _snapshot(cache) == before
    prompt[5] = 6
    r = cache.admit(prompt, cache.match_prefix(prompt, len(prompt) - 1))
    prompt[10] = -3
    before = _snapshot(cache)
    with pytest.raises(InvalidRequestError):
        cache.extend(r, r.prompt_remaining)
    prompt[10] = 11
    view = r.prompt_remaining
    view.shape = (4, 10)
    with pytest.raises(InvalidRequestError):
        cache.extend(r, view)
    assert _snapshot(cache) == before
    cache.extend(r, r.prompt_remaining)
    cache.finish(r)
    cache.check_invariants()
