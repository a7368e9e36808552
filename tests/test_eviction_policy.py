"""Eviction policy: LRU order per pool, heads of nodes before tail windows, and the pool that
failed to allocate is the one evicted."""

from __future__ import annotations

import numpy as np

from shadowradix import CacheConfig, CapacityError, ShadowRadixCache
from shadowradix.testing import snapshot

P, W = 4, 8


def _cache(full_pages: int = 64, swa_pages: int = 24) -> ShadowRadixCache:
    return ShadowRadixCache(
        CacheConfig(
            page_size=P,
            window=W,
            compress_ratios=(0, 2, 8),
            overlap_ratios=(2,),
            full_capacity=full_pages * P,
            swa_capacity=swa_pages * P,
        )
    )


def _serve(cache: ShadowRadixCache, tokens: list[int]) -> None:
    r = cache.admit(tokens, cache.match_prefix(tokens[:-1]))
    cache.extend(r, r.prompt_remaining)
    cache.cache_unfinished(r)
    cache.finish(r)


def _seq(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 1000, n).tolist()


def test_full_eviction_removes_least_recently_used_leaf_first() -> None:
    cache = _cache()
    a, b, c = _seq(1, 16), _seq(2, 16), _seq(3, 16)
    for seq in (a, b, c):
        _serve(cache, seq)
    _serve(cache, a)  # touch a again: b is now the oldest
    report = cache.evict(full_tokens=P)
    assert report.nodes_removed == 1 and report.full_pages == 4
    assert cache.match_prefix(b).cached_len == 0
    assert cache.match_prefix(a).cached_len == 16
    assert cache.match_prefix(c).cached_len == 16


def test_swa_eviction_takes_node_heads_before_any_tail_window() -> None:
    """sgl#35515: tombstoning a branch's tail window makes the branch unmatchable, so every
    node's head goes first, whatever its age."""
    cache = _cache()
    old, new = _seq(4, 32), _seq(5, 32)
    _serve(cache, old)
    _serve(cache, new)
    # each node: 8 pages; head = pages not intersecting its last W tokens (6 pages)
    report = cache.evict(swa_tokens=12 * P)
    assert report.swa_pages == 12 and report.full_pages == 0
    for seq in (old, new):
        m = cache.match_prefix(seq)
        assert (m.cached_len, m.prefix_len) == (32, 32), "tail windows must survive"
    cache.evict(swa_tokens=P)  # now a tail page must go: the oldest node's
    assert cache.match_prefix(old).prefix_len < 32
    assert cache.match_prefix(new).prefix_len == 32
    cache.check_invariants()


def test_swa_shortage_evicts_swa_not_full() -> None:
    """sgl#29662: "cache full" while SWA was evictable. A failing SWA allocation tombstones;
    it never removes full nodes that still have room."""
    cache = _cache(full_pages=64, swa_pages=20)
    for seed in range(3):
        _serve(cache, _seq(10 + seed, 24))
    stats = cache.stats()
    assert stats.swa.free_pages < 8 <= stats.full.free_pages
    r = cache.admit(_seq(99, 30))
    alloc = cache.extend(r, r.prompt_remaining)
    assert alloc.evicted.swa_pages > 0 and alloc.evicted.full_pages == 0
    assert alloc.evicted.nodes_removed == 0
    for seed in range(3):
        assert cache.match_prefix(_seq(10 + seed, 24)).cached_len == 24
    cache.check_invariants()


def test_full_shortage_evicts_full_leaves() -> None:
    cache = _cache(full_pages=16, swa_pages=24)
    _serve(cache, _seq(20, 40))
    r = cache.admit(_seq(21, 40))
    alloc = cache.extend(r, r.prompt_remaining)
    assert alloc.evicted.nodes_removed == 1 and alloc.evicted.full_pages == 10
    assert cache.match_prefix(_seq(20, 40)).cached_len == 0
    cache.check_invariants()


def test_locked_prefix_is_never_evicted_and_exhaustion_is_clean() -> None:
    cache = _cache(full_pages=16, swa_pages=24)
    holder = cache.admit(_seq(30, 40))
    cache.extend(holder, holder.prompt_remaining)
    cache.cache_unfinished(holder)
    other = cache.admit(_seq(31, 40))
    before = snapshot(cache)
    try:
        cache.extend(other, other.prompt_remaining)
    except CapacityError as err:
        assert err.pool == "full" and err.needed_pages == 10 and err.available_pages == 6
    else:
        raise AssertionError("expected CapacityError")
    assert snapshot(cache) == before
    assert cache.match_prefix(_seq(30, 40)).cached_len == 40


def test_prompt_end_stays_a_tail_window_after_decoding() -> None:
    """A request's decoded pages may extend its own leaf, but never across the prompt's end:
    the window before the prompt's end keeps the tail tier (regenerations branch there)."""
    cache = _cache(swa_pages=40)
    a = [1] * 3 + list(range(100, 121))
    b = [2] * 3 + list(range(200, 221))
    r = cache.admit(a)
    cache.extend(r, r.prompt_remaining)
    cache.cache_unfinished(r)
    for _ in range(12):
        cache.extend(r, [7])
    cache.finish(r)
    _serve(cache, b)
    cache.evict(swa_tokens=9 * P)
    assert cache.match_prefix(a + [9]).prefix_len == 24
    assert cache.match_prefix(b + [9]).prefix_len == 24
