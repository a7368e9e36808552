"""HiSparse page lives from the cache's KV events (issue #13): the executor releases what the
cache freed, so its coordinator never keeps a freed page's data; offloaded output still equals
all-resident output when the pools are small enough that page ids are reused."""

from __future__ import annotations

import functools
from collections import Counter

import numpy as np
import pytest
import torch
from small_models import SMALL as SMALL_MODEL

from adapters.engine.runner import Runner
from adapters.engine.sampling import SamplingParams
from adapters.model.model_config import preset
from adapters.model.weights import init_weights
from hisparse.lifetimes import ended_pages

MODEL = preset("tiny", **{**SMALL_MODEL, "index_topk": 4}, window=16, compress_ratios=(0, 4, 16, 4))
PAGE = 16


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def weights():
    return init_weights(MODEL, "cpu", torch.float64)


def runner(hisparse: int | None) -> Runner:
    cc = MODEL.cache_config(page_size=PAGE, full_capacity=PAGE * 16, swa_capacity=PAGE * 12,
                            debug=True)  # fmt: skip
    return Runner(MODEL, cc, device="cpu", dtype=torch.float64, weights=weights(),
                  chunk_tokens=24, max_running=2, hisparse_pages=hisparse)  # fmt: skip


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    shared = rng.integers(0, 256, 40).tolist()
    return [shared + rng.integers(0, 256, int(k)).tolist() for k in (30, 75, 9, 52, 61, 44, 70)]


def live_pages(r: Runner) -> set[int]:
    """Virtual pages in use: the tree's and every running request's."""
    pages = {int(v) for n in r.cache._tree.nodes() for v in n.vpages}
    return pages | {int(v) for q in r.cache.requests for v in q.vpages}


def test_freed_pages_are_released_and_reused_pages_start_fresh() -> None:
    """After every step the coordinator holds data only for pages in use, or freed during that
    step (released at the next step's start); a page the cache freed and reused is written
    fresh. The old guess (a page starts a new life when its entry 0 is written) kept a freed
    page's data until its id was reused *and* that entry rewritten: a finished request's tail
    page stayed in the device buffer and the mirror for good; this test failed on it."""
    off = runner(hisparse=9)
    watch = off.cache.subscribe_events()  # a second consumer: the executor's queue is its own
    ended: Counter[int] = Counter()
    host_pages = off.offload.lives.max_host_pages
    stale: list[tuple[int, list[int]]] = []

    def check(r: Runner, _done: list) -> None:
        step_ended = ended_pages(watch.take(), host_pages)
        ended.update(step_ended.tolist())
        r.offload.drain()
        held = np.flatnonzero(r.offload.coordinator.holds(np.arange(host_pages)))
        extra = set(held.tolist()) - live_pages(r) - set(step_ended.tolist())
        if extra:
            stale.append((r.stats.steps, sorted(extra)))

    params = SamplingParams(max_new_tokens=12)
    out = off.generate(prompts(), params, on_step=check)
    assert not stale, f"freed pages still held by the coordinator: {stale[:3]}"
    assert max(ended.values()) >= 2, "no page id was freed, reused and freed again"
    resident = runner(hisparse=None).generate(prompts(), params)
    assert [r.output for r in out] == [r.output for r in resident]
    assert all(r.finish_reason != "error" for r in out)
    assert off.offload.coordinator.stats().evictions > 0  # the device buffer was too small
    off.offload.begin_step()  # the last frees: nothing but the tree's pages stays held
    held = np.flatnonzero(off.offload.coordinator.holds(np.arange(host_pages)))
    assert set(held.tolist()) <= live_pages(off)
    off.offload.coordinator.check_invariants()
