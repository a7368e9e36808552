"""Namespaces (LoRA id, cache salt, tenant): prefixes never match across them, pools are shared,
the default namespace behaves as before, and their page hashes differ."""

from __future__ import annotations

import numpy as np
import pytest
from core_helpers import cached

from shadowradix import CacheConfig, InvalidRequestError, ShadowRadixCache

CFG = dict(page_size=4, window=8, compress_ratios=(4, 0), overlap_ratios=(4,),
           full_capacity=256, swa_capacity=128)  # fmt: skip
PROMPT = list(range(24))


def _path_ids(cache, prompt, namespace):
    walk = cache._tree.walk(np.asarray(prompt), start=cache._tree.root_of(namespace))
    return {n.id for n in walk.nodes}


def test_namespaces_never_share_a_node():
    cache = ShadowRadixCache(CacheConfig(**CFG))
    cached(cache, PROMPT, namespace="tenant-a")
    assert cache.match_prefix(PROMPT + [1], namespace="tenant-b").cached_len == 0
    assert cache.match_prefix(PROMPT + [1]).cached_len == 0  # the default namespace neither
    assert cache.match_prefix(PROMPT + [1], namespace="tenant-a").cached_len == 24
    cached(cache, PROMPT, namespace="tenant-b")
    cached(cache, PROMPT, namespace=("lora", 7))
    ids = [_path_ids(cache, PROMPT, ns) for ns in ("tenant-a", "tenant-b", ("lora", 7))]
    assert all(ids) and not (ids[0] & ids[1]) and not (ids[0] & ids[2]) and not (ids[1] & ids[2])
    r = cache.admit(PROMPT + [1], namespace="tenant-b")  # hits its own copy
    assert r.length == 24
    assert set(r.vpages[:6]).isdisjoint(
        cache.match_prefix(PROMPT, namespace="tenant-a").node.vpages
    )
    cache.check_invariants()
    assert cache.stats().full.evictable_pages == 12  # the pools are shared: a's and lora's
    cache.abort(r)
    cache.evict(full_tokens=256)  # eviction runs over every namespace
    assert cache.stats().full.evictable_pages == 0
    cache.check_invariants()


def test_a_match_carries_its_namespace():
    cache = ShadowRadixCache(CacheConfig(**CFG))
    cached(cache, PROMPT, namespace=3)
    m = cache.match_prefix(PROMPT + [1], namespace=3)
    assert m.namespace == 3 and m.prefix_len == 24
    with pytest.raises(InvalidRequestError, match="namespace"):
        cache.admit(PROMPT + [1], m, namespace=4)
    cached(cache, list(range(100, 120)), namespace=4)  # the tree moves on elsewhere
    r = cache.admit(PROMPT + [1], m)  # re-checked in its own namespace
    assert r.length == 24
    with pytest.raises(InvalidRequestError, match="hashable"):
        cache.match_prefix(PROMPT, namespace=["not", "hashable"])
    cache.check_invariants()


def test_page_hashes_differ_across_namespaces():
    cache = ShadowRadixCache(CacheConfig(**CFG), kv_events=True)
    cached(cache, PROMPT)
    cached(cache, PROMPT, namespace="salt")
    cached(cache, PROMPT, namespace="salt2")
    default, salted, other = (e.page_hashes for e in cache.take_events())
    assert len(set(default) | set(salted) | set(other)) == 18
