"""Pool memory = the budget: what the pools cost per page, and a `CacheConfig` whose pools fit.

`KVPools` allocates rows for the live capacities plus one sentinel row per tensor, so its bytes
are affine in the two capacities::

    bytes(full_pages, swa_pages) = fixed + full_pages * per_full_page + swa_pages * per_swa_page

`pool_costs` measures the three numbers on pools of ``meta`` tensors (nothing is allocated), so
they include everything `KVPools.nbytes` counts: scales of quantised formats, the MTP layer's
window and page hidden states, the tail-only validity flags. `budget_cache_config` splits a byte
budget by SGLang's ``swa_full_tokens_ratio`` with them (`CacheConfig.from_budget`), and
`PoolCosts.split` gives the capacities of another ratio within the same budget, for a run-time
re-balance (`pool_balance`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from adapters.memory.pools import KVPools
from adapters.model.model_config import ModelConfig
from shadowradix import CacheConfig, split_budget


@dataclass(frozen=True)
class PoolCosts:
    """Bytes of the pools: ``fixed`` (sentinel rows) plus per page of each pool."""

    fixed: int
    per_full_page: int
    per_swa_page: int
    page_size: int

    def nbytes(self, full_pages: int, swa_pages: int) -> int:
        return self.fixed + full_pages * self.per_full_page + swa_pages * self.per_swa_page

    def split(self, total_bytes: int, swa_full_tokens_ratio: float) -> tuple[int, int]:
        """``(full_capacity, swa_capacity)`` in tokens whose pools fit ``total_bytes``."""
        p = self.page_size
        return split_budget(
            total_bytes - self.fixed,
            swa_full_tokens_ratio,
            self.per_full_page / p,
            self.per_swa_page / p,
            p,
        )


def pool_costs(
    model: ModelConfig, cache: CacheConfig, dtype: torch.dtype, **pool_kwargs: object
) -> PoolCosts:
    """What `KVPools(model, cache-shaped config, dtype, **pool_kwargs)` costs: measured on
    ``meta`` pools at three sizes (the cost is affine in the capacities)."""
    p, lo = cache.page_size, cache.window_pages + 1

    def measured(full_pages: int, swa_pages: int) -> int:
        cfg = dataclasses.replace(
            cache,
            full_capacity=full_pages * p,
            swa_capacity=swa_pages * p,
            max_full_capacity=None,
            max_swa_capacity=None,
        )
        pools = KVPools(model, cfg, "meta", dtype, **pool_kwargs)  # type: ignore[arg-type]
        return pools.nbytes().total

    base = measured(1, lo)
    per_full = measured(2, lo) - base
    per_swa = measured(1, lo + 1) - base
    return PoolCosts(base - per_full - lo * per_swa, per_full, per_swa, p)


def budget_cache_config(
    model: ModelConfig,
    total_bytes: int,
    swa_full_tokens_ratio: float,
    dtype: torch.dtype,
    *,
    page_size: int = 64,
    pool_kwargs: dict[str, object] | None = None,
    **cache_kwargs: object,
) -> CacheConfig:
    """A `CacheConfig` for ``model`` whose pools (`KVPools` with ``pool_kwargs``) hold at most
    ``total_bytes``, split ``swa_full_tokens_ratio`` SWA tokens per full token; its maxima let
    `rebalance` give either pool everything the other does not need."""
    shape = model.cache_config(
        page_size=page_size,
        full_capacity=page_size,
        swa_capacity=(-(-model.window // page_size) + 2) * page_size,
        **cache_kwargs,
    )
    costs = pool_costs(model, shape, dtype, **(pool_kwargs or {}))
    fields = {
        f.name: getattr(shape, f.name)
        for f in dataclasses.fields(shape)
        if f.init and f.name not in _SIZED
    }
    return CacheConfig.from_budget(
        total_bytes,
        swa_full_tokens_ratio,
        full_bytes_per_token=costs.per_full_page / page_size,
        swa_bytes_per_token=costs.per_swa_page / page_size,
        page_size=page_size,
        fixed_bytes=costs.fixed,
        **fields,
    )


_SIZED = {"page_size", "full_capacity", "swa_capacity", "max_full_capacity", "max_swa_capacity"}
