"""Verification gaps of issue #13 around matches: staleness across SWA evictions, the LRU
refresh a hit gives, and exact hits never reported approximate. Each test fails on the bug it
names (checked by hand against a copy of the core with that bug)."""

from __future__ import annotations

import numpy as np
import pytest

from shadowradix import CacheConfig, ShadowRadixCache, StaleMatchError

CFG = dict(page_size=4, window=8, compress_ratios=(4, 0), overlap_ratios=(4,),
           full_capacity=256, swa_capacity=128)  # fmt: skip


def _cached(cache, prompt):
    r = cache.admit(prompt)
    cache.extend(r, r.prompt_remaining)
    cache.finish(r)


def test_a_match_between_two_swa_evictions_is_stale():
    """Tombstoning changes which windows are live: a match taken after one SWA eviction must
    be refused after the next one (the tree's version moves on every tombstone), and the
    refused admit changes nothing."""
    cache = ShadowRadixCache(CacheConfig(**CFG))
    for base in (0, 1000):
        _cached(cache, list(range(base, base + 32)))
    first = cache.evict(swa_tokens=4)
    assert first.nodes_tombstoned == 1
    m = cache.match_prefix(list(range(1000, 1032)) + [7])
    assert m.prefix_len > 0
    second = cache.evict(swa_tokens=4)
    assert second.nodes_tombstoned == 1
    before = (cache.stats(), cache._tree.version)
    with pytest.raises(StaleMatchError):
        cache.admit(list(range(1000, 1032)) + [7], m)
    assert (cache.stats(), cache._tree.version) == before
    cache.check_invariants()


def test_a_hit_refreshes_recency():
    """`admit` on a hit makes the reused path the most recent while the request runs: SWA
    eviction (which may tombstone a running request's old pages, outside its window) then takes
    the other prompt's pages first, though that prompt was cached later. (Release touches the
    path again, so only a running request shows the admit's refresh.)"""
    cache = ShadowRadixCache(CacheConfig(**CFG))
    old, new = list(range(0, 32)), list(range(500, 532))
    _cached(cache, old)
    _cached(cache, new)
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
    _cached(cache, prompt)
    for cut in (8, 20, 40):
        m = cache.match_prefix(prompt[:cut] + [99])
        assert m.hit_len > 0 and not m.approximate and not m.is_replay
        r = cache.admit(prompt[:cut] + [99], m)
        assert not r.approximate
        cache.abort(r)
