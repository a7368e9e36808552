"""A Prometheus collector for a cache (``pip install shadowradix[metrics]``).

    from prometheus_client import CollectorRegistry, generate_latest
    registry = CollectorRegistry()
    registry.register(CacheCollector(cache))
    generate_latest(registry)   # the text exposition, scraped as usual

Counters are the cache's cumulative totals (Prometheus takes the rates); gauges are the pools'
pages by state. Read on every scrape from `ShadowRadixCache.stats`, in the scheduler's thread
or not: the numbers are plain ints read without locks (a scrape may mix two steps).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..cache import ShadowRadixCache

_COUNTERS = (  # name, CacheStats attribute (or evicted.<field>), help
    ("admissions", "admissions", "Requests admitted."),
    ("prompt_tokens", "prompt_tokens", "Prompt tokens admitted."),
    ("hit_tokens", "hit_tokens", "Prompt tokens reused from the tree."),
    ("matched_tokens", "matched_tokens", "Prompt tokens the tree held when admitted."),
    ("replayed_tokens", "replayed_tokens", "Window tokens recomputed by bounded replay."),
    ("approximate_hits", "approximate_hits", "Admissions reusing replay-derived state."),
    ("evicted_full_pages", "evicted.full_pages", "Virtual pages removed from the tree."),
    ("evicted_swa_pages", "evicted.swa_pages", "SWA pages freed by eviction or tombstoning."),
    ("evicted_nodes", "evicted.nodes_removed", "Tree nodes removed."),
    ("tombstone_steps", "evicted.nodes_tombstoned", "SWA tombstoning steps."),
)
_STATES = ("free", "evictable", "protected", "held")


class CacheCollector(Collector):
    """Collects ``<prefix>_<counter>_total`` and ``<prefix>_pool_pages{pool, state}``."""

    def __init__(self, cache: ShadowRadixCache, prefix: str = "shadowradix") -> None:
        self.cache, self.prefix = cache, prefix

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self.cache.stats()
        for name, attr, doc in _COUNTERS:
            value: object = stats
            for part in attr.split("."):
                value = getattr(value, part)
            yield CounterMetricFamily(f"{self.prefix}_{name}", doc, value=float(value))  # type: ignore[arg-type]
        pages = GaugeMetricFamily(
            f"{self.prefix}_pool_pages", "Pages of each pool by state.", labels=["pool", "state"]
        )
        for pool_name, pool in (("full", stats.full), ("swa", stats.swa)):
            for state in _STATES:
                pages.add_metric([pool_name, state], getattr(pool, f"{state}_pages"))
        yield pages
        yield GaugeMetricFamily(f"{self.prefix}_requests", "Active requests.",
                                value=stats.num_requests)  # fmt: skip
