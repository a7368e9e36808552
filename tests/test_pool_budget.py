"""Issue #14 item 5, the pools: what `KVPools` allocates for a budget is at most the budget, and
a re-balance copies the moved pages' rows before resizing every tensor to the new capacities."""

from __future__ import annotations

import pytest
import torch

from adapters.memory.formats import CacheFormat
from adapters.memory.pool_budget import budget_cache_config, pool_costs
from adapters.memory.pool_resize import _tensors, apply_rebalance
from adapters.memory.pools import KVPools
from adapters.model.model_config import preset
from shadowradix import Pool, ShadowRadixCache

MODEL = preset("tiny")
BUDGET = 3_000_000
FP8 = dict(index_format=CacheFormat.FP8, swa_format=CacheFormat.FP8)


@pytest.mark.parametrize(
    "pool_kwargs", [{}, FP8, dict(mtp=True), dict(track_late_swa=True)], ids=str
)
@pytest.mark.parametrize("ratio", [0.1, 0.5])
def test_budget_pools_allocate_at_most_the_budget(pool_kwargs: dict, ratio: float) -> None:
    cc = budget_cache_config(
        MODEL, BUDGET, ratio, torch.float32, page_size=16, pool_kwargs=pool_kwargs
    )
    total = KVPools(MODEL, cc, "cpu", torch.float32, **pool_kwargs).nbytes().total
    costs = pool_costs(MODEL, cc, torch.float32, **pool_kwargs)
    assert total == costs.nbytes(cc.num_full_pages, cc.num_swa_pages)
    assert BUDGET - costs.per_full_page - 2 * costs.per_swa_page < total <= BUDGET
    assert cc.max_full_capacity > cc.full_capacity and cc.max_swa_capacity > cc.swa_capacity


def _filled(pools: KVPools) -> None:
    """Every row of every tensor distinct (its row number, in every channel)."""
    gen = torch.Generator().manual_seed(0)
    for holder, key, _, _ in _tensors(pools):
        t = holder[key]  # type: ignore[index]
        if t.dtype == torch.bool:
            t.copy_(torch.rand(t.shape, generator=gen) < 0.5)
        else:
            rows = torch.arange(t.shape[0], dtype=torch.float32).reshape(-1, *[1] * (t.dim() - 1))
            t.copy_((rows + torch.rand(t.shape, generator=gen)).to(t.dtype))


def _page_rows(pools: KVPools, pool: Pool, page: int) -> list[torch.Tensor]:
    out = []
    for holder, key, owner, k in _tensors(pools):
        if owner is pool:
            out.append(holder[key][page * k : (page + 1) * k].clone())  # type: ignore[index]
    return out


@pytest.mark.parametrize("pool_kwargs", [{}, FP8, dict(mtp=True, track_late_swa=True)], ids=str)
def test_apply_rebalance_moves_rows_then_fits_the_new_split(pool_kwargs: dict) -> None:
    cc = budget_cache_config(
        MODEL, BUDGET, 0.1, torch.float32, page_size=16, pool_kwargs=pool_kwargs
    )
    cache, pools = ShadowRadixCache(cc), KVPools(MODEL, cc, "cpu", torch.float32, **pool_kwargs)
    _filled(pools)
    s = 0
    while cache.stats().full.free_pages > 40:  # fill the full pool, then free its low ids
        s += 1
        r = cache.admit([s] * 300)
        cache.extend(r, r.prompt_remaining)
        cache.finish(r)
    cache.evict(full_tokens=2 * 304)
    live = cache.admit([9] * 200)
    cache.extend(live, live.prompt_remaining)
    vpages, spages = list(live.vpages), list(live.swa_pages)
    before_v = {v: _page_rows(pools, Pool.FULL, v) for v in vpages}
    before_s = {s: _page_rows(pools, Pool.SWA, s) for s in spages}
    costs = pool_costs(MODEL, cc, torch.float32, **pool_kwargs)
    full, swa = costs.split(BUDGET, 0.5)  # long-friendly to short-friendly: full shrinks
    report = cache.rebalance(full_capacity=full, swa_capacity=swa)
    assert len(report.full_moves) and full < cc.full_capacity and swa > cc.swa_capacity
    assert apply_rebalance(pools, report) and pools.generation == 1
    for old, new in zip(vpages, live.vpages):
        for a, b in zip(before_v[old], _page_rows(pools, Pool.FULL, new)):
            assert torch.equal(a, b)
    for old, new in zip(spages, live.swa_pages):
        for a, b in zip(before_s[old], _page_rows(pools, Pool.SWA, new)):
            assert torch.equal(a, b)
    p = cc.page_size
    assert pools.swa[0].shape[0] == swa + 1 and pools.full_pages == full // p
    assert pools.nbytes().total == costs.nbytes(full // p, swa // p) <= BUDGET
    with pytest.raises(ValueError, match="pools hold"):
        apply_rebalance(pools, report)  # applied twice
    cache.check_invariants()
