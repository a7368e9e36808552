"""In-batch prefix sharing (#14): requests that arrive together with a long common prefix are
prefilled once. The first is admitted; the others wait while it computes their shared part
(`Admission._waits_for_a_prefill`), then hit it in the cache (the runner publishes every
chunk). The same shape as the H200 case (four prompts, one long shared prefix, arriving in
one step) on the small model: the prompt hit ratio reaches its ceiling of 3/4 of the shared
tokens, outputs are those of the runner without sharing, and nothing deadlocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from small_models import CFG

from adapters.engine.runner import Runner
from adapters.engine.sampling import SamplingParams

PREFIX, TAIL, PAGE = 1024, 4, 16


def _prompts(distinct_prefixes: bool = False) -> list[list[int]]:
    rng = np.random.default_rng(3)
    shared = rng.integers(1, 256, PREFIX).tolist()
    out = []
    for _ in range(4):
        head = rng.integers(1, 256, PREFIX).tolist() if distinct_prefixes else shared
        out.append(head + rng.integers(1, 256, TAIL).tolist())
    return out


def _run(prompts, share: bool):
    cc = CFG.cache_config(page_size=PAGE, full_capacity=PAGE * 600, swa_capacity=PAGE * 200)
    runner = Runner(CFG, cc, device="cpu", dtype=torch.float32, chunk_tokens=256)
    runner.share_prefills = share
    results = runner.generate(prompts, SamplingParams(max_new_tokens=3))
    runner.cache.check_invariants()
    return runner, results


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_requests_arriving_together_prefill_their_shared_prefix_once() -> None:
    prompts = _prompts()
    shared, shared_results = _run(prompts, share=True)
    plain, plain_results = _run(prompts, share=False)
    ceiling = 3 * PREFIX / (4 * (PREFIX + TAIL))
    stats = shared.cache.stats()
    assert stats.hit_ratio >= 0.99 * ceiling, stats.hit_ratio
    assert plain.cache.stats().hit_ratio < 0.5 * ceiling  # side by side they recompute it
    assert shared.stats.prefill_tokens < plain.stats.prefill_tokens / 2
    assert shared.stats.shared_prefill_waits > 0 and plain.stats.shared_prefill_waits == 0
    assert [r.output for r in shared_results] == [r.output for r in plain_results]
    assert [r.cached_tokens for r in shared_results][1:] == [PREFIX] * 3


def test_unrelated_prompts_never_wait() -> None:
    runner, results = _run(_prompts(distinct_prefixes=True), share=True)
    assert runner.stats.shared_prefill_waits == 0
    assert all(len(r.output) == 3 for r in results)
