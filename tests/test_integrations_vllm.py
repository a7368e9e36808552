"""The vLLM-shaped shim, driven the way vLLM's v1 scheduler drives its KV-cache manager.

`VllmLoop` schedules running requests first (``allocate_slots`` per step: a prefill chunk or
one decode token; on ``None`` it preempts the lowest-priority running request, possibly one
already scheduled this step, frees it and retries), then, if nothing was preempted, admits
waiting requests (``get_computed_blocks`` → ``allocate_slots`` with the hit; ``None`` stops
admission). ``num_computed_tokens`` advances after scheduling, as in ``_update_after_schedule``;
finished requests are freed. Random workloads over tiny pools check, after every step:

* each allocation (and a replayed window first) and each scheduled request's reads against the
  fingerprint oracle, so a preempted request's never-computed tokens must not be cached;
* the engine's block tables, kept only from the hit's blocks and each step's ``deltas``, equal
  ``get_block_ids``, and the allocation's slots lie in those blocks;
* the event stream replayed into per-group sets of stored hashes matches what the cache holds
  (full pages, live-window pages), every stored block's parent is stored;
* ``make_prefix_cache_stats`` adds up to the core's admissions and hit tokens.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np
import pytest
from hypothesis import event, given, note, settings
from hypothesis import strategies as st

from shadowradix import CacheConfig, InvalidRequestError
from shadowradix.events import namespace_seed, page_hashes
from shadowradix.integrations.vllm import ShadowRadixKVCacheManager
from shadowradix.integrations.vllm_types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheBlocks,
    Request,
)
from shadowradix.results import Allocation
from shadowradix.testing import FingerprintOracle, cache_configs, snapshot

ALPHABET = 3
NAMESPACES = (None, (None, "salt"))  # Request.namespace without and with the cache salt
Scheduled = dict[str, tuple[Request, int, KVCacheBlocks]]


class VllmLoop:
    def __init__(self, mgr: ShadowRadixKVCacheManager, budget: int, max_running: int,
                 max_new: dict[str, int], priority: dict[str, int]) -> None:  # fmt: skip
        self.mgr, self.budget, self.max_running = mgr, budget, max_running
        self.max_new, self.priority = max_new, priority
        self.oracle = FingerprintOracle(mgr.cache.config)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.tables: dict[str, list[list[int | None]]] = {}
        self.stored: tuple[dict[int, int | None], dict[int, int | None]] = ({}, {})
        self.preemptions = self.preempted_scheduled = self.admissions = self.hits = 0
        self.stats_hits = self.stats_requests = 0

    def _rank(self, req: Request) -> tuple[int, str]:
        return self.priority[req.request_id], req.request_id

    # -- the scheduler -------------------------------------------------------------------

    def step(self) -> None:
        scheduled: Scheduled = {}
        budget, preempted = self.budget, False
        for req in list(self.running):  # in admission order; the victim goes by priority
            if budget <= 0 or req not in self.running:
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            new = self.mgr.allocate_slots(req, n)
            while new is None:
                victim = max(self.running, key=self._rank)
                budget += self._preempt(victim, scheduled)
                preempted = True
                if victim is req:
                    break
                new = self.mgr.allocate_slots(req, n)
            if new is not None:
                scheduled[req.request_id] = (req, n, new)
                budget -= n
        while (
            self.waiting and budget > 0 and not preempted and len(self.running) < self.max_running
        ):
            req = self.waiting[0]
            blocks, k, _ = self.mgr.get_computed_blocks(req)
            n = min(req.num_tokens - k, budget)
            new = self.mgr.allocate_slots(req, n, k, blocks)
            if new is None:
                break
            self.waiting.popleft()
            self.running.append(req)
            req.num_computed_tokens = k
            self.tables[req.request_id] = [list(group) for group in blocks.blocks]
            self.admissions += 1
            self.hits += k
            scheduled[req.request_id] = (req, n, new)
            budget -= n
        for req, _, new in scheduled.values():
            self._execute(req, new)
        for req, n, _ in scheduled.values():
            req.num_computed_tokens += n  # _update_after_schedule
        for req, _, _ in scheduled.values():
            self._update_from_output(req)
        self._check_events()
        stats = self.mgr.make_prefix_cache_stats()
        assert stats is not None
        self.stats_requests += stats.requests + stats.preempted_requests
        self.stats_hits += stats.hits + stats.preempted_hits

    def _preempt(self, victim: Request, scheduled: Scheduled) -> int:
        """Free ``victim``; returns the budget its unscheduling gives back."""
        back = 0
        if victim.request_id in scheduled:  # allocated this step, never computed
            back = scheduled.pop(victim.request_id)[1]
            self.preempted_scheduled += 1
        self.mgr.free(victim)
        self.running.remove(victim)
        del self.tables[victim.request_id]
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        self.preemptions += 1
        note(f"preempt {victim.request_id}")
        return back

    def _update_from_output(self, req: Request) -> None:
        if req.num_computed_tokens < req.num_tokens:
            return  # a prefill chunk: no token sampled
        req.output_token_ids.append((req.num_tokens * 5 + len(req.request_id)) % ALPHABET)
        if len(req.output_token_ids) >= self.max_new[req.request_id]:
            self.mgr.free(req)
            self.running.remove(req)
            del self.tables[req.request_id]
            self.finished.append(req)

    # -- the engine's side ---------------------------------------------------------------

    def _execute(self, req: Request, new: KVCacheBlocks) -> None:
        rid, kv = req.request_id, self.mgr.kv_request(req.request_id)
        table = self.tables[rid]
        for g, delta in enumerate(new.deltas):
            del table[g][delta.first_page :]
            table[g].extend(delta.block_ids)
        assert tuple(table) == self.mgr.get_block_ids(rid), f"{rid}: the block tables drifted"
        for g, ids in enumerate(new.blocks):
            assert list(ids) == table[g][len(table[g]) - len(ids) :], "new blocks are appended"
        assert new.allocation is not None
        for allocation in (new.replay, new.allocation):
            if allocation is not None:
                self._write(allocation, kv.id, kv.tokens, kv.approximate)
        self._check_slots(new.allocation, table)
        plan = self.mgr.cache.read_plan(kv, start=int(new.allocation.starts[0]))
        self.oracle.check_reads(plan, kv.tokens, kv.id, kv.approximate)
        assert kv.tokens == req.all_token_ids[: kv.length], "the cache computed other tokens"

    def _write(self, allocation: Allocation, kid: int, tokens: list[int], approx: bool) -> None:
        self.oracle.write(allocation, {kid: tokens}, {kid} if approx else set())

    def _check_slots(self, allocation: Allocation, table: list[list[int | None]]) -> None:
        p = self.mgr.cache.config.page_size
        pages = allocation.positions // p
        assert (allocation.virtual_slots // p).tolist() == [table[0][i] for i in pages]
        assert (allocation.swa_slots // p).tolist() == [table[1][i] for i in pages]

    def _check_events(self) -> None:
        for e in self.mgr.take_events():
            if isinstance(e, AllBlocksCleared):
                for group in self.stored:
                    group.clear()
            elif isinstance(e, BlockStored):
                group, parent = self.stored[e.group_idx], e.parent_block_hash
                assert len(e.token_ids) == len(e.block_hashes) * e.block_size
                tokens = np.asarray(e.token_ids, dtype=np.int64)
                seeds = [parent] if parent is not None else [namespace_seed(n) for n in NAMESPACES]
                chained = [page_hashes(seed, tokens, e.block_size) for seed in seeds]
                assert list(e.block_hashes) in chained, "the hashes do not chain from the parent"
                for h in e.block_hashes:
                    assert h not in group, "a block stored twice"
                    if e.group_idx == 0:
                        assert parent is None or parent in group, "its parent is not stored"
                    group[h] = parent
                    parent = h
            else:
                assert isinstance(e, BlockRemoved)
                for h in e.block_hashes:
                    del self.stored[e.group_idx][h]
        stats, p = self.mgr.cache.stats(), self.mgr.cache.config.page_size
        assert len(self.stored[0]) * p == stats.cached_tokens
        assert len(self.stored[1]) * p == stats.cached_window_tokens


@st.composite
def workloads(draw: st.DrawFn) -> tuple[CacheConfig, list[Request], dict, dict, int, int]:
    config = draw(cache_configs(speculative=False))
    p, w = config.page_size, config.window
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    stems = [rng.integers(0, ALPHABET, 2 * p + w).tolist() for _ in range(2)]
    reqs: list[Request] = []
    max_new, priority = {}, {}
    for i in range(draw(st.integers(2, 6))):
        stem = stems[draw(st.integers(0, 1))]
        prompt = stem[: draw(st.integers(0, len(stem)))]
        prompt += draw(st.lists(st.integers(0, ALPHABET - 1), max_size=5))
        if reqs and draw(st.booleans()):
            prompt = list(reqs[-1].prompt_token_ids)
        salt = draw(st.sampled_from((None, None, "salt")))
        reqs.append(Request(f"r{i}", prompt or [1], cache_salt=salt))
        max_new[f"r{i}"] = draw(st.integers(1, min(24, 2 * p + 2)))
        priority[f"r{i}"] = draw(st.integers(0, 3))
    longest = max(r.num_tokens + max_new[r.request_id] for r in reqs)
    pages = -(-longest // p) + 1 + draw(st.integers(0, 2))  # tight: requests compete
    config = dataclasses.replace(config, full_capacity=pages * p, max_full_capacity=pages * p,
                                 debug=True)  # fmt: skip
    chunk_pages = config.num_swa_pages - (-(-w // p) + 1)
    budget = draw(st.integers(1, max(1, (chunk_pages - 1) * p + 1)))
    return config, reqs, max_new, priority, budget, draw(st.integers(2, 4))


@given(workloads())
@settings(settings.default, max_examples=max(10, settings.default.max_examples // 5))
def test_scheduler_loop(workload: tuple[CacheConfig, list[Request], dict, dict, int, int]) -> None:
    config, reqs, max_new, priority, budget, max_running = workload
    mgr = ShadowRadixKVCacheManager(config, log_stats=True, enable_kv_cache_events=True)
    loop = VllmLoop(mgr, budget, max_running, max_new, priority)
    loop.waiting.extend(sorted(reqs, key=loop._rank))
    for _ in range(20 * sum(r.num_tokens + 8 for r in reqs)):
        if not (loop.waiting or loop.running):
            break
        loop.step()
    assert len(loop.finished) == len(reqs), "the loop stalled"
    for name, count in (("preemption", loop.preemptions), ("prefix hit", loop.hits),
                        ("preempted after scheduling", loop.preempted_scheduled)):  # fmt: skip
        event(f"{name}: {'yes' if count else 'no'}")
    stats = mgr.cache.stats()
    assert stats.num_requests == 0 and stats.full.held_pages == stats.swa.held_pages == 0
    assert loop.stats_requests == loop.admissions == stats.admissions
    assert loop.stats_hits == stats.hit_tokens <= loop.hits
    assert mgr.reset_prefix_cache() and mgr.take_events() == [AllBlocksCleared()]
    stats_after = mgr.make_prefix_cache_stats()
    assert stats_after is not None and stats_after.reset


def _manager(**kwargs: bool) -> ShadowRadixKVCacheManager:
    config = CacheConfig(page_size=4, window=8, compress_ratios=(0, 4, 8), overlap_ratios=(4,),
                         full_capacity=4 * 16, swa_capacity=4 * 8, debug=True)  # fmt: skip
    return ShadowRadixKVCacheManager(config, **kwargs)


def _serve(mgr: ShadowRadixKVCacheManager, req: Request) -> None:
    blocks, k, _ = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, req.num_tokens - k, k, blocks) is not None
    req.num_computed_tokens = req.num_tokens
    req.output_token_ids.append(0)
    mgr.free(req)


def test_groups_hits_and_reset() -> None:
    mgr = _manager(log_stats=True)
    assert [g.name for g in mgr.kv_cache_groups] == ["full", "swa"]
    assert mgr.kv_cache_groups[1].sliding_window == 8 and mgr.num_kv_cache_groups == 2
    prompt = list(range(1, 22))
    _serve(mgr, Request("a", prompt))
    blocks, k, _ = mgr.get_computed_blocks(Request("b", prompt))
    assert k == 20 and len(blocks.blocks[0]) == 5
    assert blocks.blocks[1][:3] == (None, None, None) and None not in blocks.blocks[1][3:]
    assert mgr.get_computed_blocks(Request("c", prompt, cache_salt="x"))[1] == 0
    assert 0 < mgr.usage < 1
    running = Request("d", prompt)
    assert mgr.allocate_slots(running, 4) is not None
    assert not mgr.reset_prefix_cache(), "refused while a request holds slots"
    mgr.free(running)
    assert mgr.reset_prefix_cache() and mgr.get_computed_blocks(Request("e", prompt))[1] == 0
    stats = mgr.make_prefix_cache_stats()
    assert stats is not None and stats.reset and (stats.requests, stats.hits) == (2, 0)
    assert _manager().make_prefix_cache_stats() is None


def test_allocate_slots_returns_none_and_changes_nothing() -> None:
    mgr = _manager()
    big = Request("big", list(range(1, 60)))
    assert mgr.allocate_slots(big, 59) is None, "more than the SWA pool: refused, not raised"
    hog = Request("hog", [7] * 30)
    assert mgr.allocate_slots(hog, 30) is not None
    hog.num_computed_tokens = 30
    before = snapshot(mgr.cache)
    assert mgr.allocate_slots(Request("late", list(range(100, 140))), 40) is None
    assert snapshot(mgr.cache) == before


def test_bad_input_is_typed_and_changes_nothing() -> None:
    mgr = _manager()
    r = Request("a", list(range(1, 22)))
    blocks, k, _ = mgr.get_computed_blocks(r)
    mgr.allocate_slots(r, 8, k, blocks)
    r.num_computed_tokens = 8
    before = snapshot(mgr.cache)
    calls = [
        lambda: mgr.allocate_slots(r, 0),
        lambda: mgr.allocate_slots(r, 100),
        lambda: mgr.allocate_slots(r, 1, num_lookahead_tokens=2),
        lambda: mgr.allocate_slots(dataclasses.replace(r, num_computed_tokens=3), 1),
        lambda: mgr.allocate_slots(Request("b", [1, 2, 3]), 2, 5, blocks),
        lambda: mgr.allocate_slots(Request("c", [1, 2, 3]), 2, 0, KVCacheBlocks(((), ()))),
        lambda: mgr.get_computed_blocks("a"),  # type: ignore[arg-type]
        lambda: mgr.get_block_ids("nobody"),
        lambda: mgr.free("a"),  # type: ignore[arg-type]
    ]
    for call in calls:
        with pytest.raises(InvalidRequestError):
            call()
        assert snapshot(mgr.cache) == before
    mgr.free(Request("nobody", [1]))  # unknown: a no-op, as in vLLM


def test_preempted_before_its_step_ran_caches_only_what_was_computed() -> None:
    """vLLM can preempt a request it scheduled this step (its allocation never ran): ``free``
    must not insert those tokens, only what earlier steps computed."""
    mgr = _manager()
    prompt = list(range(1, 13))
    a = Request("a", prompt)
    assert mgr.allocate_slots(a, 8) is not None
    a.num_computed_tokens = 8  # its first chunk ran
    assert mgr.allocate_slots(a, 4) is not None  # scheduled, then preempted before running
    mgr.free(a)
    assert mgr.cache.match_prefix(prompt).cached_len == 8
    b = Request("b", prompt)
    assert mgr.allocate_slots(b, 12) is not None
    b.num_computed_tokens = 12  # ran
    mgr.free(b)
    assert mgr.cache.match_prefix(prompt).cached_len == 12


def test_admission_counts_the_hit_as_locked() -> None:
    """Free + evictable pages would hold the new tokens, but admitting locks the hit, whose
    pages are part of that evictable count: ``None``, changing nothing, not a later failure."""
    config = CacheConfig(page_size=4, window=8, compress_ratios=(0, 4), overlap_ratios=(4,),
                         full_capacity=4 * 16, swa_capacity=4 * 16, debug=True)  # fmt: skip
    mgr = ShadowRadixKVCacheManager(config)
    prefix = list(range(1, 41))
    _serve(mgr, Request("a", prefix))  # 10 pages cached, 6 free
    b = Request("b", prefix + list(range(100, 128)))  # 7 more pages
    blocks, k, _ = mgr.get_computed_blocks(b)
    assert k == 40
    stats = mgr.cache.stats().full
    assert stats.free_pages + stats.evictable_pages >= 7 > stats.free_pages
    before = snapshot(mgr.cache)
    assert mgr.allocate_slots(b, 28, k, blocks) is None
    assert snapshot(mgr.cache) == before
    assert mgr.allocate_slots(b, 24, k, blocks) is not None  # 6 pages fit


def test_running_requests_publish_what_their_earlier_steps_computed() -> None:
    """vLLM caches blocks as they are scheduled; here a running request's computed pages join
    the tree at its next ``allocate_slots``, so a request arriving meanwhile hits them."""
    mgr = _manager(enable_kv_cache_events=True)
    prompt = list(range(1, 14))
    a = Request("a", prompt)
    assert mgr.allocate_slots(a, 13) is not None
    a.num_computed_tokens = 13
    a.output_token_ids.append(5)
    assert mgr.get_computed_blocks(Request("b", prompt))[1] == 0  # not computed when scheduled
    assert mgr.allocate_slots(a, 1) is not None  # the next step: the prompt's pages go in
    assert mgr.get_computed_blocks(Request("b", prompt))[1] == 12
    stored = [e for e in mgr.take_events() if isinstance(e, BlockStored)]
    assert [(e.group_idx, len(e.block_hashes), e.parent_block_hash) for e in stored] == [
        (0, 3, None),
        (1, 3, None),
    ]
    assert stored[0].token_ids == tuple(prompt[:12])


def test_computed_blocks_of_another_namespace_are_refused() -> None:
    """A hit looked up without the request's cache salt / LoRA must not admit it: the prefix
    would leak across tenants (namespaces never share a node)."""
    mgr = _manager()
    prompt = list(range(1, 22))
    _serve(mgr, Request("a", prompt))
    blocks, k, _ = mgr.get_computed_blocks(Request("probe", prompt))
    assert k == 20
    before = snapshot(mgr.cache)
    for salted in (Request("s", prompt, cache_salt="secret"), Request("l", prompt, lora_int_id=2)):
        with pytest.raises(InvalidRequestError, match="namespace"):
            mgr.allocate_slots(salted, salted.num_tokens - k, k, blocks)
        assert snapshot(mgr.cache) == before


def test_a_bad_token_of_a_running_request_changes_nothing() -> None:
    """The chunk is checked before the request's earlier steps are published."""
    mgr = _manager()
    r = Request("a", list(range(1, 13)))
    blocks, k, _ = mgr.get_computed_blocks(r)
    assert mgr.allocate_slots(r, 8, k, blocks) is not None
    r.num_computed_tokens = 8
    r.prompt_token_ids[9] = -5
    before = snapshot(mgr.cache)
    with pytest.raises(InvalidRequestError):
        mgr.allocate_slots(r, 4)
    assert snapshot(mgr.cache) == before


def test_vllm_033_signatures() -> None:
    """``get_computed_blocks`` returns vLLM 0.33's three values and honours
    ``max_cache_hit_length``; ``allocate_slots`` takes the scheduler's keyword arguments."""
    mgr = _manager()
    prompt = list(range(1, 22))
    _serve(mgr, Request("a", prompt))
    blocks, k, boundary = mgr.get_computed_blocks(Request("b", prompt))
    assert (k, boundary) == (20, 0)
    assert mgr.get_computed_blocks(Request("b", prompt), max_cache_hit_length=9)[1] == 8
    assert mgr.get_computed_blocks(Request("b", prompt), max_cache_hit_length=0)[1] == 0
    with pytest.raises(InvalidRequestError):
        mgr.get_computed_blocks(Request("b", prompt), max_cache_hit_length=-1)
    b = Request("b", prompt)
    new = mgr.allocate_slots(b, 1, k, blocks, full_sequence_must_fit=True, has_scheduled_reqs=False,
                             skip_zeroing_group_ids=(1,))  # fmt: skip
    assert new is not None
    with pytest.raises(InvalidRequestError, match="reserved_blocks"):
        mgr.allocate_slots(Request("c", prompt), 4, reserved_blocks=2)


def test_full_sequence_must_fit_refuses_a_first_chunk_that_alone_would_fit() -> None:
    """The gate counts the full pages of every token left and, as vLLM caps sliding-window
    groups, the SWA pages of one window and chunk: a prompt longer than the SWA pool is
    admitted (it runs in chunks), one longer than the full pool is not."""
    mgr = _manager()  # 16 full pages, 8 SWA pages of 4 tokens
    swa_long = Request("swa-long", list(range(1, 60)))  # 15 full pages; SWA: window + chunk
    assert mgr.allocate_slots(swa_long, 8, full_sequence_must_fit=True) is not None
    mgr.free(swa_long)
    too_long = Request("too-long", list(range(100, 170)))  # 18 full pages
    before = snapshot(mgr.cache)
    assert mgr.allocate_slots(too_long, 8, full_sequence_must_fit=True) is None
    assert snapshot(mgr.cache) == before
    assert mgr.allocate_slots(too_long, 8) is not None  # the first chunk alone fits
    too_long.num_computed_tokens = 8
    assert mgr.allocate_slots(too_long, 8, full_sequence_must_fit=True) is None  # running


def test_the_gate_runs_after_the_checks() -> None:
    """Bad input with ``full_sequence_must_fit`` raises and changes nothing."""
    mgr = _manager()
    prompt = list(range(1, 22))
    _serve(mgr, Request("a", prompt))
    blocks, k, _ = mgr.get_computed_blocks(Request("probe", prompt[:-3]))
    salted = Request("s", prompt, cache_salt="other")
    before = snapshot(mgr.cache)
    with pytest.raises(InvalidRequestError, match="namespace"):
        mgr.allocate_slots(salted, salted.num_tokens - k, k, blocks, full_sequence_must_fit=True)
    assert snapshot(mgr.cache) == before


def test_kv_cache_blocks_as_vllm_scheduler_uses_them() -> None:
    """``get_block_ids(allow_none=, group_ids=)`` and ``+`` (the scheduler adds the computed
    blocks to the new ones), as vLLM 0.33's ``KVCacheBlocks``."""
    mgr = _manager()
    prompt = list(range(1, 22))
    _serve(mgr, Request("a", prompt))
    computed, k, _ = mgr.get_computed_blocks(Request("b", prompt))
    b = Request("b", prompt)
    new = mgr.allocate_slots(b, b.num_tokens - k, k, computed)
    assert new is not None
    both = computed + new
    assert both.get_block_ids() == mgr.get_block_ids("b")
    assert both.get_block_ids(group_ids=[1]) == (mgr.get_block_ids("b")[1],)
    empty = KVCacheBlocks(((), ()))
    assert empty.get_block_ids(allow_none=True) is None and empty.get_block_ids() == ([], [])
    assert (empty + empty).blocks == ((), ())
