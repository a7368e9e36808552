"""Verification gaps of issue #13 around stale matches, beside tests/test_match_gaps.py (a match
between two SWA evictions): every change that can invalidate a match moves the tree's version,
so `admit` re-matches instead of trusting a match whose node was evicted or cut. Each test fails
on a copy of the core where that change leaves the version alone."""

from __future__ import annotations

import pytest
from core_helpers import cached

from shadowradix import CacheConfig, ShadowRadixCache, StaleMatchError
from shadowradix.testing import snapshot

CFG = dict(page_size=4, window=8, compress_ratios=(4, 0), overlap_ratios=(4,),
           full_capacity=256, swa_capacity=128)  # fmt: skip


def test_a_match_whose_node_was_evicted_is_stale() -> None:
    """Full eviction removes the matched leaf (and frees its pages) between match and admit:
    the admission must be refused, changing nothing, not lock a detached node."""
    cache = ShadowRadixCache(CacheConfig(**CFG))
    prompt = list(range(32))
    cached(cache, prompt)
    m = cache.match_prefix(prompt + [7])
    assert m.prefix_len == 32
    assert cache.evict(full_tokens=32).nodes_removed == 1
    before = snapshot(cache)
    with pytest.raises(StaleMatchError, match="match again"):
        cache.admit(prompt + [7], m)
    assert snapshot(cache) == before
    cache.check_invariants()


def test_a_match_inside_a_node_another_admission_cut_resumes_at_its_own_point() -> None:
    """Two matches end inside one node, after 4 and after 8 of its 10 pages. Admitting the
    shallow one splits the node, so the deep match's page offset into it is no longer right:
    its admission must re-match and resume after exactly 8 pages of the original node."""
    cache = ShadowRadixCache(CacheConfig(**CFG))
    prompt = list(range(40))
    cached(cache, prompt)
    (node,) = cache._tree.nodes()
    pages = list(node.vpages)
    deep = cache.match_prefix(prompt[:32] + [5])
    shallow = cache.match_prefix(prompt[:16] + [6])
    assert (deep.node_pages, shallow.node_pages) == (8, 4)
    r_shallow = cache.admit(prompt[:16] + [6], shallow)
    r_deep = cache.admit(prompt[:32] + [5], deep)
    assert r_shallow.vpages[:4] == pages[:4]
    assert r_deep.tree_pages == 8 and r_deep.vpages[:8] == pages[:8]
    assert r_deep.terminal.end_page == 8, "resumed at the wrong boundary of the cut node"
    assert sorted((n.start_page, n.end_page) for n in cache._tree.nodes()) == [
        (0, 4), (4, 8), (8, 10)
    ]  # fmt: skip
    cache.check_invariants()
    for r in (r_deep, r_shallow):
        cache.abort(r)
    cache.check_invariants()
