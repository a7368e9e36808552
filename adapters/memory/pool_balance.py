"""When one pool starves while the other has room: the new split of the byte budget.

SGLang sizes the SWA pool as a fixed ``swa_full_tokens_ratio`` of the full pool. Short requests
want SWA (every token of a short request is inside its window), long ones want full pages (a
long prompt's compressed KV stays cached, its window is a sliver). `PoolBalance.plan` answers a
shortfall of one pool with pages of the other, within the budget the pools were sized for::

    grow  = max(shortfall, margin * capacity of the starving pool)      (hysteresis: overshoot)
    give  = grow * its page cost / the other's page cost, rounded up     (same bytes)
    give <= the other's capacity - its locked, held and reserved pages   (else less, or nothing)
    grow  = give * the other's page cost / its page cost, rounded down   (all the bytes freed)

and refuses to reverse the previous move within ``cooldown`` steps, so a workload at the
boundary does not make the pools swing back and forth.

A pool rarely runs out outright: LRU eviction makes room from cached content, and the hits are
lost quietly. `PoolBalance.observe` watches for that every ``period`` steps: a pool that evicted
since the last look, whose next victim is one a match needs and young (used ``age`` tree
accesses ago: `ShadowRadixCache.eviction_ages`), while the other pool's next victim is at least
``age_ratio`` times older or costs no hit (or it has free pages), starves for memory the other
holds as slack: it gets a `plan` of one margin's growth. The plan only says
*what*; `ShadowRadixCache.rebalance` evicts and relocates, `pool_resize.apply_rebalance` moves
the rows (`admission.Admission._rebalance`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from adapters.memory.pool_budget import PoolCosts
from shadowradix import CacheStats


@dataclass
class PoolBalance:
    """The budget the pools were sized for (`pool_budget.budget_cache_config`), their per-page
    costs, and the least each pool keeps: ``min_swa_pages`` (a prefill chunk and its window),
    ``min_full_pages``. ``margin``: the least a starving pool grows by, as a fraction of its
    capacity; ``cooldown``: steps during which the opposite move is refused."""

    costs: PoolCosts
    budget: int
    min_full_pages: int
    min_swa_pages: int
    margin: float = 0.25
    cooldown: int = 16
    period: int = 8
    age_ratio: float = 4.0
    #: (step, pool grown) of the last rebalance
    last: tuple[int, str] | None = field(default=None, repr=False)
    #: (step, full pages evicted, SWA nodes tombstoned) at the last `observe`
    _mark: tuple[int, int, int] | None = field(default=None, repr=False)

    def observe(
        self, stats: CacheStats, ages: tuple[int | None, int | None], step: int
    ) -> tuple[str, tuple[int, int]] | None:
        """Every ``period`` steps: the starving pool and a `plan` for it, or ``None``.
        ``ages``: `ShadowRadixCache.eviction_ages`."""
        ev = stats.evicted
        mark = (step, ev.full_pages, ev.nodes_tombstoned)
        if self._mark is None or step - self._mark[0] >= self.period:
            last, self._mark = self._mark, mark
            if last is None:
                return None
            evicting = {"full": ev.full_pages > last[1], "swa": ev.nodes_tombstoned > last[2]}
            for short, own, other, giver in (
                ("full", ages[0], ages[1], stats.swa),
                ("swa", ages[1], ages[0], stats.full),
            ):
                if own is None:  # nothing it evicts costs a hit
                    continue
                slack = giver.free_pages > self.margin * giver.capacity_pages or (
                    other is None or other > self.age_ratio * max(own, 1)
                )
                if evicting[short] and slack:
                    plan = self.plan(stats, short, 1, step)
                    return None if plan is None else (short, plan)
        return None

    def plan(
        self,
        stats: CacheStats,
        short_pool: str,
        shortfall_pages: int,
        step: int,
        force: bool = False,
    ) -> tuple[int, int] | None:
        """``(full_capacity, swa_capacity)`` in tokens that give ``short_pool`` (``"full"`` or
        ``"swa"``) at least ``shortfall_pages`` more pages, or ``None`` (the other pool cannot
        spare them, the budget would be exceeded, or the opposite move was too recent; with
        ``force``, the last rule is waived: nothing else would let the step run)."""
        if not force and self.last is not None and self.last[1] != short_pool:
            if step - self.last[0] < self.cooldown:
                return None
        grow_full = short_pool == "full"
        x, y = (stats.full, stats.swa) if grow_full else (stats.swa, stats.full)
        cx, cy = (
            (self.costs.per_full_page, self.costs.per_swa_page)
            if grow_full
            else (self.costs.per_swa_page, self.costs.per_full_page)
        )
        floor_y = self.min_swa_pages if grow_full else self.min_full_pages
        spare = y.capacity_pages - max(floor_y, y.protected_pages + y.held_pages)
        grow = max(shortfall_pages, int(self.margin * x.capacity_pages))
        give = min(-(-grow * cx // cy), max(spare, 0))
        grow = give * cy // cx  # every byte the other pool gives up
        if grow < shortfall_pages or grow <= 0:
            return None
        new_x, new_y = x.capacity_pages + grow, y.capacity_pages - give
        full, swa = (new_x, new_y) if grow_full else (new_y, new_x)
        if self.costs.nbytes(full, swa) > self.budget:
            return None
        p = self.costs.page_size
        return full * p, swa * p

    def applied(self, step: int, short_pool: str) -> None:
        """Record a rebalance done at ``step`` in favour of ``short_pool``."""
        self.last = (step, short_pool)
