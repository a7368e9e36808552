"""HiSparse in the runner (adapters/memory/offload.py): offloaded output equals all-resident
output."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from small_models import SMALL as SMALL_MODEL

from adapters.engine.runner import Runner
from adapters.engine.sampling import SamplingParams
from adapters.memory.offload import C4Offload
from adapters.model.model_config import preset
from adapters.model.reference import reference_generate
from adapters.model.weights import init_weights
from shadowradix.events import EventLog

SMALL = {**SMALL_MODEL, "index_topk": 4}  # these tests size their device buffers from top-4
MODEL = preset("tiny", **SMALL, window=16, compress_ratios=(0, 4, 16, 4))


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def weights():
    return init_weights(MODEL, "cpu", torch.float64)


def make_runner(page=16, hisparse=None, max_running=4, chunk=24):
    cc = MODEL.cache_config(page_size=page, full_capacity=640, swa_capacity=192, debug=True)
    return Runner(
        MODEL,
        cc,
        device="cpu",
        dtype=torch.float64,
        weights=weights(),
        chunk_tokens=chunk,
        max_running=max_running,
        hisparse_pages=hisparse,
    )


def prompts(seed=0, n=6):
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 256, 90).tolist()
    return [shared + rng.integers(0, 256, int(k)).tolist() for k in rng.integers(1, 70, n)]


@pytest.mark.parametrize("page,pages", [(4, 5), (8, 6), (16, 5), (16, 9)])
def test_offloaded_output_equals_all_resident_and_reference(page: int, pages: int) -> None:
    ps = prompts(page)
    params = SamplingParams(max_new_tokens=24)
    resident = make_runner(page).generate(ps[:1], params) + make_runner(page).generate(
        ps[1:], params
    )
    off = make_runner(page, hisparse=pages)
    offloaded = off.generate(ps[:1], params) + off.generate(ps[1:], params)
    assert [r.output for r in offloaded] == [r.output for r in resident]
    for p, r in zip(ps[:2], offloaded[:2]):  # the first request and one on a hit (the rest:
        assert r.output == reference_generate(weights(), p, len(r.output))  # = resident)
    st = off.offload.coordinator.stats()
    assert st.swap_ins > 0 and st.evictions > 0  # the buffer really was too small
    assert off.cache.stats().hit_tokens > 0  # and prefixes were reused through the mirror
    off.offload.drain()
    off.offload.coordinator.check_invariants()


def test_shared_prefix_shares_host_pages() -> None:
    """A request that reuses a cached prefix reads the pages its first owner wrote: only its
    own new pages are written (and backed up) again."""
    runner = make_runner(16, hisparse=8)
    rng = np.random.default_rng(3)
    shared = rng.integers(0, 256, 128).tolist()
    runner.generate([shared + [1, 2, 3]], SamplingParams(max_new_tokens=2))
    runner.offload.drain()
    backed = runner.offload.stats.backup_pages
    res = runner.generate([shared + [9, 9, 9, 9]], SamplingParams(max_new_tokens=2))
    runner.offload.drain()
    assert res[0].cached_tokens == 128
    # tokens 128..133: one new page per C4 layer (entries of groups 32..33 sit in page 8)
    new_backups = runner.offload.stats.backup_pages - backed
    assert 0 < new_backups <= 2 * 2  # 2 C4 layers x at most 2 pages
    host = runner.offload.host[1]
    assert torch.count_nonzero(host[: 128 // 16]) > 0  # the shared prefix's pages hold data


def test_exchange_round_trip_through_the_host_mirror() -> None:
    cc = MODEL.cache_config(page_size=16, full_capacity=16 * 8, swa_capacity=16 * 8)
    off = _hand_driven(cc)
    spp, d = off.spp, MODEL.head_dim
    values = torch.arange(4 * spp * d, dtype=torch.float64).view(4 * spp, d)
    slots = np.arange(4 * spp, dtype=np.int64)  # four whole pages, fresh
    off.begin_step()
    for k in range(4):  # one page per step: the buffer holds 3
        part = slots[k * spp : (k + 1) * spp]
        none = torch.zeros((1, 0), dtype=torch.long)
        off.exchange(1, part, values[part], none, torch.zeros((1, 0), dtype=torch.bool))
    off.drain()
    assert torch.equal(off.host[1][:4].reshape(-1, d), values)  # every page backed up
    read = torch.tensor([[0, spp + 1, 2 * spp + 2]])
    got = off.exchange(
        1, np.zeros(0, np.int64), values[:0], read, torch.ones_like(read, dtype=torch.bool)
    )
    assert torch.equal(got[0], values[[0, spp + 1, 2 * spp + 2]])  # page 0 swapped back in
    assert off.stats.swap_in_pages >= 1


def _hand_driven(cc, log: EventLog | None = None) -> C4Offload:
    """An executor without a cache: its events come from ``log`` (by hand)."""
    log = log or EventLog(cc.page_size, hashes=False, default_queue=False)
    return C4Offload(
        MODEL, cc, torch.device("cpu"), torch.float64, device_pages=3, events=log.subscribe()
    )


def test_bad_hisparse_configurations() -> None:
    with pytest.raises(ValueError, match="top-"):
        make_runner(16, hisparse=MODEL.index_topk)  # cannot hold one query's reads + a write
    cc2 = MODEL.cache_config(page_size=2, full_capacity=2 * 200, swa_capacity=2 * 60)
    with pytest.raises(ValueError, match="page size"):
        Runner(
            MODEL,
            cc2,
            device="cpu",
            weights=weights(),
            dtype=torch.float64,
            chunk_tokens=8,
            hisparse_pages=8,
        )


def test_inflight_backups_fill_the_mirror_when_completed() -> None:
    """The copy bookkeeping of the CUDA path, driven by hand on the CPU: a staged backup fills
    the mirror only when completed (poll / drain), and a page pinned by an in-flight copy is
    released only after draining it (begin_step after the cache freed the page)."""
    from adapters.memory.offload import _Inflight

    cc = MODEL.cache_config(page_size=16, full_capacity=16 * 8, swa_capacity=16 * 8)
    log = EventLog(cc.page_size, hashes=False, default_queue=False)
    off = _hand_driven(cc, log)
    layer, j = off.layers[0], 0
    plans = []
    for page in (0, 1):
        plan = off.coordinator.plan_step(j, np.zeros(0, np.int64), np.array([page]), [True])
        off.coordinator.complete(plan.swap_in.ticket)
        plans.append(plan)
    staged = [
        torch.full((1, off.spp, MODEL.head_dim), float(k + 1), dtype=torch.float64)
        for k in range(2)
    ]
    for k, plan in enumerate(plans):
        off._inflight.append(_Inflight(plan.backup.ticket, None, layer, np.array([k]), staged[k]))
    off.poll()  # events of None have "fired"
    assert off._inflight == [] and off.coordinator.pending_tickets == ()
    assert torch.equal(off.host[layer][:2], torch.cat(staged))
    plan = off.coordinator.plan_step(j, np.zeros(0, np.int64), np.array([0]), [False])
    off.coordinator.complete(plan.swap_in.ticket)
    off._inflight.append(_Inflight(plan.backup.ticket, None, layer, np.array([0]), staged[1]))
    log.freed([0], [])  # the cache freed page 0 while its backup is in flight
    off.begin_step()  # pinned: drained first, then released
    assert off._inflight == [] and not off.coordinator.resident(j, [0]).any()
    device_bytes, host_bytes = off.nbytes()
    assert device_bytes == 2 * 4 * off.spp * MODEL.head_dim * 8  # 2 C4 layers x (3 + sentinel)
    assert host_bytes == 2 * (cc.max_full_pages + 1) * off.spp * MODEL.head_dim * 8  # + sentinel


def test_a_step_counts_the_pages_its_new_entries_land_in() -> None:
    """A prefill chunk that completes a C4 entry writes a page its queries' top-k need not read:
    the step's HiSparse working set counts it. Found by the runner machine: with a buffer of
    exactly top-k + 1 pages, a 1-token chunk completing an entry in a 9th page was batched with
    another request's chunk, and the step needed 10 slots of 9 (`DeviceBufferFull`)."""
    from adapters.model.reference import reference_generate
    from adapters.model.weights import init_weights

    model = preset("tiny", **SMALL_MODEL, window=16, compress_ratios=(0, 4, 16, 4))
    weights = init_weights(model, "cpu", torch.float64)
    cc = model.cache_config(page_size=4, full_capacity=44, swa_capacity=28, debug=True)
    runner = Runner(model, cc, device="cpu", dtype=torch.float64, weights=weights,
                    chunk_tokens=3, max_running=3, graph_decode=False,
                    hisparse_pages=model.index_topk + 1)  # fmt: skip
    a, b, c = (np.random.default_rng(100 + n).integers(0, 256, n).tolist() for n in (9, 18, 30))
    prompts = [a, b + [0, 0], c + [0] * 6, a]
    done = runner.generate(prompts, SamplingParams(max_new_tokens=1))
    for prompt, res in zip(prompts, done):
        assert res.finish_reason == "length", res.error
        assert res.output == reference_generate(weights, prompt, 1)
