"""KV-event consumers (issue #13): `subscribe_events` fans every event out to independent
queues (an offload executor and an engine's connector never take each other's events), and
`hisparse.lifetimes` turns the stream into page lives."""

from __future__ import annotations

import numpy as np
import pytest
from core_helpers import cached

from hisparse import InvalidInputError
from hisparse.lifetimes import PageLives, ended_pages
from shadowradix import (
    CacheConfig,
    ConfigError,
    InvalidRequestError,
    KvEvent,
    KvEventKind,
    ShadowRadixCache,
)

CFG = dict(page_size=4, window=8, compress_ratios=(4, 0), overlap_ratios=(4,),
           full_capacity=64, swa_capacity=48)  # fmt: skip


def _workload(cache: ShadowRadixCache) -> None:
    """Inserts, a deduplicated copy, an abort, and evictions of every kind."""
    cached(cache, list(range(20)))
    r = cache.admit(list(range(20)) + [5, 6, 7, 8, 9])
    cache.extend(r, r.prompt_remaining)
    cache.abort(r)
    for k in range(4):
        cached(cache, list(range(100 * k, 100 * k + 24)))
    cache.evict(swa_tokens=8)
    cache.reset()


def test_every_subscriber_sees_every_event_and_take_events_is_untouched() -> None:
    cache = ShadowRadixCache(CacheConfig(**CFG), kv_events=True)
    a, b = cache.subscribe_events(), cache.subscribe_events()
    _workload(cache)
    default = cache.take_events()
    first = a.take()
    assert first == default and b.take() == default
    kinds = {e.kind for e in default}
    assert kinds >= {KvEventKind.INSERTED, KvEventKind.FREED, KvEventKind.EVICTED}
    assert a.take() == [] and cache.take_events() == []  # each queue drained once
    b.close()
    cached(cache, list(range(500, 512)))
    assert len(a.take()) == 1 and len(cache.take_events()) == 1
    with pytest.raises(InvalidRequestError):
        b.take()
    with pytest.raises(InvalidRequestError):
        b.close()


def test_a_cache_without_kv_events_gives_id_only_events_to_early_subscribers() -> None:
    """Subscribing before anything is cached turns on id-only events (no hashes, no tokens);
    `take_events` stays off. Once the tree holds pages the hash chain cannot start: refused."""
    full = ShadowRadixCache(CacheConfig(**CFG), kv_events=True)
    light = ShadowRadixCache(CacheConfig(**CFG))
    sub = light.subscribe_events()
    _workload(full)
    _workload(light)
    events, reference = sub.take(), full.take_events()
    strip = [(e.kind, e.vpages, e.swa_pages, e.first_page) for e in reference]
    assert [(e.kind, e.vpages, e.swa_pages, e.first_page) for e in events] == strip
    assert all(e.page_hashes == () and e.token_ids == () for e in events)
    with pytest.raises(ConfigError):
        light.take_events()
    late = ShadowRadixCache(CacheConfig(**CFG))
    cached(late, list(range(12)))
    with pytest.raises(ConfigError, match="before it caches"):
        late.subscribe_events()


def test_ended_pages_are_the_evicted_and_freed_ids() -> None:
    events = [
        KvEvent(KvEventKind.INSERTED, (1, 2)),
        KvEvent(KvEventKind.FREED, (7, 3), (4,)),
        KvEvent(KvEventKind.TOMBSTONED, (1,), (9,)),
        KvEvent(KvEventKind.EVICTED, (2, 1)),
        KvEvent(KvEventKind.REVIVED, (5,), (9,)),
    ]
    assert ended_pages(events, 8).tolist() == [1, 2, 3, 7]
    with pytest.raises(InvalidInputError, match="out of range"):
        ended_pages([KvEvent(KvEventKind.FREED, (8,))], 8)
    alien = KvEvent(KvEventKind.FREED, (1,))
    object.__setattr__(alien, "kind", "relocated")  # a kind this module was not taught
    with pytest.raises(InvalidInputError, match="relocated"):
        ended_pages([alien], 8)


def test_a_page_life_runs_from_its_first_write_to_its_freeing() -> None:
    lives = PageLives(8)
    pages = np.array([2, 5])
    assert lives.begin([]).tolist() == []
    assert lives.fresh(pages).tolist() == [True, True]  # never written
    lives.wrote(pages)
    assert lives.fresh(pages).tolist() == [True, True]  # the step's other layers: still fresh
    lives.begin([])
    assert lives.fresh(pages).tolist() == [False, False]  # born
    lives.wrote(np.array([5]))  # written again, then freed before the next step
    assert lives.begin([KvEvent(KvEventKind.FREED, (5,))]).tolist() == [5]
    assert lives.fresh(pages).tolist() == [False, True]
    before = lives.born.copy()
    with pytest.raises(InvalidInputError):
        lives.begin([KvEvent(KvEventKind.EVICTED, (99,))])
    assert (lives.born == before).all()  # a bad stream changes nothing
