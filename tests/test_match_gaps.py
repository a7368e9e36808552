"""Verification gaps of issue #13 around matches: staleness across SWA evictions, the LRU
refresh a hit gives, and exact hits never reported approximate. Each test fails on the bug it
names (checked by hand against a copy of the core with that bug)."""

from __future__ import annotations

import numpy as np
import pytest
from core_helpers import cached

from shadowradix import CacheConfig, ShadowRadixCache, StaleMatchError

CFG = dict(page_size=4, window=8, compress_ratios=(4, 0), overlap_ratios=(4,),
           full_capacity=256, swa_capacity=128)  # fmt: skip


def test_a_match_between_two_swa_evictions_is_stale():
    """A match taken after one SWA eviction, whose window the next eviction tombstones, must be
    refused as stale (the tree's version moves on every tombstone, so `admit` re-matches),
    changing nothing; with a version that did not move, `admit` would lock dead pages."""
    cache = ShadowRadixCache(CacheConfig(**CFG))
    a, b = list(range(32)), list(range(1000, 1032))
    cached(cache, a)
    cached(cache, b)
    assert cache.evict(swa_tokens=4).nodes_tombstoned == 1
    m = cache.match_prefix(b + [7])
    assert m.prefix_len == 32
    assert cache.evict(swa_tokens=128).swa_pages > 0  # down to b's window
    assert cache.match_prefix(b + [7]).prefix_len < 32
    before = (cache.stats(), cache._tree.version)
    with pytest.raises(StaleMatchError, match="match again"):
        cache.admit(b + [7], m)
    assert (cache.stats(), cache._tree.version) == before
    cache.check_invariants()


def test_a_match_survives_changes_off_its_path():
    """A longest-prefix-first scheduler matches its whole queue, then admits: another
    admission's split, an insert and an eviction elsewhere leave the match usable, and the
    admission equals one from a fresh match."""
    cache = ShadowRadixCache(CacheConfig(**CFG))
    a, b = list(range(32)), list(range(1000, 1032))
    cached(cache, a)
    cached(cache, b)
    m_a = cache.match_prefix(a[:20] + [5])  # ends inside a's node: its admission splits it
    m_b = cache.match_prefix(b + [7])
    r_a = cache.admit(a[:20] + [5], m_a)
    cached(cache, list(range(3000, 3012)))  # an insert
    cache.evict(swa_tokens=4)  # a's head pages: off b's window
    r_b = cache.admit(b + [7], m_b)  # was StaleMatchError before matches were re-checked
    assert r_b.length == m_b.prefix_len == 32 and r_a.length == 20
    assert r_b.vpages[:8] == list(cache.match_prefix(b).node.vpages)
    cache.check_invariants()


def test_a_hit_refreshes_recency():
    """`admit` on a hit makes the reused path the most recent while the request runs: SWA
    eviction (which may tombstone a running request's old pages, outside its window) then takes
    the other prompt's pages first, though that prompt was cached later. (Release touches the
    path again, so only a running request shows the admit's refresh.)"""
    cache = ShadowRadixCache(CacheConfig(**CFG))
    old, new = list(range(0, 32)), list(range(500, 532))
    cached(cache, old)
    cached(cache, new)
    r = cache.admit(old + [9])  # a hit on the older prompt, still running
    assert r.num_committed == 32
    report = cache.evict(swa_tokens=4)
    assert report.nodes_tombstoned == 1
    assert cache._tree.walk(np.asarray(new)).nodes[-1].live_from > 0  # the later prompt's
    assert r.terminal.live_from == 0  # the hit's path kept its SWA
    cache.check_invariants()


def test_exact_hits_are_never_approximate():
    cache = ShadowRadixCache(CacheConfig(**CFG))
    prompt = list(range(40))
    cached(cache, prompt)
    for cut in (8, 20, 40):
        m = cache.match_prefix(prompt[:cut] + [99])
        assert m.hit_len > 0 and not m.approximate and not m.is_replay
        r = cache.admit(prompt[:cut] + [99], m)
        assert not r.approximate
        cache.abort(r)


def test_an_empty_match_stays_valid_after_the_tree_changed() -> None:
    """``match_prefix(..., max_len=0)`` (a request that wants no reuse: prompt logprobs) taken
    before another request changed the tree is still admitted: there is nothing to re-match,
    not a malformed query."""
    cfg = CacheConfig(page_size=2, window=4, compress_ratios=(0, 2), overlap_ratios=(2,),
                      full_capacity=64, swa_capacity=32)  # fmt: skip
    cache = ShadowRadixCache(cfg)
    empty = cache.match_prefix([5, 6, 7], max_len=0)
    other = cache.admit([1, 2, 3, 4, 5])
    cache.extend(other, other.prompt_remaining)
    cache.finish(other)  # the tree changes
    request = cache.admit([5, 6, 7], empty)
    assert request.length == 0
    cache.abort(request)
    cache.check_invariants()
