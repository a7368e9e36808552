"""A runner whose pools are the budget: built from a byte budget, re-balanced at run time.

`budget_runner` sizes the pools with `pool_budget.budget_cache_config` (their bytes at most the
budget) and turns on `enable_rebalance`: when one pool starves while the other has room, the
runner moves memory between them (`pool_balance.PoolBalance`, `Admission._rebalance`) before
it preempts anything.
"""

from __future__ import annotations

from typing import Any

import torch

from adapters.engine.modes import MODE_ARGUMENTS, Mode, Modes, check_modes
from adapters.engine.runner import Runner
from adapters.memory.device import resolve_device
from adapters.memory.pool_balance import PoolBalance
from adapters.memory.pool_budget import budget_cache_config, pool_costs
from adapters.model.model_config import ModelConfig


def budget_runner(
    model: ModelConfig,
    budget: int,
    swa_full_tokens_ratio: float,
    *,
    page_size: int = 64,
    dtype: torch.dtype | None = None,
    rebalance: bool = True,
    cache_kwargs: dict[str, object] | None = None,
    **runner_kwargs: object,
) -> Runner:
    """A `Runner` of ``model`` whose pools hold at most ``budget`` bytes, split
    ``swa_full_tokens_ratio`` SWA tokens per full token to start with, re-balanced at run time
    unless ``rebalance=False``. ``cache_kwargs`` go to the `CacheConfig`, ``runner_kwargs`` to
    the `Runner` (its pool options: ``tail_only``, ``index_format``, ``swa_format``, a
    speculative MTP draft, are counted in the budget). Raises `UnsupportedModeError` for
    modes that cannot run together (re-balance included) before anything is sized."""
    device = resolve_device(runner_kwargs.pop("device", None))  # type: ignore[arg-type]
    replay = bool((cache_kwargs or {}).get("bounded_replay", False))
    mode_kwargs: dict[str, Any] = {k: v for k, v in runner_kwargs.items() if k in MODE_ARGUMENTS}
    check_modes(Modes.of(device, model, bounded_replay=replay, rebalance=rebalance, **mode_kwargs))
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pool_kwargs: dict[str, object] = {
        "track_late_swa": bool(runner_kwargs.get("tail_only", False)),
        "mtp": runner_kwargs.get("speculative_tokens") is not None
        and model.mtp
        and runner_kwargs.get("draft") is None,
    }
    for name in ("index_format", "swa_format"):
        if name in runner_kwargs:
            pool_kwargs[name] = runner_kwargs[name]
    cfg = budget_cache_config(
        model, budget, swa_full_tokens_ratio, dtype, page_size=page_size,
        pool_kwargs=pool_kwargs, **(cache_kwargs or {}),
    )  # fmt: skip
    runner = Runner(model, cfg, device=device, dtype=dtype, **runner_kwargs)  # type: ignore[arg-type]
    if rebalance:
        enable_rebalance(runner, budget)
    return runner


def enable_rebalance(runner: Runner, budget: int, **kwargs: object) -> PoolBalance:
    """Turn on run-time re-balancing for ``runner``, whose pools were sized from ``budget``
    bytes (`pool_budget.budget_cache_config` with the runner's pool options); ``kwargs`` go to
    `PoolBalance`. Raises `UnsupportedModeError` for a runner whose modes cannot be
    re-balanced (HiSparse: its mirror is keyed by page), `ValueError` if the pools already
    exceed the budget."""
    check_modes(runner.modes.with_mode(Mode.REBALANCE))
    pools, cfg = runner.pools, runner.cache.config
    costs = pool_costs(
        runner.model,
        cfg,
        pools.dtype,
        track_late_swa=pools.late_swa_valid is not None,
        mtp=pools.page_hidden is not None,
        index_format=pools.index_format,
        swa_format=pools.swa_format,
    )
    if costs.nbytes(pools.full_pages, pools.swa_pages) > budget:
        raise ValueError(f"the runner's pools exceed the budget of {budget} bytes")
    p = cfg.page_size
    chunk = runner.chunk_tokens + cfg.window + 2 * p + runner.spec_tokens
    balance = PoolBalance(
        costs,
        budget,
        min_full_pages=cfg.window_pages + 1,
        min_swa_pages=max(-(-chunk // p), cfg.window_pages + 1),
        **kwargs,  # type: ignore[arg-type]
    )
    runner.pool_balance = balance
    return balance
