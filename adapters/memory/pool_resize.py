"""Applying a core re-balance to the physical pools: copy the moved pages' rows, then resize.

`ShadowRadixCache.rebalance` keeps every page id in use below the new capacities and reports
the pages it renamed (`RebalanceReport.full_moves` / ``swa_moves``). Every row of every pool is
page-local arithmetic (shadows.py), so a page move is a copy of one row range per tensor::

    SWA page s     window latents [s*P, (s+1)*P) of every layer (and their FP8 scales),
                   ring rows [s*L, (s+1)*L) of every KV-source layer's rings (L = ring_len),
                   page_hidden[s] (MTP), late_swa_valid[s*P, (s+1)*P) (tail-only)
    virtual page v compressed entries [v*k, (v+1)*k) of every KV-source layer, indexer keys
                   (and scales) alike (k = slots_per_page)

Then each tensor is re-allocated at its new size plus the sentinel row, the pool that shrinks
first: the steady state never exceeds the larger of the old and new totals, and the transient
is one tensor (the old and the new copy of the tensor being resized). Resizing replaces the
tensors, so ``KVPools.generation`` moves on: whoever holds their addresses (captured CUDA
graphs) must drop them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from adapters.memory.pools import KVPools
from shadowradix import PageMoves, Pool, RebalanceReport


def _tensors(pools: KVPools) -> Iterator[tuple[Any, Any, Pool, int]]:
    """Every pool tensor: (its holder, its key there, the pool its rows follow, rows per page)."""
    cfg, p = pools.cache, pools.cache.page_size
    for i in range(len(pools.swa)):
        yield pools.swa, i, Pool.SWA, p
    for rings in (pools.ring, pools.index_ring):
        for layer in rings:
            ratio = pools.model.compress_ratios[layer]
            yield rings, layer, Pool.SWA, cfg.stream(ratio).ring_len
    for pool in (pools.compressed, pools.index_keys):
        for layer in pool:
            ratio = pools.model.compress_ratios[layer]
            yield pool, layer, Pool.FULL, cfg.stream(ratio).slots_per_page
    attrs = vars(pools)
    if pools.page_hidden is not None:
        yield attrs, "page_hidden", Pool.SWA, 1
    if pools.late_swa_valid is not None:
        yield attrs, "late_swa_valid", Pool.SWA, p


def _rows(moves: PageMoves, per_page: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    src = torch.tensor(moves.src, dtype=torch.long, device=device)
    dst = torch.tensor(moves.dst, dtype=torch.long, device=device)
    k = torch.arange(per_page, dtype=torch.long, device=device)
    return (src[:, None] * per_page + k).flatten(), (dst[:, None] * per_page + k).flatten()


def _resized(t: torch.Tensor, rows: int, fill: float = 0.0) -> torch.Tensor:
    """``t`` with ``rows`` rows plus a fresh sentinel row (the kept rows copied, new rows
    ``fill``: 0, or 1 for FP8 / FP4 scales, as `KVPools` allocates them)."""
    make = torch.zeros if fill == 0 else torch.ones
    out = make((rows + 1, *t.shape[1:]), dtype=t.dtype, device=t.device)
    keep = min(rows, t.shape[0] - 1)
    out[:keep] = t[:keep]
    return out


def apply_rebalance(pools: KVPools, report: RebalanceReport) -> bool:
    """Copy the moved pages' rows, then resize every tensor to the report's capacities.
    Returns whether any tensor was replaced (``pools.generation`` then moved on). Raises
    `ValueError`, changing nothing, for a report whose old capacities are not the pools'
    (another cache's, or one applied twice)."""
    before = (report.full_capacity_pages[0], report.swa_capacity_pages[0])
    if before != (pools.full_pages, pools.swa_pages):
        raise ValueError(
            f"rebalance report from {before} pages, pools hold {pools.full_pages, pools.swa_pages}"
        )
    entries = list(_tensors(pools))
    scales = {id(values): i for i, (values, _, _) in enumerate(pools._scales)}
    for moves in (report.full_moves, report.swa_moves):
        if len(moves):
            for holder, key, pool, per_page in entries:
                if pool is moves.pool:
                    for t in _with_scales(pools, scales, holder[key]):
                        src, dst = _rows(moves, per_page, t.device)
                        t[dst] = t[src]
    after = {Pool.FULL: report.full_capacity_pages[1], Pool.SWA: report.swa_capacity_pages[1]}
    current = {Pool.FULL: pools.full_pages, Pool.SWA: pools.swa_pages}
    changed = False
    for pool in sorted(after, key=lambda q: after[q] - current[q]):  # the shrinking one first
        if after[pool] == current[pool]:
            continue
        for holder, key, owner, per_page in entries:
            if owner is pool:
                _resize_entry(pools, scales, holder, key, after[pool] * per_page)
        changed = True
    pools.full_pages, pools.swa_pages = after[Pool.FULL], after[Pool.SWA]
    pools.generation += changed
    return changed


def _with_scales(
    pools: KVPools, scales: dict[int, int], values: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    i = scales.get(id(values))
    return (values,) if i is None else (values, pools._scales[i][1])


def _resize_entry(pools: KVPools, scales: dict[int, int], holder: Any, key: Any, rows: int) -> None:
    old = holder[key]
    new = _resized(old, rows)
    holder[key] = new
    i = scales.pop(id(old), None)
    if i is not None:
        _, old_scales, fmt = pools._scales[i]
        pools._scales[i] = (new, _resized(old_scales, rows, 1.0), fmt)
        scales[id(new)] = i
