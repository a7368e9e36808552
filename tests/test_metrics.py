"""Interval metrics (`take_metrics`) count what happened since the last call, and the
Prometheus collector exposes the cumulative totals and pool pages in the text format."""

from __future__ import annotations

import pytest
from core_helpers import cached

from shadowradix import CacheConfig, ShadowRadixCache

CFG = dict(page_size=4, window=8, compress_ratios=(4, 0), overlap_ratios=(4,),
           full_capacity=128, swa_capacity=64)  # fmt: skip


def test_intervals_count_what_happened_since_the_last_call():
    cache = ShadowRadixCache(CacheConfig(**CFG))
    first = cache.take_metrics()
    assert first.admissions == 0 and first.hit_ratio == 0.0 and first.seconds >= 0
    cached(cache, list(range(20)))
    cached(cache, list(range(16)) + [9, 9, 9, 9])  # reuses 16 tokens
    m = cache.take_metrics()
    assert (m.admissions, m.prompt_tokens, m.hit_tokens, m.matched_tokens) == (2, 40, 16, 16)
    assert m.hit_ratio == pytest.approx(0.4) and m.window_loss_tokens == 0
    assert m.full.free_pages == cache.stats().full.free_pages
    cache.evict(swa_tokens=64)  # every window: the next match holds pages it cannot reuse
    cached(cache, list(range(20)) + [5])
    m = cache.take_metrics()
    assert m.admissions == 1 and m.hit_tokens == 0 and m.matched_tokens == 20
    assert m.window_loss_tokens == 20 and m.tombstone_steps > 0 and m.swa_pages_evicted > 0
    cache.evict(full_tokens=128)
    m = cache.take_metrics()
    assert m.admissions == 0 and m.full_pages_evicted > 0 and m.nodes_removed > 0


def test_prometheus_exposition():
    prometheus_client = pytest.importorskip("prometheus_client")
    from shadowradix.integrations.prometheus import CacheCollector

    cache = ShadowRadixCache(CacheConfig(**CFG))
    cached(cache, list(range(20)))
    cached(cache, list(range(16)) + [9, 9, 9, 9])
    registry = prometheus_client.CollectorRegistry()
    registry.register(CacheCollector(cache, prefix="sr"))
    text = prometheus_client.generate_latest(registry).decode()
    lines = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
             for line in text.splitlines() if line and not line.startswith("#")}  # fmt: skip
    assert lines["sr_admissions_total"] == 2 and lines["sr_hit_tokens_total"] == 16
    assert lines["sr_prompt_tokens_total"] == 40
    stats = cache.stats()
    assert lines['sr_pool_pages{pool="full",state="free"}'] == stats.full.free_pages
    assert lines['sr_pool_pages{pool="swa",state="evictable"}'] == stats.swa.evictable_pages
    assert lines["sr_requests"] == 0
    assert "# TYPE sr_evicted_full_pages_total counter" in text
