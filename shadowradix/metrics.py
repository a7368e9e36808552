"""Interval metrics of a cache (`ShadowRadixCache.take_metrics`): what happened between two
`CacheStats` snapshots. Cumulative counters for a scraper: `shadowradix.integrations.prometheus`."""

from __future__ import annotations

from dataclasses import dataclass

from .results import CacheStats, PoolStats


@dataclass(frozen=True)
class IntervalMetrics:
    """Counts over one interval of ``seconds``, and the pools at its end.

    ``matched_tokens``: the tree-held prefix of the admitted prompts (their matches'
    ``cached_len``); ``hit_tokens`` of it were reused and ``replayed_tokens`` recomputed for a
    window; ``window_loss_tokens`` is the rest: held, but past the last live window (tombstoned
    SWA) so recomputed. Evictions: full pages removed with their nodes, SWA pages freed (with
    removed nodes or by tombstoning), and the tombstoning steps."""

    seconds: float
    admissions: int
    prompt_tokens: int
    hit_tokens: int
    matched_tokens: int
    replayed_tokens: int
    approximate_hits: int
    full_pages_evicted: int
    swa_pages_evicted: int
    nodes_removed: int
    tombstone_steps: int
    full: PoolStats
    swa: PoolStats

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def window_loss_tokens(self) -> int:
        return self.matched_tokens - self.hit_tokens - self.replayed_tokens

    @classmethod
    def between(cls, before: CacheStats, after: CacheStats, seconds: float) -> IntervalMetrics:
        e0, e1 = before.evicted, after.evicted
        return cls(
            seconds=seconds,
            admissions=after.admissions - before.admissions,
            prompt_tokens=after.prompt_tokens - before.prompt_tokens,
            hit_tokens=after.hit_tokens - before.hit_tokens,
            matched_tokens=after.matched_tokens - before.matched_tokens,
            replayed_tokens=after.replayed_tokens - before.replayed_tokens,
            approximate_hits=after.approximate_hits - before.approximate_hits,
            full_pages_evicted=e1.full_pages - e0.full_pages,
            swa_pages_evicted=e1.swa_pages - e0.swa_pages,
            nodes_removed=e1.nodes_removed - e0.nodes_removed,
            tombstone_steps=e1.nodes_tombstoned - e0.nodes_tombstoned,
            full=after.full,
            swa=after.swa,
        )
