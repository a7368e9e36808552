"""The SGLang-shaped shim, driven the way SGLang's scheduler drives a tree cache.

`SGLangLoop` is a small scheduler: each step runs a prefill batch (the chunked request first,
then waiting requests matched longest-prefix-first, each locked with ``inc_lock_ref`` while the
budget check runs, chunked to a token budget, ``cache_unfinished_req`` after every chunk) or,
with nothing to prefill, a decode batch (``check_decode_mem``; retraction of the newest request
with ``cache_finished_req(is_insert=False)`` when it fails; ``cache_finished_req`` on finish).
Random workloads over tiny pools check, after every step:

* every allocation and every running request's reads against the fingerprint oracle (what
  recomputation would hold, replayed windows included);
* the engine's own ``req_to_token`` table, kept only from what the shim reports (a match's
  ``device_indices``, each allocation's slots, ``prefix_indices`` after an insert), equals the
  request's real page table: the shim announces every page it moves;
* ``check_invariants`` (debug config), and at the end no request, pin or private page is left.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import event, given, note, settings
from hypothesis import strategies as st

from shadowradix import CacheConfig, InvalidRequestError, LockError, StaleMatchError
from shadowradix.integrations.paths import slots_of
from shadowradix.integrations.sglang import ShadowRadixSGLangCache
from shadowradix.integrations.sglang_types import (
    EvictParams,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    RadixKey,
    Req,
)
from shadowradix.results import Allocation
from shadowradix.testing import FingerprintOracle, cache_configs, snapshot

ALPHABET = 3


class SGLangLoop:
    def __init__(self, tree: ShadowRadixSGLangCache, budget: int, max_new: dict[str, int]):
        self.tree, self.budget, self.max_new = tree, budget, max_new
        self.oracle = FingerprintOracle(tree.cache.config)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.table: dict[str, np.ndarray] = {}  # the engine's req_to_token rows
        self.finished: list[Req] = []
        self.admitted: dict[str, int] = {}  # admission order: the priority
        self.clock = itertools.count()
        self.retractions = self.hits = self.stale = self.dedups = 0

    # -- the engine's side of every call ---------------------------------------------------

    def _run(self, allocation: Allocation, reqs: list[Req], replay: bool = False) -> None:
        """Execute a step: write its slots (oracle), record them in req_to_token, check reads."""
        by_id = {r.kv.id: r for r in reqs if r.kv is not None}
        ids = allocation.request_ids
        approximate = {i for i in ids if by_id[i].kv.approximate}
        self.oracle.write(allocation, {i: by_id[i].kv.tokens for i in ids}, approximate)
        offsets, slots = allocation.token_offsets, allocation.virtual_slots
        for k, rid in enumerate(ids):
            req = by_id[rid]
            row = self.table.setdefault(req.rid, np.zeros(0, np.int64))
            start, end = int(allocation.starts[k]), int(allocation.ends[k])
            row = np.concatenate([row[:start], slots[offsets[k] : offsets[k + 1]]])
            assert len(row) == end
            self.table[req.rid] = row
            if replay:  # the window below the match's prefix, rebuilt: `alloc_for_extend` has
                # already extended the chunk (unwritten yet), so no read plan of this moment is
                # the replay's; the chunk's own reads (next) cover the rebuilt window
                continue
            plan = self.tree.cache.read_plan(req.kv, start=start)
            self.oracle.check_reads(plan, req.kv.tokens, req.kv.id, req.kv.approximate)

    def _sample(self, req: Req) -> None:
        req.output_ids.append((len(req.fill_ids) * 7 + len(req.rid)) % ALPHABET)

    # -- the scheduler ---------------------------------------------------------------------
    # Priority is admission order: a request that lacks memory only ever retracts newer ones,
    # so the oldest always progresses (alone, any request fits) and the loop terminates.

    def step(self) -> None:
        if (self.chunked is not None or self.waiting) and self._prefill():
            return
        if self.running:
            self._decode()

    def _prefill(self) -> bool:
        """One prefill batch: admit and compute, then (after the batch's forward) insert."""
        budget, batch = self.budget, []
        if self.chunked is not None:
            req = self.chunked
            n = min(budget, len(req.fill_ids) - req.kv.length)
            while not self.tree.can_alloc_for_extend(req, n) and self._newer(req):
                self._retract(self._newer(req)[-1])
            if not self.tree.can_alloc_for_extend(req, n):
                return False  # decode the older requests first
            self.chunked = None
            budget -= self._extend(req, n, batch)
        for req in self._by_prefix():
            if budget <= 0 or any(r.kv.length < len(r.fill_ids) for r in batch):
                break  # at most one chunked request
            req.lock_result = self.tree.inc_lock_ref(req.last_node)  # PrefillAdder
            n = min(budget, len(req.fill_ids) - len(req.prefix_indices))
            if not self.tree.can_alloc_for_extend(req, n):
                self.tree.dec_lock_ref(req.last_node, req.lock_result.to_dec_params())
                req.lock_result = None
                break
            try:
                budget -= self._admit(req, n, batch)
            except StaleMatchError:  # an earlier admission's eviction shortened its prefix
                self.tree.dec_lock_ref(req.last_node, req.lock_result.to_dec_params())
                req.lock_result = None
                self.stale += 1
                break  # matched again next step
        for req in batch:
            self._after_forward(req)
        return bool(batch)

    def _admit(self, req: Req, n: int, batch: list[Req]) -> int:
        table = req.prefix_indices.copy()
        n = self._extend(req, n, batch, table)
        self.waiting.remove(req)
        self.admitted[req.rid] = next(self.clock)
        self.hits += len(req.prefix_indices)
        return n

    def _by_prefix(self) -> list[Req]:
        """Match every waiting request, longest prefix first (SGLang's LPM policy)."""
        for req in self.waiting:
            key = RadixKey(req.fill_ids[:-1], req.extra_key)
            m = self.tree.match_prefix(MatchPrefixParams(key))
            req.prefix_indices, req.last_node = m.device_indices, m.last_device_node
        return sorted(self.waiting, key=lambda r: -len(r.prefix_indices))

    def _extend(self, req: Req, n: int, batch: list[Req], table: np.ndarray | None = None) -> int:
        running = req.kv is not None and req.kv.is_active
        start = req.kv.length if running else len(req.prefix_indices)
        allocation = self.tree.alloc_for_extend(req, n)
        if table is not None:  # admitted: req_to_token starts from the match's indices
            self.table[req.rid] = table
        assert req.lock_result is None, "admission releases the scheduler's lock"
        if req.kv.replay_allocation is not None and start == req.kv.match.prefix_len:
            self._run(req.kv.replay_allocation, [req], replay=True)
        self._run(allocation, [req])
        self._check_table(req)
        batch.append(req)
        return n

    def _after_forward(self, req: Req) -> None:
        chunked = req.kv.length < len(req.fill_ids)
        before = list(req.kv.vpages)
        self.tree.cache_unfinished_req(req, chunked=chunked)
        self.dedups += list(req.kv.vpages) != before
        # SGLang's cache_unfinished_req writes req_to_token itself; here the engine copies it
        self.table[req.rid][: len(req.prefix_indices)] = req.prefix_indices
        self._check_table(req)
        if chunked:
            self.chunked = req
        else:
            self._sample(req)
            self.running.append(req)

    def _decode(self) -> None:
        while not self.tree.check_decode_mem(self.running):
            active = self.running + ([self.chunked] if self.chunked else [])
            self._retract(max(active, key=lambda r: self.admitted[r.rid]))  # the newest
            if not self.running:
                return
        allocation = self.tree.alloc_for_decode(self.running)
        self._run(allocation, self.running)
        for req in list(self.running):
            self._check_table(req)
            if len(req.output_ids) >= self.max_new[req.rid]:
                self.tree.cache_finished_req(req)
                self.running.remove(req)
                self.finished.append(req)
                del self.table[req.rid]
            else:
                self._sample(req)

    def _newer(self, req: Req) -> list[Req]:
        mine = self.admitted[req.rid]
        return sorted((r for r in self.running if self.admitted[r.rid] > mine),
                      key=lambda r: self.admitted[r.rid])  # fmt: skip

    def _retract(self, victim: Req) -> None:
        if victim is self.chunked:
            self.chunked = None
        else:
            self.running.remove(victim)
        self.tree.cache_finished_req(victim, is_insert=False)
        victim.prefix_indices, victim.last_node = victim.prefix_indices[:0], None
        del self.table[victim.rid]
        self.waiting.insert(0, victim)
        self.retractions += 1
        note(f"retract {victim.rid}")

    def _check_table(self, req: Req) -> None:
        kv, p = req.kv, self.tree.page_size
        assert kv.tokens == req.fill_ids[: kv.length], "the cache computed other tokens"
        assert np.array_equal(self.table[req.rid], slots_of(kv.vpages, kv.length, p)), (
            f"{req.rid}: the engine's req_to_token row drifted from the cache's page table"
        )


def loop_config(config: CacheConfig, longest: int, spare: int) -> CacheConfig:
    """The drawn tiny config, with a full pool that always fits one whole request."""
    pages = -(-longest // config.page_size) + 1 + spare
    size = pages * config.page_size
    return dataclasses.replace(config, full_capacity=size, max_full_capacity=size, debug=True)


def draw_requests(draw: st.DrawFn, config: CacheConfig, make):  # type: ignore[no-untyped-def]
    """1 to 6 requests ``make(rid, prompt)`` (which draws its own keys) with prompts cut from two
    shared stems and tailed (sometimes the last one again: a batch computes it twice), and
    their output lengths by rid."""
    p, w = config.page_size, config.window
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    stems = [rng.integers(0, ALPHABET, 2 * p + w).tolist() for _ in range(2)]
    reqs, max_new = [], {}
    for i in range(draw(st.integers(1, 6))):
        stem = stems[draw(st.integers(0, 1))]
        cut = draw(st.integers(0, len(stem)))
        tail = draw(st.lists(st.integers(0, ALPHABET - 1), max_size=5))
        prompt = (stem[:cut] + tail) or [1]
        if reqs and draw(st.booleans()):
            prompt = list(reqs[-1].origin_input_ids)
        reqs.append(make(f"r{i}", prompt))
        max_new[f"r{i}"] = draw(st.integers(1, 6))
    return reqs, max_new


def draw_sizes(draw: st.DrawFn, config: CacheConfig, longest: int) -> tuple[CacheConfig, int]:
    """`loop_config` with spare pages, and a prefill token budget whose chunk's pages, beside
    the window a request holds, always fit the SWA pool."""
    p, w = config.page_size, config.window
    config = loop_config(config, longest, draw(st.integers(0, 2 * longest // p + 2)))
    chunk_pages = config.num_swa_pages - (-(-w // p) + 1)
    return config, draw(st.integers(1, max(1, (chunk_pages - 1) * p + 1)))


def drain(loop, reqs: list, check=lambda: None) -> None:  # type: ignore[no-untyped-def,type-arg]
    """Steps ``loop`` (``check`` after each step) until ``reqs`` all finished."""
    loop.waiting = list(reqs)
    for _ in range(20 * sum(len(r.origin_input_ids) + 8 for r in reqs)):
        if not (loop.waiting or loop.running or loop.chunked):
            break
        loop.step()
        check()
    assert len(loop.finished) == len(reqs), "the loop stalled"


@st.composite
def workloads(draw: st.DrawFn) -> tuple[CacheConfig, list[Req], dict[str, int], int]:
    config = draw(cache_configs(speculative=False))
    reqs, max_new = draw_requests(draw, config, lambda rid, prompt: Req(
        rid, prompt, extra_key=draw(st.sampled_from((None, None, "lora")))))  # fmt: skip
    longest = max(len(r.origin_input_ids) + max_new[r.rid] for r in reqs)
    config, budget = draw_sizes(draw, config, longest)
    return config, reqs, max_new, budget


@given(workloads())
@settings(settings.default, max_examples=max(8, settings.default.max_examples // 10))
def test_scheduler_loop(workload: tuple[CacheConfig, list[Req], dict[str, int], int]) -> None:
    config, reqs, max_new, budget = workload
    tree = ShadowRadixSGLangCache(config)
    loop = SGLangLoop(tree, budget, max_new)
    drain(loop, reqs)
    for name, count in (("retraction", loop.retractions), ("stale match", loop.stale),
                        ("prefix hit", loop.hits), ("dedup", loop.dedups)):  # fmt: skip
        event(f"{name}: {'yes' if count else 'no'}")
    stats = tree.cache.stats()
    assert stats.num_requests == 0 and stats.full.held_pages == stats.swa.held_pages == 0
    assert tree.protected_size() == 0, "a lock leaked"
    assert stats.hit_tokens <= loop.hits  # admissions resume where device_indices said
    tree.reset()  # refused if any pin were still held
    assert tree.total_size() == 0


def _config() -> CacheConfig:
    return CacheConfig(page_size=4, window=8, compress_ratios=(0, 4, 8), overlap_ratios=(4,),
                       full_capacity=4 * 32, swa_capacity=4 * 12, debug=True)  # fmt: skip


def _serve(tree: ShadowRadixSGLangCache, req: Req) -> None:
    m = tree.match_prefix(MatchPrefixParams(RadixKey(req.fill_ids[:-1], req.extra_key)))
    req.prefix_indices, req.last_node = m.device_indices, m.last_device_node
    tree.alloc_for_extend(req, len(req.fill_ids) - len(req.prefix_indices))
    tree.cache_unfinished_req(req)
    req.output_ids.append(0)
    tree.alloc_for_decode([req])
    req.output_ids.append(1)
    tree.cache_finished_req(req)


def test_lock_refs_pin_and_release() -> None:
    tree = ShadowRadixSGLangCache(_config())
    prompt = list(range(1, 22))
    _serve(tree, Req("a", prompt))
    m = tree.match_prefix(MatchPrefixParams(RadixKey(prompt)))
    assert len(m.device_indices) == 20 and m.full_kv_hit_length == 20
    lock = tree.inc_lock_ref(m.last_device_node)
    assert lock.delta == -20 and tree.protected_size() == 20
    assert tree.evict(EvictParams(num_tokens=10**6)).num_tokens_evicted == 0  # all pinned
    assert tree.match_prefix(MatchPrefixParams(RadixKey(prompt))).full_kv_hit_length == 20
    assert tree.dec_lock_ref(m.last_device_node, lock.to_dec_params()).delta == 20
    with pytest.raises(LockError):
        tree.dec_lock_ref(m.last_device_node, lock.to_dec_params())
    assert tree.evict(EvictParams(num_tokens=10**6)).num_tokens_evicted == 20
    assert "#tokens: 0" in tree.format_tree()


def test_namespaces_and_swa_branching() -> None:
    tree = ShadowRadixSGLangCache(_config())
    prompt = list(range(1, 22))
    _serve(tree, Req("a", prompt, extra_key="lora-1"))
    assert len(tree.match_prefix(MatchPrefixParams(RadixKey(prompt))).device_indices) == 0
    tree.evict(EvictParams(swa_num_tokens=10**6))  # tombstone every unprotected window
    m = tree.match_prefix(MatchPrefixParams(RadixKey(prompt, "lora-1")))
    assert len(m.device_indices) < m.full_kv_hit_length == m.swa_branching_seqlen == 20
    assert "namespace 'lora-1'" in tree.format_tree()


def test_insert_allocates_the_missing_part() -> None:
    tree = ShadowRadixSGLangCache(_config())
    prompt = list(range(1, 22))
    first = tree.insert(InsertParams(RadixKey(prompt[:12])))
    assert first.prefix_len == 0 and first.allocation is not None
    assert first.allocation.num_tokens == 12
    second = tree.insert(InsertParams(RadixKey(prompt)))  # 21 tokens: 5 whole pages of 4
    assert second.prefix_len == 12 and second.allocation is not None
    assert second.allocation.num_tokens == 8 and second.total_len == tree.total_size() == 20
    assert tree.insert(InsertParams(RadixKey(prompt[:20]))).allocation is None
    assert tree.insert(InsertParams(RadixKey(prompt[:3]))) == InsertResult(0, 0, None)


def test_insert_never_hands_out_a_slot_it_freed() -> None:
    """An unaligned key's partial last page is not inserted, so it is not allocated either:
    every slot the engine is told to write stays the tree's, and no later request gets one."""
    tree = ShadowRadixSGLangCache(_config())
    written = tree.insert(InsertParams(RadixKey(list(range(1, 11))))).allocation
    assert written is not None and written.num_tokens == 8 and tree.total_size() == 8
    later = tree.alloc_for_extend(Req("b", [50] * 9), 8)
    assert not set(written.virtual_slots.tolist()) & set(later.virtual_slots.tolist())


def test_bad_input_is_typed_and_changes_nothing() -> None:
    tree = ShadowRadixSGLangCache(_config())
    _serve(tree, Req("a", list(range(1, 22))))
    req = Req("b", list(range(1, 30)))
    tree.alloc_for_extend(req, 4)
    before = snapshot(tree.cache)
    calls = [
        lambda: tree.match_prefix(RadixKey([1, 2])),  # type: ignore[arg-type]
        lambda: tree.match_prefix(MatchPrefixParams(RadixKey([-1]))),
        lambda: tree.alloc_for_extend(req, 0),
        lambda: tree.alloc_for_extend(req, 100),
        lambda: tree.alloc_for_extend(Req("c", [1, 2, 3]), 9),
        lambda: tree.alloc_for_decode([req]),  # its prompt is not computed yet
        lambda: tree.cache_unfinished_req(Req("d", [1])),
        lambda: tree.alloc_for_extend("req", 1),  # type: ignore[arg-type]
        lambda: tree.can_alloc_for_extend("req", 1),  # type: ignore[arg-type]
        lambda: tree.cache_finished_req("req"),  # type: ignore[arg-type]
        lambda: tree.check_decode_mem([Req("e", [1])]),
        lambda: tree.inc_lock_ref("node"),  # type: ignore[arg-type]
        lambda: tree.evict(EvictParams(num_tokens=-1)),
        lambda: tree.insert(InsertParams(RadixKey([-1]))),
        lambda: tree.reset(),  # b is running
    ]
    for call in calls:
        with pytest.raises(InvalidRequestError):
            call()
        assert snapshot(tree.cache) == before


def test_a_match_of_another_namespace_is_refused() -> None:
    """``req.last_node`` from a lookup without the request's ``extra_key`` must not admit it:
    the prefix would leak across LoRA adapters / cache salts."""
    tree = ShadowRadixSGLangCache(_config())
    prompt = list(range(1, 22))
    _serve(tree, Req("a", prompt))
    m = tree.match_prefix(MatchPrefixParams(RadixKey(prompt)))
    assert m.full_kv_hit_length == 20
    req = Req("b", prompt + [5], extra_key="lora-2")
    req.prefix_indices, req.last_node = m.device_indices, m.last_device_node
    before = snapshot(tree.cache)
    with pytest.raises(InvalidRequestError, match="namespace"):
        tree.alloc_for_extend(req, 2)
    assert snapshot(tree.cache) == before and req.kv is None


def test_dec_lock_ref_without_params_releases_the_latest_pin() -> None:
    """SGLang's scheduler drops ``inc_lock_ref``'s result and calls ``dec_lock_ref(node)``."""
    tree = ShadowRadixSGLangCache(_config())
    prompt = list(range(1, 22))
    _serve(tree, Req("a", prompt))
    node = tree.match_prefix(MatchPrefixParams(RadixKey(prompt))).last_device_node
    tree.inc_lock_ref(node)
    tree.inc_lock_ref(node)
    assert tree.protected_size() == 20
    assert tree.dec_lock_ref(node).delta == 0  # one pin still holds the prefix
    assert tree.dec_lock_ref(node).delta == 20 and tree.protected_size() == 0
    with pytest.raises(LockError):
        tree.dec_lock_ref(node)
    with pytest.raises(InvalidRequestError):
        tree.dec_lock_ref(node, "x")  # type: ignore[arg-type]
    tree.reset()  # no pin left behind
    root = tree.match_prefix(MatchPrefixParams(RadixKey([1]))).last_device_node
    assert tree.dec_lock_ref(root).delta == 0


def _matched_after_a_served_prompt() -> tuple[ShadowRadixSGLangCache, Req]:
    """A tree that served one prompt, and a request extending it with its match set (as the
    scheduler's ``init_next_round_input`` sets it), not admitted yet."""
    tree = ShadowRadixSGLangCache(_config())
    prompt = list(range(1, 22))
    _serve(tree, Req("a", prompt))
    req = Req("b", prompt + [7, 8])
    m = tree.match_prefix(MatchPrefixParams(RadixKey(req.fill_ids[:-1])))
    req.prefix_indices, req.last_node = m.device_indices, m.last_device_node
    return tree, req


def test_a_pin_whose_result_the_scheduler_dropped_moves_to_the_request() -> None:
    """SGLang's ``PrefillAdder`` calls ``inc_lock_ref(req.last_node)`` and keeps no result (its
    tree moves the lock at admission): the admission releases that pin, so nothing leaks."""
    tree, req = _matched_after_a_served_prompt()
    tree.inc_lock_ref(req.last_node)  # the result dropped
    tree.alloc_for_extend(req, len(req.fill_ids) - len(req.prefix_indices))
    assert not tree._pins  # the request's own locks hold its path now
    with pytest.raises(LockError):
        tree.dec_lock_ref(req.last_node)
    tree.cache_finished_req(req)
    assert tree.protected_size() == 0
    tree.reset()


def test_a_scheduler_lock_released_early_through_dec_lock_ref_costs_nothing() -> None:
    """SGLang's ``_lock_node`` wrapper pins and unpins a node around a budget check while
    ``req.lock_result`` holds another pin of it: whichever pin the wrapper's
    ``dec_lock_ref(node)`` released, admission releases the other — no leak, no error."""
    tree, req = _matched_after_a_served_prompt()
    tree.inc_lock_ref(req.last_node)  # the wrapper's, result dropped
    req.lock_result = tree.inc_lock_ref(req.last_node)
    tree.dec_lock_ref(req.last_node)  # the wrapper exits: releases the latest (the stored one)
    tree.alloc_for_extend(req, len(req.fill_ids) - len(req.prefix_indices))
    assert not tree._pins and req.lock_result is None
    tree.cache_finished_req(req)
    assert tree.protected_size() == 0
    tree.reset()


def test_insert_over_a_tombstoned_window_allocates_nothing() -> None:
    """The tree holds the key's compressed KV but not its window: pages for those tokens
    would be duplicates the insertion frees, so nothing is allocated or inserted."""
    tree = ShadowRadixSGLangCache(_config())
    prompt = list(range(1, 22))
    _serve(tree, Req("a", prompt))
    tree.evict(EvictParams(swa_num_tokens=10**6))  # tombstone every unprotected window
    m = tree.match_prefix(MatchPrefixParams(RadixKey(prompt)))
    assert len(m.device_indices) < m.full_kv_hit_length
    free = tree.full_available_size()
    result = tree.insert(InsertParams(RadixKey(prompt[:20])))
    assert result.allocation is None and tree.full_available_size() == free
