"""Embedder verbs of issue #13: `can_extend` (the non-raising capacity check, which must agree
with `extend_batch` exactly and change nothing) and `reset` (drops every cached prefix; refused
while a request runs)."""

from __future__ import annotations

import random

import pytest

from shadowradix import (
    CacheConfig,
    CapacityError,
    ExtendCheck,
    InvalidRequestError,
    ShadowRadixCache,
)

CFG = dict(page_size=4, window=8, compress_ratios=(4, 0), overlap_ratios=(4,),
           full_capacity=96, swa_capacity=48)  # fmt: skip


def _state(cache):
    return (cache.stats(), cache._full.free_snapshot(), cache._swa.free_snapshot(),
            cache._tree.version, tuple((r.id, r.length) for r in cache.requests))  # fmt: skip


@pytest.mark.parametrize("seed", range(6))
def test_can_extend_agrees_with_extend_batch(seed):
    """Random admissions, steps, finishes and evictions on small pools: before every step,
    `can_extend` changes nothing and says yes exactly when `extend_batch` goes through."""
    rng = random.Random(seed)
    cache = ShadowRadixCache(CacheConfig(**CFG))
    running, said_no = [], 0
    for _ in range(120):
        if len(running) < 3 and rng.random() < 0.4:
            base = rng.choice((0, 0, 100, 200))
            prompt = list(range(base, base + rng.randint(1, 20)))
            try:
                running.append(cache.admit(prompt))
            except CapacityError:
                pass
        if not running:
            continue
        batch = rng.sample(running, rng.randint(1, len(running)))
        counts = [rng.choice((1, 1, 2, 5, 13)) for _ in batch]
        before = _state(cache)
        check = cache.can_extend(batch, counts)
        assert isinstance(check, ExtendCheck) and _state(cache) == before
        tokens = [[rng.randrange(1000) for _ in range(n)] for n in counts]
        try:
            cache.extend_batch(batch, tokens)
            assert check.ok, check
        except CapacityError as exc:
            assert not check and check.short_pool == exc.pool, (check, exc)
            assert _state(cache) == before
            said_no += 1
        if rng.random() < 0.3:
            r = running.pop(rng.randrange(len(running)))
            cache.cache_unfinished(r)
            cache.finish(r)
    cache.check_invariants()
    assert said_no > 0  # the pools were small enough for refusals


def test_can_extend_refuses_bad_arguments():
    cache = ShadowRadixCache(CacheConfig(**CFG))
    r = cache.admit([1, 2, 3])
    for counts in ([0], [-1], [1.0], [True], 3, [1, 1]):
        with pytest.raises(InvalidRequestError):
            cache.can_extend([r], counts)  # type: ignore[arg-type]


def test_reset_empties_the_tree_and_is_refused_while_running():
    cache = ShadowRadixCache(CacheConfig(**CFG))
    for base in (0, 50):
        r = cache.admit(list(range(base, base + 20)))
        cache.extend(r, r.prompt_remaining)
        cache.finish(r)
    running = cache.admit(list(range(0, 12)) + [9])
    before = _state(cache)
    with pytest.raises(InvalidRequestError, match="still active"):
        cache.reset()
    assert _state(cache) == before
    cache.abort(running)
    report = cache.reset()
    assert report.full_pages == 10 and report.nodes_removed >= 2
    stats = cache.stats()
    assert stats.full.free_pages == stats.full.capacity_pages
    assert stats.swa.free_pages == stats.swa.capacity_pages
    assert cache._tree.nodes() == []  # only the root is left
    assert cache.match_prefix(list(range(20)) + [1]).cached_len == 0
    cache.check_invariants()
    r = cache.admit(list(range(20)))  # and the cache works on
    cache.extend(r, r.prompt_remaining)
    cache.finish(r)
    assert cache.match_prefix(list(range(20)) + [1]).cached_len == 20
