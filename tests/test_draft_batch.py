"""`ShadowRadixCache.extend_draft_batch`: several requests' drafts in one `Allocation`.

Contract: every rejected call raises a typed error and leaves the cache snapshot-identical
(statistics included); a draft batch is all or nothing; the slots it plans hold what
recomputation would (fingerprint oracle); rolling the batch back equals never drafting, exactly
after a full rejection in reverse order, and up to a renaming of page ids after any partial
acceptance (`canonical_snapshot`), against a twin that extended only the accepted tokens.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shadowradix import CacheConfig, CapacityError, InvalidRequestError, ShadowRadixCache
from shadowradix.testing import FingerprintOracle, canonical_snapshot, snapshot


def config(page: int = 4, **kw: Any) -> CacheConfig:
    base: dict[str, Any] = dict(
        page_size=page,
        window=8,
        compress_ratios=(0, 4, 8),
        overlap_ratios=(4,),
        full_capacity=64 * page,
        swa_capacity=24 * page,
        speculative=True,
        debug=True,
    )
    base.update(kw)
    return CacheConfig(**base)


def seq(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 5, n).tolist()


def assert_rejected(cache: ShadowRadixCache, error: type[Exception], call, *args) -> None:
    before, stats = snapshot(cache), cache.stats()
    with pytest.raises(error):
        call(*args)
    assert snapshot(cache) == before, "a rejected call changed the cache"
    assert cache.stats() == stats
    cache.check_invariants()


@pytest.fixture
def world():
    """A speculative cache with a finished prefix and three running requests, one of them on
    a hit; max_draft_len is 9 (C4 at page 16: ring 16, span 7)."""
    cache = ShadowRadixCache(config(page=16, window=16, compress_ratios=(0, 4, 16)))
    assert cache.config.max_draft_len == 9
    stem = seq(40, 1)
    done = cache.admit(stem)
    cache.extend(done, stem)
    cache.finish(done)
    reqs = [cache.admit(stem[:34] + [1]), cache.admit(seq(7, 2)), cache.admit(seq(20, 3))]
    for r in reqs:
        cache.extend(r, r.prompt_remaining.tolist())
    assert reqs[0].match.hit_len == 32
    return cache, reqs, done


BAD_BATCHES = {
    "empty_draft": lambda r: (r, [[1], []]),
    "float_draft": lambda r: (r, [[1], [1.5]]),
    "negative": lambda r: (r, [[-1], [1]]),
    "two_dimensional": lambda r: (r, [[[1, 2]], [1]]),
    "too_long": lambda r: (r, [[1], list(range(10))]),
    "counts_differ": lambda r: (r, [[1]]),
    "no_requests": lambda r: ([], []),
    "duplicate": lambda r: ([r[0], r[0]], [[1], [2]]),
    "not_a_request": lambda r: ([r[0], "x"], [[1], [2]]),
}


@pytest.mark.parametrize("bad", BAD_BATCHES.values(), ids=BAD_BATCHES.keys())
def test_bad_batches_rejected_unchanged(world, bad) -> None:
    cache, reqs, _ = world
    requests, tokens = bad(reqs[:2])
    assert_rejected(cache, InvalidRequestError, cache.extend_draft_batch, requests, tokens)


def test_inactive_or_drafting_member_rejects_the_whole_batch(world) -> None:
    cache, reqs, done = world
    assert_rejected(
        cache, InvalidRequestError, cache.extend_draft_batch, [reqs[0], done], [[1], [2]]
    )
    cache.extend_draft(reqs[1], [4, 4])
    assert_rejected(
        cache, InvalidRequestError, cache.extend_draft_batch, [reqs[0], reqs[1]], [[1], [2]]
    )
    cache.rollback(reqs[1], 2)


def test_needs_a_speculative_config() -> None:
    cache = ShadowRadixCache(config(speculative=False))
    r = cache.admit([1, 2, 3])
    cache.extend(r, [1, 2, 3])
    assert_rejected(cache, InvalidRequestError, cache.extend_draft_batch, [r], [[1]])


def test_capacity_error_leaves_everything_unchanged() -> None:
    """The second request's draft does not fit: nothing is allocated for the first either."""
    cache = ShadowRadixCache(config(page=4, full_capacity=4 * 6, swa_capacity=4 * 6))
    a, b = cache.admit(seq(6, 4)), cache.admit(seq(9, 5))
    cache.extend_batch([a, b], [a.prompt_remaining.tolist(), b.prompt_remaining.tolist()])
    assert_rejected(cache, CapacityError, cache.extend_draft_batch, [a, b], [[1] * 2, [1] * 9])
    cache.extend_draft_batch([a, b], [[1] * 2, [1] * 3])  # a smaller one fits
    cache.rollback(b, 3)
    cache.rollback(a, 2)


def test_full_rejection_in_reverse_order_restores_the_exact_snapshot(world) -> None:
    cache, reqs, _ = world
    before = snapshot(cache)
    cache.extend_draft_batch(reqs, [[1] * 9, [2] * 5, [3]])
    assert [r.num_draft for r in reqs] == [9, 5, 1]
    for r in reversed(reqs):
        cache.rollback(r, r.num_draft)
    assert snapshot(cache) == before


#: the longest draft drawn: ``max_draft_len`` at page 16 (C4 and C8: ring 16, span 7); no
#: bound at the smaller pages
LONGEST = 9
#: (tokens, accepted): a third the longest draft all rejected, a third the other corners (one
#: token or the longest, none or all accepted), a third uniform
DRAFTS = st.one_of(
    st.just((LONGEST, 0)),
    st.tuples(st.sampled_from([1, LONGEST]), st.sampled_from([0, LONGEST])),
    st.tuples(st.integers(1, LONGEST), st.integers(0, LONGEST)),
).flatmap(
    lambda shape: st.tuples(
        st.lists(st.integers(0, 4), min_size=shape[0], max_size=shape[0]), st.just(shape[1])
    )
)


@settings(max_examples=40, deadline=None)
@given(
    page=st.sampled_from([1, 2, 4, 8, 16]),
    drafts=st.lists(DRAFTS, min_size=1, max_size=3),
    rounds=st.integers(1, 3),
    order=st.permutations(range(3)),
)
def test_partial_acceptance_equals_never_drafting_up_to_renaming(page, drafts, rounds, order):
    """Batched draft + per-request rollback (in any order), round after round: the fingerprint
    oracle finds recomputation's value at every slot the batch wrote and every request reads,
    and the cache equals a twin that extended each request by its accepted tokens only, up to
    a renaming of page ids (exactly, for a batch of one)."""
    cache = ShadowRadixCache(
        config(page=page, full_capacity=max(256, 32 * page), swa_capacity=max(128, 16 * page))
    )
    assert cache.config.max_draft_len == (LONGEST if page == 16 else None)
    twin = ShadowRadixCache(cache.config)
    oracle = FingerprintOracle(cache.config)
    prompts = [seq(5 + 7 * i, 10 + i) for i in range(len(drafts))]
    reqs, twins = [], []
    for c, out in ((cache, reqs), (twin, twins)):
        for p in prompts:
            out.append(c.admit(p))
        alloc = c.extend_batch(out, [list(p) for p in prompts])
        if c is cache:
            oracle.write(alloc, {r.id: r.tokens for r in out})
    for _ in range(rounds):
        alloc = cache.extend_draft_batch(reqs, [d for d, _ in drafts])
        oracle.write(alloc, {r.id: r.tokens for r in reqs})
        kept = [d[: min(a, len(d))] for d, a in drafts]
        for i in [i for i in order if i < len(reqs)]:
            cache.rollback(reqs[i], reqs[i].num_draft - len(kept[i]))
        live = [(t, k) for t, k in zip(twins, kept) if k]
        if live:
            twin.extend_batch([t for t, _ in live], [k for _, k in live])
        for r in reqs:
            oracle.check_reads(cache.read_plan(r), r.tokens, r.id)
        if len(reqs) == 1 and not alloc.evicted.full_pages and not alloc.evicted.swa_pages:
            assert snapshot(cache) == _renumbered(snapshot(twin), twin, cache)
        assert canonical_snapshot(cache) == canonical_snapshot(twin)
        cache.check_invariants()


def _renumbered(snap, twin, cache):
    """The twin's snapshot with its request ids replaced by the cache's (same admission order;
    ids are global counters)."""
    ids = {t.id: r.id for t, r in zip(twin.requests, cache.requests)}
    nodes, requests, *rest = snap
    return (nodes, tuple((ids[r[0]],) + r[1:] for r in requests), *rest)


def test_canonical_snapshot_sees_structural_differences(world) -> None:
    """Guards the guard: a different token, a different lock count, a different draft state
    all show up after renaming."""
    cache, reqs, _ = world
    base = canonical_snapshot(cache)
    other = copy.deepcopy(cache)
    assert canonical_snapshot(other) == base
    other.extend(other.requests[0], [1])
    assert canonical_snapshot(other) != base
    other = copy.deepcopy(cache)
    other.extend_draft(other.requests[0], [1])
    assert canonical_snapshot(other) != base
    other.rollback(other.requests[0], 1)
    assert canonical_snapshot(other) == base
    other.finish(other.requests[1])
    assert canonical_snapshot(other) != base
