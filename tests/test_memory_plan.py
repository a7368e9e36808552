"""Memory-aware prefill: the step model's arithmetic, the step sizes a runner with a fake budget
picks, and the typed refusal of a request whose one-token step cannot fit (nothing changes)."""

from __future__ import annotations

import pytest
import torch
from small_models import SHORT

from adapters.engine.runner import Runner
from adapters.engine.sampling import SamplingParams
from adapters.forward.memory_plan import (
    MemoryBudgetError,
    StepMemory,
    free_device_memory,
    step_memory,
    visible_entries,
)
from adapters.model.model_config import FLASH_SHAPED
from adapters.model.weights import init_weights


def test_step_memory_arithmetic() -> None:
    m = StepMemory(per_token=100, per_entry=8, logits_tile=1000)
    assert m.peak(3, 10) == 300 + 80 + 3 * 120  # a small step's logits are its own size
    assert m.peak(30, 10) == 3000 + 80 + 3 * 1000  # a large step's are one tile
    assert m.max_tokens(80 + 2 * 100 + 3 * 80 + 99, 10) == 2  # 2 tokens fit, a third does not
    assert m.max_tokens(90, 0) == 0  # not even one token
    assert m.max_tokens(10**9, 0, limit=64) == 64
    assert visible_entries(SHORT, 64) == 64 // 4 + 64 // 16


def test_flash_shaped_step_memory_is_per_token_not_per_context() -> None:
    """The transient memory of a step does not grow with the context beyond its int64 tables:
    a 1M-token request's 8K-token step fits in a few GiB."""
    m = step_memory(FLASH_SHAPED, torch.bfloat16)
    one_m = visible_entries(FLASH_SHAPED, 1 << 20)
    assert m.per_entry * one_m < 8 << 20
    assert m.peak(8192, one_m) < 12 << 30
    assert m.peak(8192, 2 * one_m) - m.peak(8192, one_m) == m.per_entry * one_m  # tile capped


def test_no_budget_on_cpu() -> None:
    assert free_device_memory(torch.device("cpu")) is None


def _runner(budget: int | None, chunk_tokens: int = 48) -> Runner:
    cc = SHORT.cache_config(page_size=4, full_capacity=1024, swa_capacity=512)
    weights = init_weights(SHORT, "cpu", torch.float32)
    return Runner(SHORT, cc, device="cpu", dtype=torch.float32, weights=weights,
                  chunk_tokens=chunk_tokens, graph_decode=False, memory_budget=budget)  # fmt: skip


def test_prefill_steps_are_sized_to_the_budget() -> None:
    """With room for about 10 tokens per step the runner prefills in steps of at most that
    many tokens (fewer as a longer context's tables take their share), and the output equals
    an unbudgeted run's."""
    free = _runner(None)
    m = free.memory.memory
    prompt = [(7 * i) % 250 for i in range(90)]
    entries = visible_entries(SHORT, 91)
    budget = m.peak(10, entries)
    capped = _runner(budget)
    sizes: list[int] = []
    forward = capped._forward

    def spy(seqs, chunks, *args, **kwargs):
        sizes.append(sum(len(c) for c in chunks))
        return forward(seqs, chunks, *args, **kwargs)

    capped._forward = spy  # type: ignore[method-assign]
    params = SamplingParams(max_new_tokens=1)
    got = capped.generate([prompt], params)[0].output
    assert got == free.generate([prompt], params)[0].output
    prefill = sizes[:-1] if len(sizes) > 1 else sizes
    assert max(prefill) == 10 and sum(sizes) >= len(prompt)
    assert all(s <= 10 for s in sizes)


def test_a_request_that_cannot_fit_is_refused_and_nothing_changes() -> None:
    r = _runner(1000)  # below one token's activations
    before = r.cache.stats()
    with pytest.raises(MemoryBudgetError, match="step memory"):
        r.submit([1, 2, 3], SamplingParams(max_new_tokens=2))
    assert r.num_pending == 0
    r.cache.check_invariants()
    assert r.cache.stats() == before and not r.cache.requests


def test_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="memory_budget"):
        _runner(0)


def test_prefill_budget_without_a_budget_limits_nothing() -> None:
    from adapters.forward.memory_plan import PrefillBudget, prefill_budget

    b = prefill_budget(SHORT, torch.float32, torch.device("cpu"), None)
    assert b.budget is None and b.step_tokens(10**9, 77) == 77
    b.check(10**9)  # no budget: nothing to refuse
    tight = PrefillBudget(SHORT, b.memory, b.memory.peak(3, visible_entries(SHORT, 100)))
    assert tight.step_tokens(visible_entries(SHORT, 100), 64) == 3
    with pytest.raises(MemoryBudgetError, match="4 token"):
        tight.check(100, step_tokens=4)
