"""The sglang-0.5.23-shaped layer, driven the way 0.5.23's scheduler drives a tree cache.

`Loop0523` is a small scheduler: each step runs a prefill batch (the chunked request first, then
waiting requests matched with ``init_next_round_input`` longest-prefix-first, each given
``req.lock = tree.lock(req.last_node)`` and an ``extend_end`` chunked to a token budget, admitted
only if ``can_alloc_for_extend`` says so) and, after the batch's forward, samples a token for
each request whose prefill is done, then ``release_kv_cache(checkpoint=True)`` if that finished
it, else ``checkpoint_kv_cache``. With nothing to prefill it runs a decode batch
(``check_decode_mem``; the newest request retracted with ``release_kv_cache(checkpoint=False)``
while it fails). Random workloads over tiny pools, with ``extra_key`` / ``cache_salt``
namespaces and requests kept out of the tree (``skip_radix_cache_insert``), check after every
step:

* every allocation and every running request's reads against the fingerprint oracle;
* the engine's own ``req_to_token`` row, kept only from what the layer reports (the match's
  ``prefix_device_indices``, each allocation's slots, each checkpoint's `RowRewrite`), equals
  the real one (``row_device_indices``), and the running request's ``req.last_node`` holds the
  row's first ``prefix_len`` indices under a lock still held;
* ``check_invariants``, and at the end no request, lock, pin or private page is left.
"""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import event, given, note, settings
from hypothesis import strategies as st
from test_integrations_sglang import ALPHABET, drain, draw_requests, draw_sizes

from shadowradix import CacheConfig, StaleMatchError
from shadowradix.integrations.sglang0523 import ShadowRadixSGLang0523Cache
from shadowradix.integrations.sglang0523_common import (
    checkpoint_kv_cache,
    init_next_round_input,
    release_kv_cache,
)
from shadowradix.integrations.sglang0523_types import Req
from shadowradix.results import Allocation
from shadowradix.testing import FingerprintOracle, cache_configs


class Loop0523:
    def __init__(self, tree: ShadowRadixSGLang0523Cache, budget: int, max_new: dict[str, int]):
        self.tree, self.budget, self.max_new = tree, budget, max_new
        self.oracle = FingerprintOracle(tree.cache.config)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.table: dict[str, np.ndarray] = {}  # the engine's req_to_token rows
        self.finished: list[Req] = []
        self.admitted: dict[str, int] = {}  # admission order: the priority
        self.clock = itertools.count()
        self.retractions = self.hits = self.stale = self.rewrites = 0

    # -- the engine's side of every call ---------------------------------------------------

    def _run(self, allocation: Allocation, reqs: list[Req], replay: bool = False) -> None:
        """Execute a step: write its slots (oracle), record them in req_to_token, check reads."""
        by_id = {r.kv.request.id: r for r in reqs if r.kv.request is not None}
        ids = allocation.request_ids
        kvs = {i: by_id[i].kv.request for i in ids}
        approximate = {i for i in ids if kvs[i].approximate}
        self.oracle.write(allocation, {i: kvs[i].tokens for i in ids}, approximate)
        offsets, slots = allocation.token_offsets, allocation.virtual_slots
        for k, rid in enumerate(ids):
            req, kv = by_id[rid], kvs[rid]
            start, end = int(allocation.starts[k]), int(allocation.ends[k])
            row = np.concatenate([self.table[req.rid][:start], slots[offsets[k] : offsets[k + 1]]])
            assert len(row) == end
            self.table[req.rid] = row
            if not replay:  # a replay runs before the chunk's write: the chunk's reads cover it
                plan = self.tree.cache.read_plan(kv, start=start)
                self.oracle.check_reads(plan, kv.tokens, kv.id, kv.approximate)

    def _sample(self, req: Req) -> bool:
        """Append a sampled token; whether that finished the request."""
        req.output_ids.append((len(req.full_untruncated_fill_ids) * 7 + len(req.rid)) % ALPHABET)
        if len(req.output_ids) >= self.max_new[req.rid]:
            req.finished_reason = "length"
        return req.finished()

    # -- the scheduler ---------------------------------------------------------------------
    # Priority is admission order: a request that lacks memory only ever retracts newer ones,
    # so the oldest always progresses (alone, any request fits) and the loop terminates.

    def step(self) -> None:
        if (self.chunked is not None or self.waiting) and self._prefill():
            return
        if self.running:
            self._decode()

    def _prefill(self) -> bool:
        budget, batch = self.budget, []
        if self.chunked is not None:
            req = self.chunked
            self._set_extend_end(req, budget)
            while not self.tree.can_alloc_for_extend(req) and self._newer(req):
                self._retract(self._newer(req)[-1])
            if not self.tree.can_alloc_for_extend(req):
                return False  # decode the older requests first
            self.chunked = None
            budget -= self._extend(req, batch)
        for req in self._by_prefix():
            if budget <= 0 or any(r.extend_end < len(r.full_untruncated_fill_ids) for r in batch):
                break  # at most one chunked request
            req.lock = self.tree.lock(req.last_node)  # PrefillAdder
            self._set_extend_end(req, budget)
            if not self.tree.can_alloc_for_extend(req):
                self._unlock(req)
                break
            try:
                budget -= self._admit(req, batch)
            except StaleMatchError:  # an earlier admission's eviction shortened its prefix
                self._unlock(req)
                self.stale += 1
                break  # matched again next step
        for req in batch:
            self._after_forward(req)
        return bool(batch)

    def _set_extend_end(self, req: Req, budget: int) -> None:
        req.extend_end = min(req.prefix_len + budget, len(req.full_untruncated_fill_ids))

    def _unlock(self, req: Req) -> None:
        self.tree.unlock(req.lock)
        req.lock = None

    def _by_prefix(self) -> list[Req]:
        """Match every waiting request, longest prefix first (SGLang's LPM policy)."""
        for req in self.waiting:
            m = init_next_round_input(req, self.tree)
            assert (m.device_prefix_len, m.last_device_node) == (req.prefix_len, req.last_node)
            assert req.kv.cache_protected_len == req.prefix_len and req.lock is None
        return sorted(self.waiting, key=lambda r: -r.prefix_len)

    def _admit(self, req: Req, batch: list[Req]) -> int:
        table = self.tree.prefix_device_indices(req).copy()
        n = self._extend(req, batch, table)
        self.waiting.remove(req)
        self.admitted[req.rid] = next(self.clock)
        self.hits += len(table)
        return n

    def _extend(self, req: Req, batch: list[Req], table: np.ndarray | None = None) -> int:
        allocation = self.tree.alloc_for_extend(req)
        kv = req.kv.request
        assert kv is not None and kv.is_active
        if table is not None:  # admitted: req_to_token starts from the match's indices
            self.table[req.rid] = table
            if kv.replay_allocation is not None:
                self._run(kv.replay_allocation, [req], replay=True)
        self._run(allocation, [req])
        self._check_row(req)
        batch.append(req)
        return req.extend_len

    def _after_forward(self, req: Req) -> None:
        done = req.extend_end == len(req.full_untruncated_fill_ids)
        if done and self._sample(req):
            self._finish(req)
            return
        rewrite = checkpoint_kv_cache(req, self.tree)
        if rewrite is not None and len(rewrite.device_indices):
            # 0.5.23's checkpoint writes req_to_token itself; here the engine applies the rewrite
            self.table[req.rid][rewrite.start_pos : rewrite.end_pos] = rewrite.device_indices
            self.rewrites += 1
        assert req.prefix_len == req.extend_end, "the next chunk resumes where this one ended"
        self._check_row(req)
        if done:
            self.running.append(req)
        else:
            self.chunked = req

    def _decode(self) -> None:
        while not self.tree.check_decode_mem(self.running):
            active = self.running + ([self.chunked] if self.chunked else [])
            self._retract(max(active, key=lambda r: self.admitted[r.rid]))  # the newest
            if not self.running:
                return
        allocation = self.tree.alloc_for_decode(self.running)
        self._run(allocation, self.running)
        for req in list(self.running):
            self._check_row(req)
            if self._sample(req):
                self.running.remove(req)
                self._finish(req)

    def _finish(self, req: Req) -> None:
        release_kv_cache(req, self.tree, checkpoint=True)
        assert req.lock is None and not req.kv.holds_kv
        self.finished.append(req)
        del self.table[req.rid]

    def _newer(self, req: Req) -> list[Req]:
        mine = self.admitted[req.rid]
        return sorted((r for r in self.running if self.admitted[r.rid] > mine),
                      key=lambda r: self.admitted[r.rid])  # fmt: skip

    def _retract(self, victim: Req) -> None:
        if victim is self.chunked:
            self.chunked = None
        else:
            self.running.remove(victim)
        release_kv_cache(victim, self.tree, checkpoint=False)
        assert victim.lock is None and not victim.kv.holds_kv
        del self.table[victim.rid]
        self.waiting.insert(0, victim)
        self.retractions += 1
        note(f"retract {victim.rid}")

    def _check_row(self, req: Req) -> None:
        kv = req.kv.request
        assert kv is not None and kv.tokens == req.full_untruncated_fill_ids[: kv.length]
        assert np.array_equal(self.table[req.rid], self.tree.row_device_indices(req)), (
            f"{req.rid}: the engine's req_to_token row drifted from the cache's"
        )
        node = req.last_node
        assert node is not None and req.lock is not None
        assert np.array_equal(
            self.tree.path_device_indices(node), self.table[req.rid][: node.prefix_len]
        )

    def check(self) -> None:
        self.tree.check_invariants()
        for req in self.running + ([self.chunked] if self.chunked else []):
            self._check_row(req)
        assert all(r.lock is None and not r.kv.holds_kv for r in self.waiting + self.finished)


@st.composite
def workloads(draw: st.DrawFn) -> tuple[CacheConfig, list[Req], dict[str, int], int]:
    def make(rid: str, prompt: list[int]) -> Req:
        req = Req(rid, prompt, extra_key=draw(st.sampled_from((None, None, "lora"))),
                  cache_salt=draw(st.sampled_from((None, None, "", "salt"))))  # fmt: skip
        req.skip_radix_cache_insert = draw(st.integers(0, 5)) == 0
        return req

    config = draw(cache_configs(speculative=False))
    reqs, max_new = draw_requests(draw, config, make)
    longest = max(len(r.origin_input_ids) + max_new[r.rid] for r in reqs)
    config, budget = draw_sizes(draw, config, longest)
    return config, reqs, max_new, budget


@given(workloads())
@settings(settings.default, max_examples=max(20, 2 * settings.default.max_examples))
def test_scheduler_loop(workload: tuple[CacheConfig, list[Req], dict[str, int], int]) -> None:
    config, reqs, max_new, budget = workload
    tree = ShadowRadixSGLang0523Cache(config)
    loop = Loop0523(tree, budget, max_new)
    drain(loop, reqs, loop.check)
    for name, count in (("retraction", loop.retractions), ("stale match", loop.stale),
                        ("prefix hit", loop.hits), ("row rewrite", loop.rewrites)):  # fmt: skip
        event(f"{name}: {'yes' if count else 'no'}")
    stats = tree.cache.stats()
    assert stats.num_requests == 0 and stats.full.held_pages == stats.swa.held_pages == 0
    assert tree.protected_size() == 0, "a lock leaked"
    assert stats.hit_tokens <= loop.hits  # admissions resume where prefix_device_indices said
    tree.reset()  # refused if any lock or pin were still held
    assert tree.total_size() == 0
