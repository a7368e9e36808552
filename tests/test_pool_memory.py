"""Pools that cannot fit are refused before anything is allocated: `pools.pool_bytes` predicts
what `KVPools` allocates, and `Runner` checks it against the device's free memory first."""

from __future__ import annotations

import pytest
import torch

from adapters.engine.runner import Runner
from adapters.memory import device as device_mod
from adapters.memory.device import PoolMemoryError, check_pools_fit, free_bytes
from adapters.memory.formats import CacheFormat
from adapters.memory.pools import KVPools, pool_bytes
from adapters.model.model_config import preset


@pytest.mark.parametrize("fmt", [CacheFormat.BF16, CacheFormat.FP8])
@pytest.mark.parametrize("name", ["tiny", "tiny-shared"])
def test_pool_bytes_predicts_what_the_pools_allocate(name: str, fmt: CacheFormat) -> None:
    model = preset(name)
    cc = model.cache_config(page_size=16, full_capacity=4096, swa_capacity=1024)
    pools = KVPools(model, cc, "cpu", torch.float32, index_format=fmt, swa_format=fmt)
    actual = pools.nbytes().total
    predicted = pool_bytes(model, cc, torch.float32, fmt, fmt)
    assert predicted <= actual <= predicted * 1.02  # sentinel rows only


def test_check_pools_fit_names_both_sizes() -> None:
    check_pools_fit(100, torch.device("cpu"), free=100)
    with pytest.raises(PoolMemoryError, match="need 0.00 GiB but cpu has 0.00 GiB free"):
        check_pools_fit(101, torch.device("cpu"), free=100)
    assert free_bytes(torch.device("cpu")) > 0


def test_runner_refuses_pools_beyond_free_memory_before_allocating(monkeypatch) -> None:
    model = preset("tiny")
    cc = model.cache_config(page_size=16, full_capacity=4096, swa_capacity=1024)
    need = pool_bytes(model, cc, torch.float32)
    monkeypatch.setattr(device_mod, "free_bytes", lambda dev: need - 1)
    made = []
    monkeypatch.setattr("adapters.engine.runner.KVPools", lambda *a, **k: made.append(a))
    with pytest.raises(PoolMemoryError, match="lower the full / SWA pool sizes"):
        Runner(model, cc, device="cpu")
    assert not made  # nothing was allocated
    monkeypatch.undo()
    assert Runner(model, cc, device="cpu").pools.nbytes().total >= need
