"""Verification gaps of issue #13 around recency in the core: `admit` refreshes every node of
the reused path (not only its last one), and the SWA tail-window tier covers the pages meeting
a node's last ``window`` tokens also when ``window % page_size != 0``. Each test fails on a copy
of the core carrying the bug it names."""

from __future__ import annotations

import numpy as np
import pytest
from core_helpers import cached

from shadowradix import CacheConfig, ShadowRadixCache, WindowSource
from shadowradix.node import Node


def _node(cache: ShadowRadixCache, tokens: list[int], end_page: int) -> Node:
    walk = cache._tree.walk(np.asarray(tokens))
    return next(n for n in walk.nodes if n.end_page == end_page)


def test_a_hit_refreshes_every_node_of_its_path() -> None:
    """A hit on X + Y (two nodes) makes both the most recent while it runs: SWA eviction then
    takes the head of a prompt cached after X + Y, not X's head (X is read by the hit too)."""
    p = 4
    cfg = dict(page_size=p, window=8, compress_ratios=(4, 0), overlap_ratios=(4,),
               full_capacity=256, swa_capacity=128, debug=True)  # fmt: skip
    cache = ShadowRadixCache(CacheConfig(**cfg))
    x, y, other = list(range(32)), list(range(100, 116)), list(range(500, 532))
    cached(cache, x)
    cached(cache, x + y)  # X [0, 8) and Y [8, 12)
    cached(cache, other)  # more recent than both
    r = cache.admit(x + y + [9])
    assert r.num_committed == 48 and [n.end_page for n in r.terminal.path_from_root()] == [8, 12]
    assert cache.evict(swa_tokens=p).nodes_tombstoned == 1
    assert _node(cache, other, 8).live_from > 0, "the least recent head was not the one evicted"
    assert _node(cache, x, 8).live_from == 0, "the hit did not refresh the start of its path"
    cache.check_invariants()


def _head_pages(node: Node, page: int, window: int) -> int:
    """Pages of ``node`` holding no token of its last ``window`` tokens (from the definition:
    page ``k`` covers tokens ``[k * page, (k + 1) * page)``)."""
    last = node.end_page * page - window
    return sum(1 for k in range(node.start_page, node.end_page) if (k + 1) * page <= last)


@pytest.mark.parametrize("page, window", [(4, 6), (8, 6), (4, 10), (2, 7)])
def test_tail_windows_outlast_every_head_when_the_window_is_not_whole_pages(
    page: int, window: int
) -> None:
    """A stem and two branches (sgl#35515): evicting exactly the head pages of all three nodes
    leaves both branch ends matchable with a live window, although the window's first page is
    only partly inside it; one more page of eviction is then a tail window's."""
    cfg = dict(page_size=page, window=window, compress_ratios=(0, 2), overlap_ratios=(2,),
               full_capacity=64 * page, swa_capacity=32 * page, debug=True)  # fmt: skip
    cache = ShadowRadixCache(CacheConfig(**cfg))
    n = 2 * (-(-window // page)) * page  # each node twice the window, rounded up to pages
    stem = list(range(1000, 1000 + n))
    a, b = stem + list(range(2000, 2000 + n)), stem + list(range(3000, 3000 + n))
    cached(cache, a)
    cached(cache, b)  # splits a's node: the stem and two branches
    nodes = cache._tree.nodes()
    assert sorted(x.num_pages for x in nodes) == [n // page] * 3
    assert all(x.live_from == 0 for x in nodes)
    heads = sum(_head_pages(x, page, window) for x in nodes)
    report = cache.evict(swa_tokens=heads * page)
    assert report.swa_pages == heads
    for branch in (a, b):
        m = cache.match_prefix(branch + [7])
        assert m.window is WindowSource.LIVE and m.prefix_len == len(branch), (
            "a branch's tail window was evicted before every head"
        )
    assert all(x.live_from == _head_pages(x, page, window) for x in nodes)
    cache.evict(swa_tokens=1)
    assert min(cache.match_prefix(br + [7]).prefix_len for br in (a, b)) < 2 * n
    cache.check_invariants()
