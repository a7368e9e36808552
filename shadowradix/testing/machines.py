"""Model-based stateful test of `ShadowRadixCache`, exported so an embedder can run it.

The machine drives random interleavings of admit / prefill chunk / batched decode / draft +
rollback / cache_unfinished / finish / abort / evict / rebalance over tiny pools, and checks:

* ``check_invariants()`` after every step;
* the fingerprint oracle on every allocation and on every live request's reads;
* a plain-Python reference of what was inserted: matches only return inserted prefixes, locked
  prefixes stay matchable, inserting a sequence then matching it gives the full aligned hit;
* failed calls (`CapacityError`) leave a snapshot-identical cache;
* draft + rollback equals a run that extended only the accepted tokens;
* a copy of every live request's page tables kept only by applying the deltas the calls return
  (`TableMirror`) equals ``request.vpages`` / ``request.swa_pages`` after every step (eviction
  and rebalancing return none: they never change a live request's table), and each step's
  ``plan.reads`` equals `read_plan` from the step's start.

Subclass and override `make_cache` to run it against an integration.
"""

from __future__ import annotations

import copy

import numpy as np
from hypothesis import event, note
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from ..cache import ShadowRadixCache
from ..config import CacheConfig
from ..deltas import PageTableDelta
from ..errors import CapacityError
from ..locks import Pool
from ..request import Request
from ..results import Allocation, ReadPlan, StepPlan, WindowSource
from .oracle import FingerprintOracle
from .snapshot import snapshot
from .strategies import cache_configs

ALPHABET = 3


class TableMirror:
    """What an engine keeps: a copy of each request's tables, taken at `admit` and changed only
    by applying deltas (virtual pages, SWA base, SWA pages per request id)."""

    def __init__(self) -> None:
        self.tables: dict[int, tuple[list[int], int, list[int]]] = {}

    def admitted(self, request: Request) -> None:
        self.tables[request.id] = (list(request.vpages), request.swa_base, list(request.swa_pages))

    def apply(self, deltas: tuple[PageTableDelta, ...]) -> None:
        for d in deltas:
            vpages, base, swa = self.tables[d.request_id]
            if d.pool is Pool.FULL:
                d.apply(vpages)
            else:
                base = d.apply(swa, base)
            self.tables[d.request_id] = (vpages, base, swa)

    def check(self, request: Request) -> None:
        vpages, base, swa = self.tables[request.id]
        assert vpages == list(request.vpages), f"r{request.id}: virtual table != its deltas"
        assert (base, swa) == (request.swa_base, request.swa_pages), (
            f"r{request.id}: SWA table [{request.swa_base}+{request.swa_pages}] != its deltas "
            f"[{base}+{swa}]"
        )


def _read_arrays(plan: ReadPlan) -> list[np.ndarray]:
    streams = [(s.entry_slots, s.inflight_positions, s.inflight_rows) for s in plan.streams]
    return [plan.swa_positions, plan.swa_slots] + [x for arrays in streams for x in arrays]


def same_reads(a: ReadPlan, b: ReadPlan) -> bool:
    """Whether two read plans name the same slots (`ReadPlan` holds arrays: no ``==``)."""
    if (a.length, a.replay_start) != (b.length, b.replay_start):
        return False
    if [s.ratio for s in a.streams] != [s.ratio for s in b.streams]:
        return False
    return all(np.array_equal(x, y) for x, y in zip(_read_arrays(a), _read_arrays(b)))


class CacheMachine(RuleBasedStateMachine):
    requests = Bundle("requests")
    #: steps executed by every instance, all subclasses together (reported by the test suite)
    steps_run = 0
    config_strategy: st.SearchStrategy[CacheConfig] = cache_configs()

    def make_cache(self, config: CacheConfig) -> ShadowRadixCache:
        return ShadowRadixCache(config)

    @initialize(data=st.data(), seed=st.integers(0, 2**16))
    def setup(self, data: st.DataObject, seed: int) -> None:
        self.config = data.draw(self.config_strategy, label="config")
        self.cache = self.make_cache(self.config)
        self.oracle = FingerprintOracle(self.config)
        rng = np.random.default_rng(seed)
        stem_len = 4 * self.config.page_size + self.config.window + 8
        self.stems = [rng.integers(0, ALPHABET, stem_len).tolist() for _ in range(3)]
        self.inserted: set[tuple[int, ...]] = set()
        self.live: dict[int, Request] = {}
        self.mirror = TableMirror()
        note(f"config={self.config}")

    # -- helpers -----------------------------------------------------------------------------

    def _prompt(self, stem: int, cut: int, tail: list[int]) -> list[int]:
        base = self.stems[stem]
        prompt = base[: cut % (len(base) + 1)] + tail
        return prompt or [0]

    def _tokens_of(self, allocation_ids: tuple[int, ...]) -> dict[int, list[int]]:
        return {rid: self.live[rid].tokens for rid in allocation_ids}

    def _write(self, allocation: Allocation) -> None:
        ids = allocation.request_ids
        approximate = {rid for rid in ids if self.live[rid].approximate}
        self.oracle.write(allocation, self._tokens_of(ids), approximate)

    def _expect_unchanged(self, before: tuple, err: CapacityError) -> None:
        note(f"rejected: {err}")
        event(f"capacity error ({err.pool})")
        assert snapshot(self.cache) == before, "a failed call changed the cache"

    def _record_insert(self, request: Request) -> None:
        p = self.config.page_size
        full = request.num_committed // p * p
        committed = request.tokens[:full]
        for k in range(p, full + 1, p):
            self.inserted.add(tuple(committed[:k]))
        if full:
            m = self.cache.match_prefix(committed)
            assert m.cached_len == full, f"inserted {full} tokens, match found {m.cached_len}"

    # -- rules -------------------------------------------------------------------------------

    @rule(
        target=requests,
        stem=st.integers(0, 2),
        cut=st.integers(0, 10**6),
        tail=st.lists(st.integers(0, ALPHABET - 1), max_size=6),
    )
    def admit(self, stem: int, cut: int, tail: list[int]):  # type: ignore[no-untyped-def]
        prompt = self._prompt(stem, cut, tail)
        match = self.cache.match_prefix(prompt)
        assert match.cached_len == 0 or tuple(prompt[: match.cached_len]) in self.inserted, (
            "matched a prefix that was never inserted"
        )
        assert match.hit_len <= match.prefix_len <= match.cached_len <= len(prompt)
        before = snapshot(self.cache)
        try:
            request = self.cache.admit(prompt, match)
        except CapacityError as err:
            self._expect_unchanged(before, err)
            return multiple()
        self.live[request.id] = request
        self.mirror.admitted(request)
        event(f"admit: {match.window.value}" + (" (hit)" if match.hit_len else ""))
        note(
            f"admit r{request.id}: len={len(prompt)} {match.window.value} prefix={match.prefix_len}"
        )
        if request.replay_allocation is not None:
            self._write(request.replay_allocation)
        return request

    @rule(
        stem=st.integers(0, 2),
        cut=st.integers(0, 10**6),
        tail=st.lists(st.integers(0, ALPHABET - 1), max_size=6),
        decode_len=st.integers(0, 9),
    )
    def serve(self, stem: int, cut: int, tail: list[int], decode_len: int) -> None:
        """A whole request at once (admit, prefill, decode, finish), so later ones can hit."""
        request = self.admit(stem, cut, tail)
        if not isinstance(request, Request):
            return
        chunk = max(1, 3 * self.config.page_size // 2)
        while len(request.prompt_remaining) and self._extend(
            [request], [request.prompt_remaining[:chunk].tolist()]
        ):
            pass
        for t in range(decode_len):
            if not self._extend([request], [[t % ALPHABET]]):
                break
        self._finished(request, self.cache.finish(request).deltas)
        self._record_insert(request)

    def _finished(self, request: Request, deltas: tuple[PageTableDelta, ...]) -> None:
        """``request`` was finished or aborted: its last deltas leave the tables it ends with."""
        self.mirror.apply(deltas)
        self.mirror.check(request)
        del self.live[request.id], self.mirror.tables[request.id]

    def _check_plan(self, plan: StepPlan, batch: list[Request]) -> None:
        """The step's reads are `read_plan` from each start; its deltas keep the mirror."""
        self.mirror.apply(plan.deltas)
        for request, start, reads in zip(batch, plan.starts, plan.reads):
            # every query of the chunk finds its whole window (read_plan with start=)
            plan_now = self.cache.read_plan(request, start=start)
            assert same_reads(reads, plan_now), "plan.reads differs from read_plan(start=)"
            self.oracle.check_reads(plan_now, request.tokens, request.id, request.approximate)

    @precondition(lambda self: self.live)
    @rule(request=requests, size=st.integers(1, 300))
    def prefill_chunk(self, request: Request, size: int) -> None:
        chunk = request.prompt_remaining[: size % (2 * self.config.page_size + 3) + 1].tolist()
        self._extend([request], [chunk or [size % ALPHABET]])

    @precondition(lambda self: self.live)
    @rule(
        batch=st.lists(requests, min_size=1, max_size=4, unique_by=lambda r: r.id),
        tok=st.integers(0, ALPHABET - 1),
    )
    def decode(self, batch: list[Request], tok: int) -> None:
        self._extend(batch, [[tok] for _ in batch])

    def _extend(self, batch: list[Request], tokens: list[list[int]]) -> bool:
        before = snapshot(self.cache)
        try:
            allocation = self.cache.extend_batch(batch, tokens)
        except CapacityError as err:
            self._expect_unchanged(before, err)
            return False
        note(f"extend {[r.id for r in batch]} by {[len(t) for t in tokens]}")
        if allocation.evicted.nodes_removed or allocation.evicted.nodes_tombstoned:
            event("extend evicted")
        self._write(allocation)
        self._check_plan(allocation, batch)
        return True

    @precondition(lambda self: self.config.speculative and self.live)
    @rule(
        request=requests,
        draft=st.lists(st.integers(0, ALPHABET - 1), min_size=1, max_size=12),
        accept=st.integers(0, 12),
    )
    def draft_and_verify(self, request: Request, draft: list[int], accept: int) -> None:
        limit = self.config.max_draft_len
        draft = draft[:limit] if limit is not None else draft
        accepted = min(accept, len(draft))
        twin_cache, twin = copy.deepcopy((self.cache, request))
        before = snapshot(self.cache)
        try:
            allocation = self.cache.extend_draft(request, draft)
        except CapacityError as err:
            self._expect_unchanged(before, err)
            return
        self._write(allocation)
        self._check_plan(allocation, [request])
        self.mirror.apply(self.cache.rollback(request, len(draft) - accepted).deltas)
        note(f"draft r{request.id}: {len(draft)} drafted, {accepted} accepted")
        event(
            f"draft: {'all' if accepted == len(draft) else 'some' if accepted else 'none'} accepted"
        )
        if accepted:
            twin_cache.extend(twin, draft[:accepted])
        if allocation.evicted.full_pages == allocation.evicted.swa_pages == 0:
            assert snapshot(self.cache) == snapshot(twin_cache), (
                "rollback differs from never drafting"
            )

    @precondition(lambda self: self.live)
    @rule(request=requests)
    def cache_unfinished(self, request: Request) -> None:
        self.mirror.apply(self.cache.cache_unfinished(request).deltas)
        self._record_insert(request)

    @precondition(lambda self: self.live)
    @rule(request=consumes(requests))
    def finish(self, request: Request) -> None:
        if request.num_draft:  # drafts are always settled by draft_and_verify
            raise AssertionError("unsettled draft")
        self._finished(request, self.cache.finish(request).deltas)
        self._record_insert(request)
        p, w = self.config.page_size, self.config.window
        full = request.num_committed // p * p
        if full and full - w >= request.match.prefix_len:
            m = self.cache.match_prefix(request.tokens[:full])
            assert m.window is WindowSource.LIVE and m.prefix_len == full, (
                f"finished {full} tokens, a re-match resumes at {m.prefix_len} ({m.window.value})"
            )

    @precondition(lambda self: self.live)
    @rule(request=consumes(requests))
    def abort(self, request: Request) -> None:
        self._finished(request, self.cache.abort(request).deltas)

    @rule(full=st.integers(0, 3), swa=st.integers(0, 3))
    def evict(self, full: int, swa: int) -> None:
        p = self.config.page_size
        report = self.cache.evict(full * p, swa * p)
        note(f"evict: {report}")

    @rule(full_pages=st.integers(1, 64), swa_pages=st.integers(1, 64))
    def rebalance(self, full_pages: int, swa_pages: int) -> None:
        c, p = self.config, self.config.page_size
        full = min(full_pages, c.max_full_pages) * p
        swa = min(max(swa_pages, c.window_pages + 1), c.max_swa_pages) * p
        before = snapshot(self.cache)
        try:
            report = self.cache.rebalance(full_capacity=full, swa_capacity=swa)
        except CapacityError as err:
            self._expect_unchanged(before, err)
            return
        fm, sm = report.full_moves, report.swa_moves
        self.oracle.move_pages(fm.src, fm.dst, sm.src, sm.dst)
        self.mirror.apply(report.deltas)
        note(f"rebalance: {len(fm)} full and {len(sm)} SWA pages moved")
        event(f"rebalance: {'pages moved' if len(fm) or len(sm) else 'no move'}")

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def structure_holds(self) -> None:
        if hasattr(self, "cache"):
            CacheMachine.steps_run += 1
            self.cache.check_invariants()

    @invariant()
    def reads_match_recomputation(self) -> None:
        for request in self.live.values():
            plan = self.cache.read_plan(request)
            self.oracle.check_reads(plan, request.tokens, request.id, request.approximate)

    @invariant()
    def tables_follow_deltas(self) -> None:
        for request in self.live.values():
            self.mirror.check(request)

    @invariant()
    def locked_prefixes_stay_matchable(self) -> None:
        p = self.config.page_size if hasattr(self, "config") else 1
        for request in self.live.values():
            locked = request.tree_pages * p
            if locked:
                assert self.cache.match_prefix(request.tokens[:locked]).cached_len >= locked
