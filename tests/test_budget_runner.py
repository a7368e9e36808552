"""Issue #14 item 5, the engine: a runner whose pools come from a byte budget moves memory
between its SWA and full pools when one starves, with the outputs of a run with ample pools."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from small_models import SHORT

from adapters.cli.run_command import summary
from adapters.engine.budget_runner import budget_runner
from adapters.engine.runner import Runner
from adapters.engine.sampling import SamplingParams
from adapters.memory.pool_balance import PoolBalance
from adapters.memory.pool_budget import PoolCosts
from adapters.model.weights import init_weights
from shadowradix import CacheStats, EvictionReport, PoolStats

BUDGET = 490_000  # SHORT at page 4: ~40 full pages and ~24 SWA pages at ratio 0.6


def _waves() -> list[list[list[int]]]:
    """Short prompts sharing a prefix, then long ones: two of those overflow the full pool."""
    rng = np.random.default_rng(7)
    stem = rng.integers(0, 256, 12).tolist()
    short = [stem + rng.integers(0, 256, 6).tolist() for _ in range(6)]
    long = [rng.integers(0, 256, 120).tolist() for _ in range(3)]
    return [short, long]


def _outputs(runner: Runner) -> list[list[int]]:
    out = []
    for wave in _waves():
        out += [r.output for r in runner.generate(wave, SamplingParams(max_new_tokens=8))]
    return out


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_budget_runner_rebalances_with_the_outputs_of_ample_pools(device: str) -> None:
    """On CUDA the decode runs through captured graphs, dropped at every resize."""
    torch.set_num_threads(1)
    weights = init_weights(SHORT, device, torch.float64)
    kw = dict(device=device, weights=weights, chunk_tokens=32, max_running=4)
    runner = budget_runner(SHORT, BUDGET, 0.6, page_size=4, dtype=torch.float64, **kw)
    assert runner.pool_balance is not None
    assert runner.pools.nbytes().total <= BUDGET
    got = _outputs(runner)
    assert runner.stats.rebalances >= 1 and runner.stats.rebalance_moved_pages >= 0
    st = runner.cache.stats()
    assert st.full.capacity_pages > runner.cache.config.num_full_pages  # long requests won
    assert runner.pools.nbytes().total <= BUDGET  # every split stayed within the budget
    assert runner.pools.swa[0].shape[0] == st.swa.capacity_pages * 4 + 1
    runner.cache.check_invariants()
    line = f"pool re-balances {runner.stats.rebalances} ("
    assert line in summary(runner, [], 1.0)  # the run summary says the pools moved
    ample = Runner(
        SHORT,
        SHORT.cache_config(page_size=4, full_capacity=4096, swa_capacity=1024),
        dtype=torch.float64,
        **kw,  # type: ignore[arg-type]
    )
    assert got == _outputs(ample)
    static = budget_runner(
        SHORT, BUDGET, 0.6, page_size=4, dtype=torch.float64, rebalance=False, **kw
    )
    assert _outputs(static) == got and static.stats.rebalances == 0


def _stats(full: tuple[int, int, int], swa: tuple[int, int, int]) -> CacheStats:
    """Capacity, free and held pages of each pool (nothing evictable or protected)."""

    def pool(cap: int, free: int, held: int) -> PoolStats:
        return PoolStats(cap, free, 0, 0, held)

    none = EvictionReport()
    return CacheStats(4, pool(*full), pool(*swa), 0, 0, 0, 0, 0, 0, 0, none, 4)


def test_plan_trades_bytes_and_refuses_a_quick_reversal() -> None:
    costs = PoolCosts(fixed=100, per_full_page=10, per_swa_page=40, page_size=4)
    balance = PoolBalance(costs, budget=100 + 40 * 10 + 20 * 40, min_full_pages=4,
                          min_swa_pages=6, margin=0.25, cooldown=5)  # fmt: skip
    stats = _stats((40, 0, 40), (20, 12, 8))
    full, swa = balance.plan(stats, "full", 3, step=1)  # type: ignore[misc]
    assert (full // 4, swa // 4) == (40 + 12, 20 - 3)  # 25 % of 40 full pages, 3 SWA pages
    assert costs.nbytes(full // 4, swa // 4) <= balance.budget
    balance.applied(1, "full")
    swa_short = _stats((40, 20, 20), (20, 0, 20))
    assert balance.plan(swa_short, "swa", 1, step=3) is None  # the reverse move is too recent
    assert balance.plan(swa_short, "swa", 1, step=3, force=True) is not None
    full, swa = balance.plan(swa_short, "swa", 1, step=6)  # type: ignore[misc]
    assert (full // 4, swa // 4) == (40 - 20, 20 + 5)  # 25 % of 20 SWA pages: all 20 spare
    assert balance.plan(_stats((40, 0, 40), (20, 0, 20)), "full", 1, step=9) is None  # no spare
    with pytest.raises(TypeError):
        balance.plan(stats, "full", 1)  # type: ignore[call-arg]
