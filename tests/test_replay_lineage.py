"""Bounded replay is an approximation: state computed downstream of a replayed window is
flagged, reuse of it is reported, and an exact request never reads it."""

from __future__ import annotations

import pytest

from shadowradix import CacheConfig, ShadowRadixCache, WindowSource
from shadowradix.testing import FingerprintOracle, OracleViolation

P, W = 4, 8


def _cache() -> ShadowRadixCache:
    return ShadowRadixCache(
        CacheConfig(
            page_size=P,
            window=W,
            compress_ratios=(0, 2, 8),
            overlap_ratios=(2,),
            full_capacity=P * 64,
            swa_capacity=P * 32,
            bounded_replay=True,
            debug=True,
        )
    )


def _serve(cache, oracle, prompt, approximate_ok=True):  # type: ignore[no-untyped-def]
    request = cache.admit(prompt, cache.match_prefix(prompt[:-1]))
    approx = {request.id} if request.approximate else set()
    if request.replay_allocation is not None:
        oracle.write(request.replay_allocation, {request.id: request.tokens}, approx)
    alloc = cache.extend(request, request.prompt_remaining)
    oracle.write(alloc, {request.id: request.tokens}, approx)
    oracle.check_reads(cache.read_plan(request), request.tokens, request.id, request.approximate)
    cache.cache_unfinished(request)
    cache.finish(request)
    return request


def test_state_built_on_a_replay_is_flagged_for_every_later_reuse() -> None:
    cache, oracle = _cache(), FingerprintOracle(_cache().config)
    x, y, z = list(range(100, 132)), list(range(200, 216)), list(range(300, 308))
    first = _serve(cache, oracle, x + [1])
    assert not first.approximate
    cache.evict(swa_tokens=10**6)  # tombstone every window: only replay can reuse x now
    second = _serve(cache, oracle, x + y + [2])
    assert second.match.window is WindowSource.REPLAY and second.match.hit_len == 32 - W
    assert second.approximate
    m = cache.match_prefix(x + y + z)
    assert m.window is WindowSource.LIVE and m.prefix_len == 48
    assert m.approximate, "x + y was computed after a replay: reusing it is approximate"
    third = _serve(cache, oracle, x + y + z)
    assert third.approximate
    stats = cache.stats()
    assert (stats.replayed_hits, stats.approximate_hits) == (1, 2)


def test_exact_prefix_of_a_replayed_branch_stays_exact() -> None:
    cache, oracle = _cache(), FingerprintOracle(_cache().config)
    x, y = list(range(100, 132)), list(range(200, 216))
    _serve(cache, oracle, x + [1])
    cache.evict(swa_tokens=10**6)
    _serve(cache, oracle, x + y + [2])  # replayed: the pages it adds are approximate
    flags = sorted((n.start_page, n.end_page, n.approximate) for n in cache._tree.nodes())
    assert flags == [(0, 8, False), (8, 12, True)], "x itself was computed exactly"
    # and a replayed window is never given to the exact node it was replayed for
    assert all(len(n.swa_pages) == 0 for n in cache._tree.nodes() if n.end_page == 8)


def test_oracle_rejects_an_exact_reader_of_replayed_state() -> None:
    cache, oracle = _cache(), FingerprintOracle(_cache().config)
    x, y = list(range(100, 132)), list(range(200, 216))
    _serve(cache, oracle, x + [1])
    cache.evict(swa_tokens=10**6)
    _serve(cache, oracle, x + y + [2])
    reader = cache.admit(x + y + [5], cache.match_prefix(x + y))
    with pytest.raises(OracleViolation, match="without being flagged approximate"):
        oracle.check_reads(cache.read_plan(reader), reader.tokens, reader.id, False)
    oracle.check_reads(cache.read_plan(reader), reader.tokens, reader.id, reader.approximate)
