"""One regression test per core failure class of ../shared/PITFALLS.md.

Each test is named after the bug it guards against and cites the peer tracker in its docstring.
Every test asserts concrete values (page counts, slots, match lengths, fingerprints), so the
buggy behaviour it describes makes it fail, not merely "no exception".

Only the public API is used, plus `shadowradix.testing` and, where a pitfall is about internals
(locks, tree nodes, free lists), the cache's ``_tree`` / ``_locks`` / ``_full`` / ``_swa``.
Token contents are mirrored here (``Driver.tokens``), never read back from a request.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from shadowradix import (
    CacheConfig,
    CapacityError,
    LockError,
    Request,
    ShadowRadixCache,
    WindowSource,
)
from shadowradix.testing import FingerprintOracle, OracleViolation, snapshot

W = 128
RATIOS = (0, 4, 128)


def make_config(
    page: int = 4, full_pages: int = 400, swa_pages: int = 200, **kw: object
) -> CacheConfig:
    return CacheConfig(
        page_size=page,
        window=W,
        compress_ratios=RATIOS,
        overlap_ratios=(4,),
        full_capacity=full_pages * page,
        swa_capacity=swa_pages * page,
        **kw,  # type: ignore[arg-type]
    )


def seq(n: int, seed: int, lo: int = 0, hi: int = 50_000) -> list[int]:
    """``n`` pseudo-random token ids (distinct seeds give unrelated sequences)."""
    return np.random.default_rng(seed).integers(lo, hi, n).tolist()


class Driver:
    """Drives one cache plus a fingerprint oracle; checks conservation, invariants and every
    live request's reads after each step."""

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.cache = ShadowRadixCache(config)
        self.oracle = FingerprintOracle(config)
        self.tokens: dict[int, list[int]] = {}
        self.live: dict[int, Request] = {}
        self.allocations: dict[int, list] = {}

    # -- lifecycle ---------------------------------------------------------------------------

    def admit(self, prompt: list[int], match=None) -> Request:  # type: ignore[no-untyped-def]
        m = self.cache.match_prefix(prompt) if match is None else match
        r = self.cache.admit(prompt, m)
        self.tokens[r.id] = list(prompt[: m.prefix_len])
        self.live[r.id] = r
        self.allocations[r.id] = []
        if r.replay_allocation is not None:
            self.oracle.write(r.replay_allocation, {r.id: self.tokens[r.id]})
        self.check()
        return r

    def extend(self, reqs: Request | list[Request], toks: list[int] | list[list[int]]):  # type: ignore[no-untyped-def]
        if isinstance(reqs, Request):
            reqs, toks = [reqs], [toks]  # type: ignore[list-item]
        a = self.cache.extend_batch(reqs, toks)
        for r, t in zip(reqs, toks):
            self.tokens[r.id] += list(t)  # type: ignore[arg-type]
            self.allocations[r.id].append(a)
        self.oracle.write(a, {r.id: self.tokens[r.id] for r in reqs})
        self.check()
        return a

    def draft(self, r: Request, toks: list[int]):  # type: ignore[no-untyped-def]
        a = self.cache.extend_draft(r, toks)
        self.tokens[r.id] += list(toks)
        self.oracle.write(a, {r.id: self.tokens[r.id]})
        self.check()
        return a

    def rollback(self, r: Request, n: int) -> None:
        self.cache.rollback(r, n)
        if n:
            del self.tokens[r.id][-n:]
        self.check()

    def prefill(self, r: Request, prompt: list[int], chunks: tuple[int, ...] = (7,)) -> None:
        """Extend the rest of ``prompt`` in ``chunks`` (then one chunk for what is left)."""
        pos = r.length
        for n in chunks:
            if pos >= len(prompt):
                return
            self.extend(r, prompt[pos : pos + n])
            pos = min(pos + n, len(prompt))
        if pos < len(prompt):
            self.extend(r, prompt[pos:])

    def finish(self, r: Request) -> None:
        self.cache.finish(r)
        del self.live[r.id]
        self.check()

    def unfinished(self, r: Request) -> None:
        self.cache.cache_unfinished(r)
        self.check()

    def serve(
        self, prompt: list[int], chunks: tuple[int, ...] = (7,), decode: tuple[int, ...] = ()
    ) -> Request:
        r = self.admit(prompt)
        self.prefill(r, prompt, chunks)
        for t in decode:
            self.extend(r, [t])
        self.finish(r)
        return r

    # -- checks ------------------------------------------------------------------------------

    def conservation(self):  # type: ignore[no-untyped-def]
        st = self.cache.stats()
        for name, pool in (("full", st.full), ("swa", st.swa)):
            total = pool.free_pages + pool.evictable_pages + pool.protected_pages + pool.held_pages
            assert total == pool.capacity_pages, f"{name}: {pool}"
            parts = (pool.free_pages, pool.evictable_pages, pool.protected_pages, pool.held_pages)
            assert min(parts) >= 0, f"{name}: {pool}"
        return st

    def check(self) -> None:
        self.cache.check_invariants()
        self.conservation()
        for r in self.live.values():
            self.read(r)

    def stats_checked(self):  # type: ignore[no-untyped-def]
        self.check()
        return self.cache.stats()

    def read(self, r: Request) -> None:
        self.oracle.check_reads(self.cache.read_plan(r), self.tokens[r.id], r.id)

    # -- tree introspection (private attributes, read only) ----------------------------------

    def nodes(self) -> list:  # type: ignore[type-arg]
        return sorted(self.cache._tree.nodes(), key=lambda n: (n.start_page, n.id))

    def tree_swa_pages(self) -> list[int]:
        return [int(x) for n in self.nodes() for x in n.swa_pages]

    def node_covering(self, tokens: list[int], page: int):  # type: ignore[no-untyped-def]
        """The tree node on ``tokens``' path that holds absolute page ``page``."""
        m = self.cache.match_prefix(tokens)
        n = m.node
        while not (n.start_page <= page < n.end_page):
            n = n.parent
        return n


# ==========================================================================================
# Pool accounting
# ==========================================================================================


@pytest.mark.parametrize("page", [4, 256])
def test_pool_conservation_after_every_step_with_spec_decoding__sgl27586_sgl27789(
    page: int,
) -> None:
    """sgl#27586, sgl#27789: free + evictable + protected + held == capacity per pool after
    *every* step (spec decoding, page 256), and everything comes back once idle and evicted."""
    cfg = make_config(page, full_pages=4096 // page, swa_pages=2048 // page, speculative=True)
    d = Driver(cfg)  # Driver.check() asserts conservation after each call below
    draft_len = min(cfg.max_draft_len or 6, 6)
    stem = seq(300, 1)
    a = d.admit(stem + seq(20, 2))
    d.prefill(a, stem + seq(20, 2), chunks=(7, 130))
    d.draft(a, seq(draft_len, 3))
    d.rollback(a, 2)
    d.unfinished(a)
    committed = list(d.tokens[a.id])
    assert len(committed) == 320 + draft_len - 2
    b_prompt = committed + seq(40, 4)
    b = d.admit(b_prompt)
    assert b.match.prefix_len == len(committed) // page * page
    d.prefill(b, b_prompt, chunks=(1,))
    d.draft(b, seq(draft_len, 5))
    d.rollback(b, draft_len)
    d.extend([a, b], [[1], [2]])
    d.draft(a, seq(draft_len, 6))
    d.rollback(a, 0)
    d.finish(a)
    d.cache.abort(b)
    del d.live[b.id]
    d.check()
    st = d.conservation()
    assert st.full.held_pages == st.swa.held_pages == 0
    assert st.full.protected_pages == st.swa.protected_pages == 0
    d.cache.evict(full_tokens=cfg.full_capacity, swa_tokens=cfg.swa_capacity)
    d.check()
    st = d.conservation()
    assert (st.full.free_pages, st.swa.free_pages) == (cfg.num_full_pages, cfg.num_swa_pages)
    assert st.num_nodes == 0


def test_no_page_owned_twice_after_duplicate_insert__sgl27731_sgl38519() -> None:
    """sgl#27731 (aliasing invisible to balance), sgl#38519 (free list corruption): two
    requests compute the same prefix; the second insert adopts the tree's copy and frees its
    own, so every page id is owned once and the free list is duplicate-free and disjoint.
    There is no sentinel slot: page 0 is handed out and comes back like any other."""
    cfg = make_config(4, full_pages=64, swa_pages=64)
    d = Driver(cfg)
    prompt = seq(66, 7)  # 16 full pages + 2 tokens
    a, b = d.admit(prompt), d.admit(prompt)
    d.extend([a, b], [prompt, prompt])
    assert d.conservation().full.held_pages == 2 * 17
    d.unfinished(a)
    d.unfinished(b)  # dedup: b's 16 private copies of the prefix go back to the free list
    st = d.conservation()
    assert st.full.protected_pages == 16 and st.full.held_pages == 2  # one tail page each
    assert st.full.free_pages == 64 - 18
    full_free = d.cache._full.free_snapshot()
    swa_free = d.cache._swa.free_snapshot()
    for free, owned, cap in (
        (full_free, [int(v) for n in d.nodes() for v in n.vpages], 64),
        (swa_free, d.tree_swa_pages(), 64),
    ):
        assert len(set(free)) == len(free), "duplicate ids in a free list"
        assert not set(free) & set(owned), "a tree-owned page is on the free list"
        assert len(owned) == len(set(owned)), "a page is owned twice by the tree"
        assert len(free) + len(owned) <= cap
    # Both requests now read the very same tree slots, and they hold the right fingerprints.
    plan_a, plan_b = d.cache.read_plan(a), d.cache.read_plan(b)
    assert plan_a.stream(4).entry_slots.tolist() == plan_b.stream(4).entry_slots.tolist()
    d.finish(a)
    d.finish(b)
    d.cache.evict(full_tokens=cfg.full_capacity, swa_tokens=cfg.swa_capacity)
    assert sorted(d.cache._full.free_snapshot()) == list(range(64))
    assert sorted(d.cache._swa.free_snapshot()) == list(range(64))


def test_lengths_are_raw_tokens_everywhere__sgl34823() -> None:
    """sgl#34823: a page/token unit mix-up made a split position negative. Match lengths and
    node boundaries are raw tokens; eviction sizes are tokens rounded *up* to pages; capacity
    errors count pages."""
    cfg = make_config(4, full_pages=140, swa_pages=200)
    d = Driver(cfg)
    x = seq(512, 11)
    d.serve(x, chunks=(8,))
    m = d.cache.match_prefix(x[:402] + [1])
    assert (m.cached_len, m.prefix_len, m.hit_len) == (400, 400, 400)
    r = d.admit(x[:402] + [1], m)  # splits the 128-page node at token 400 = page 100
    bounds = [(n.start_page * 4, n.end_page * 4) for n in d.nodes()]
    assert bounds == [(0, 400), (400, 512)]
    assert r.length == 400
    d.finish(r)
    report = d.cache.evict(swa_tokens=5)  # 5 tokens -> 2 pages of 4
    assert (report.swa_pages, report.full_pages) == (2, 0)
    locked = d.admit(x + [1])  # everything locked: 12 full pages free, none evictable
    before = snapshot(d.cache)
    with pytest.raises(CapacityError) as err:
        d.cache.extend(locked, seq(51, 12))  # 51 tokens from 512 -> 13 pages
    assert (err.value.pool, err.value.needed_pages, err.value.available_pages) == ("full", 13, 12)
    assert snapshot(d.cache) == before


def test_out_of_window_pages_inserted_as_tombstones_on_both_paths__sgl30845_sgl36909() -> None:
    """sgl#30845, sgl#36909: pages whose window has passed are inserted as tombstones (full KV,
    no SWA) on the unfinished *and* the finished path; only the last window stays live."""
    p, n = 4, 1024
    cfg = make_config(p, full_pages=400, swa_pages=64)
    d = Driver(cfg)
    x = seq(n + 2, 13)
    r = d.admit(x)
    d.prefill(r, x, chunks=(64,) * 16)  # 1024 tokens in chunks of 64, then 2
    d.unfinished(r)
    m = d.cache.match_prefix(x)
    assert (m.cached_len, m.prefix_len, m.window) == (n, n, WindowSource.LIVE)
    [node] = d.nodes()
    assert node.num_pages == n // p
    assert node.live_from == (n - W) // p, "only the last window may stay live in the tree"
    assert len(node.swa_pages) == W // p
    st = d.conservation()
    assert st.swa.free_pages == 64 - W // p - 1  # the window + the private page of 2 tokens
    d.extend(r, seq(6, 14))  # 1032 tokens
    d.finish(r)
    nodes = d.nodes()
    assert sum(nd.num_pages for nd in nodes) == 1032 // p
    assert len(d.tree_swa_pages()) == W // p + 2  # pages 224..257: the window before 1024 on
    m = d.cache.match_prefix(x + seq(6, 14))
    assert (m.cached_len, m.prefix_len) == (1032, 1032)


def test_cache_unfinished_then_rematch_covers_insert__sgl40681() -> None:
    """sgl#40681: after `cache_unfinished`, re-matching the request's committed tokens covers
    exactly what was inserted (page-aligned), with a live window."""
    for p in (1, 4, 64):
        d = Driver(make_config(p, full_pages=2048 // p, swa_pages=1024 // p))
        x = seq(301, 15 + p)
        r = d.admit(x)
        d.prefill(r, x, chunks=(7, 100))
        d.unfinished(r)
        aligned = 301 // p * p
        m = d.cache.match_prefix(x)
        assert (m.cached_len, m.prefix_len, m.hit_len) == (aligned, aligned, aligned), p
        other = d.admit(x[:aligned] + [7])
        assert other.match.prefix_len == aligned
        d.read(other)


@pytest.mark.parametrize("pool", ["full", "swa"])
def test_exhaustion_raises_capacity_error_and_changes_nothing__freetoken204(pool: str) -> None:
    """FreeToken#204: running out of a pool rejects with a typed error naming pool and pages,
    and never half-applies a batch (snapshot identical, invariants hold, still usable)."""
    full_pages, swa_pages = (40, 100) if pool == "full" else (100, 40)
    d = Driver(make_config(4, full_pages=full_pages, swa_pages=swa_pages))
    a = d.admit(seq(100, 17))
    d.prefill(a, seq(100, 17), chunks=())  # 25 pages in each pool, window keeps all
    b = d.admit(seq(30, 18))
    d.prefill(b, seq(30, 18), chunks=())  # 8 pages in each pool: 7 left in the small one
    before = snapshot(d.cache)
    with pytest.raises(CapacityError) as err:
        d.cache.extend_batch([a, b], [seq(20, 19), seq(20, 20)])  # 5 + 5 pages per pool
    assert (err.value.pool, err.value.needed_pages, err.value.available_pages) == (pool, 10, 7)
    assert snapshot(d.cache) == before
    d.check()
    d.extend([a, b], [seq(20, 19), [2]])  # 5 + 1 pages: fits, so nothing was leaked


def test_replay_admission_exhaustion_changes_nothing__freetoken204() -> None:
    """FreeToken#204: a replayed hit whose window cannot be allocated is rejected by `admit`
    with `CapacityError` before any lock or split happens."""
    d = Driver(make_config(4, full_pages=400, swa_pages=40, bounded_replay=True))
    x = seq(512, 21)
    d.serve(x, chunks=(4,) * 128)
    d.cache.evict(swa_tokens=10**6)
    a = d.admit(seq(100, 22))
    d.prefill(a, seq(100, 22), chunks=())  # holds 25 SWA pages: 15 free, none evictable
    m = d.cache.match_prefix(x[:300] + [1])
    assert m.is_replay and m.prefix_len == 300 and m.replayed_len == W
    before = snapshot(d.cache)
    with pytest.raises(CapacityError) as err:
        d.cache.admit(x[:300] + [1], m)  # needs the 32 window pages [172, 300)
    assert (err.value.pool, err.value.needed_pages, err.value.available_pages) == ("swa", 32, 15)
    assert snapshot(d.cache) == before
    assert len(d.nodes()) == 1, "the node must not have been split"
    assert d.cache.stats().num_requests == 1


# ==========================================================================================
# Two-counter locks
# ==========================================================================================


def _hit_request(d: Driver, x: list[int]) -> Request:
    d.serve(x, chunks=(8,))
    r = d.admit(x + [5])
    assert r.match.prefix_len == len(x) // d.config.page_size * d.config.page_size
    return r


def test_double_unlock_full_receipt_raises__sgl28161() -> None:
    """sgl#28161 (double release): a FULL receipt unlocks once; the second unlock raises
    `LockError` and leaves every counter where it was (never below zero)."""
    d = Driver(make_config(4))
    r = _hit_request(d, seq(256, 21))
    [node] = d.nodes()
    assert node.full_lock_ref == 1
    receipt = r.full_receipt
    assert receipt is not None
    d.cache._locks.unlock(receipt)
    assert node.full_lock_ref == 0
    before = snapshot(d.cache)
    with pytest.raises(LockError):
        d.cache._locks.unlock(receipt)
    assert node.full_lock_ref == 0
    assert snapshot(d.cache) == before


def test_double_unlock_swa_receipt_raises__sgl24153() -> None:
    """sgl#24153 (`dec_lock_ref on node with swa_lock_ref=0`): a SWA receipt unlocks once;
    a second unlock raises `LockError` and the counter stays at zero."""
    d = Driver(make_config(4))
    r = _hit_request(d, seq(256, 22))
    [node] = d.nodes()
    assert node.swa_lock_ref == 1 and node.swa_locks == {(256 - W) // 4: 1}
    receipt = r.swa_receipt
    assert receipt is not None
    d.cache._locks.unlock(receipt)
    assert node.swa_lock_ref == 0
    before = snapshot(d.cache)
    with pytest.raises(LockError):
        d.cache._locks.unlock(receipt)
    assert node.swa_lock_ref == 0 and node.swa_locks == {}
    assert snapshot(d.cache) == before
    other = ShadowRadixCache(make_config(4))
    with pytest.raises(LockError):  # a receipt of another cache is not live there either
        other._locks.unlock(r.full_receipt)  # type: ignore[arg-type]


def test_lock_receipts_released_exactly_on_finish_and_abort__sgl24153() -> None:
    """sgl#24153: lock/unlock are mirror images: after finish and abort every node's
    counters are back to zero and no receipt is live."""
    d = Driver(make_config(4))
    x = seq(256, 23)
    a = _hit_request(d, x)
    b = d.admit(x[:200] + [9, 9])
    c = d.admit(x + [1, 2, 3, 4, 5])
    assert len(d.cache._locks) == 6
    d.finish(a)
    d.cache.abort(b)
    del d.live[b.id]
    d.extend(c, [1])
    d.finish(c)
    assert len(d.cache._locks) == 0
    assert all(n.full_lock_ref == 0 and n.swa_locks == {} for n in d.nodes())


def test_node_split_copies_both_counters__sgl36848_sgl38480() -> None:
    """sgl#36848, sgl#38480: splitting a locked node gives the new upper node the same
    full_lock_ref and the SWA lockers whose window reaches into it; unlocks stay symmetric."""
    d = Driver(make_config(4))
    x = seq(512, 24)
    r1 = _hit_request(d, x)  # locks [0,128): full 1, swa window from page 96
    [node] = d.nodes()
    assert (node.full_lock_ref, node.swa_locks) == (1, {96: 1})
    r2 = d.admit(x[:400] + [3, 3, 3])  # hit 400 tokens: split at page 100
    upper, lower = d.nodes()
    assert (upper.start_page, upper.end_page, lower.end_page) == (0, 100, 128)
    assert upper.full_lock_ref == 2 and lower.full_lock_ref == 1
    assert upper.swa_locks == {96: 1, 68: 1}, "r1's window (pages 96..) reaches into upper"
    assert lower.swa_locks == {96: 1}
    d.finish(r1)
    assert (upper.full_lock_ref, upper.swa_locks) == (1, {68: 1})
    assert (lower.full_lock_ref, lower.swa_locks) == (0, {})
    d.finish(r2)
    assert all(n.full_lock_ref == 0 and n.swa_locks == {} for n in d.nodes())


def test_locked_node_never_evicted_or_detached__sgl36848() -> None:
    """sgl#36848: full eviction never removes a node some request holds; it removes it once
    released."""
    d = Driver(make_config(4, full_pages=200, swa_pages=200))
    x = seq(256, 25)
    r = _hit_request(d, x)
    d.serve(seq(64, 26), chunks=(8,))  # an unlocked leaf
    report = d.cache.evict(full_tokens=10**6)
    assert report.nodes_removed == 1 and report.full_pages == 16
    assert d.cache.match_prefix(x).cached_len == 256
    assert [n.num_pages for n in d.nodes()] == [64]
    d.read(r)
    d.finish(r)
    assert d.cache.evict(full_tokens=10**6).full_pages == 64
    assert d.cache.match_prefix(x).cached_len == 0


def test_swa_eviction_of_full_locked_node_tombstones_not_deletes() -> None:
    """PITFALLS, two-counter locks (no tracker number; same class as sgl#24153): a node with
    full_lock > 0 and swa_lock == 0 loses its SWA to eviction but stays in the tree,
    full-locked and matchable through its compressed shadows."""
    d = Driver(make_config(4, full_pages=400, swa_pages=200))
    x = seq(512, 27)
    d.serve(x[:128], chunks=(8,))  # node A = pages [0, 32), all SWA live
    d.serve(x, chunks=(8,))  # node B = pages [32, 128), all SWA live
    r = d.admit(x + [1])  # full-locks A and B, SWA-locks only B's last 32 pages
    a_node, b_node = d.nodes()
    assert (a_node.full_lock_ref, a_node.swa_lock_ref) == (1, 0)
    assert b_node.swa_locks == {96: 1}
    report = d.cache.evict(swa_tokens=10**6)
    assert report.nodes_removed == 0 and report.full_pages == 0
    assert report.swa_pages == 32 + 64  # A's 32 and B's unprotected 64
    a_node, b_node = d.nodes()
    assert a_node.live_from == a_node.num_pages == 32, "A is a tombstone"
    assert len(b_node.swa_pages) == 32
    assert a_node.full_lock_ref == 1
    assert d.cache.match_prefix(x[:128] + [2]).cached_len == 128
    assert d.cache.match_prefix(x).cached_len == 512
    d.read(r)
    d.extend(r, [2, 3, 4])


def test_swa_held_per_request_bounded_by_window_plus_page__sgl27210() -> None:
    """sgl#27210 pinned a whole long node: a request holds at most ceil(W/P) + 1 SWA pages
    outside its newest chunk, and a hit on a long node protects only its window."""
    p = 4
    cfg = make_config(p, full_pages=600, swa_pages=300)
    d = Driver(cfg)
    assert cfg.window_pages == math.ceil(W / p) + 1 == 33
    x = seq(1000, 28)
    r = d.admit(x)
    pos = 0
    for n in (7, 13, 64, 100, 1, 3, 200, 612):
        d.extend(r, x[pos : pos + n])
        start, pos = pos, pos + n
        newest = -(-pos // p) - start // p
        outside = r.swa_held_pages() - newest
        assert outside <= cfg.window_pages, (start, pos, r.swa_held_pages())
    for t in range(10):
        d.extend(r, [t])
        assert r.swa_held_pages() - 1 <= cfg.window_pages
    d.finish(r)
    d.cache.evict(swa_tokens=10**6)
    # A long prompt served in one chunk leaves every page live in the tree ...
    y = seq(512, 29)
    d.serve(y, chunks=(8,))
    assert len(d.nodes()[-1].swa_pages) == 128
    # ... yet a request hitting it protects only its window, not the whole node.
    h = d.admit(y + [1])
    assert h.swa_held_pages() == W // p
    assert d.conservation().swa.protected_pages == W // p


def test_cache_unfinished_after_one_long_chunk_unpins_all_but_window__sgl27210() -> None:
    """sgl#27210: a prompt prefilled in one chunk holds every SWA page during that forward;
    `cache_unfinished` afterwards inserts them but keeps protecting only the window (+ the
    private partial page), leaving the rest evictable."""
    p = 4
    cfg = make_config(p, full_pages=600, swa_pages=300)
    d = Driver(cfg)
    x = seq(1026, 30)
    r = d.admit(x)
    d.extend(r, x)
    assert r.swa_held_pages() == 257  # the forward of this chunk reads all of them
    d.unfinished(r)
    assert r.swa_held_pages() == W // p + 1 <= cfg.window_pages
    st = d.conservation().swa
    assert (st.protected_pages, st.held_pages, st.evictable_pages) == (W // p, 1, 256 - W // p)
    report = d.cache.evict(swa_tokens=10**6)
    assert report.swa_pages == 256 - W // p
    m = d.cache.match_prefix(x)
    assert (m.cached_len, m.prefix_len) == (1024, 1024)
    d.extend(r, [1, 2, 3])
    d.finish(r)


# ==========================================================================================
# Matching and hit rate
# ==========================================================================================


def test_match_window_is_live_or_flagged_replay__sgl17061() -> None:
    """sgl#17061: a match ends only where the W tokens before it are live SWA; when the
    deepest window was tombstoned the match falls back to a live boundary, or (bounded
    replay) says that replay rebuilds the window."""
    for replay in (False, True):
        d = Driver(make_config(4, full_pages=400, swa_pages=300, bounded_replay=replay))
        x = seq(512, 31)
        d.serve(x[:256], chunks=(8,))  # A = [0, 64) all live
        d.serve(x, chunks=(8,))  # B = [64, 128) all live
        d.serve(x[:256] + [1, 2], chunks=(8,))  # touches A only: B is older
        report = d.cache.evict(swa_tokens=(64 + 1) * 4)  # both heads, then B's oldest tail page
        assert report.swa_pages == 65
        a_node, b_node = d.nodes()
        assert (a_node.live_from, b_node.live_from) == (32, 33)
        m = d.cache.match_prefix(x + [9])
        assert m.cached_len == 512
        if replay:
            assert m.window is WindowSource.REPLAY and m.is_replay
            assert (m.prefix_len, m.hit_len, m.replay_start) == (512, 512 - W, 512 - W)
        else:
            assert m.window is WindowSource.LIVE
            assert (m.prefix_len, m.hit_len, m.replay_start) == (256, 256, None)
        r = d.admit(x + [9], m)
        d.extend(r, [3, 4, 5])  # reads checked by the oracle
        d.finish(r)


@pytest.mark.parametrize("page", [1, 4, 64])
def test_insert_then_match_full_aligned_hit_at_any_occupancy__vllm42258_vllm48435(
    page: int,
) -> None:
    """vllm#42258, vllm#48435 (hit rate silently 0%, collapsing at ~25% occupancy): every
    inserted sequence (prompt + decoded tokens) re-matches at its full aligned length, with a
    live window, while the pool fills up."""
    full_pages = 4096 // page
    d = Driver(make_config(page, full_pages=full_pages, swa_pages=4096 // page))
    lengths = [200, 333, 129, 64, 411, 250, 700, 300, 517, 256, 190]
    prompts = [seq(n, 100 + i) for i, n in enumerate(lengths)]
    inserted = [x + [1, 2] for x in prompts]
    for i, x in enumerate(prompts):
        d.serve(x, chunks=(7,), decode=(1, 2))
        st = d.stats_checked()
        assert st.evicted.full_pages == st.evicted.swa_pages == 0
        for y in inserted[: i + 1]:
            aligned = len(y) // page * page
            m = d.cache.match_prefix(y)
            assert (m.cached_len, m.prefix_len, m.hit_len) == (aligned, aligned, aligned)
    occupancy = 1 - d.conservation().full.free_pages / full_pages
    assert occupancy > 0.75
    hits_before = d.cache.stats().hit_tokens
    for y in inserted:
        d.finish(d.admit(y + [7]))
    expected = sum(len(y) // page * page for y in inserted)
    assert d.cache.stats().hit_tokens - hits_before == expected


def test_tail_window_of_branch_evicted_last__sgl35515() -> None:
    """sgl#35515 (idle tool-call branches): SWA eviction takes the heads of nodes before any
    branch's tail window, so an idle branch's end stays live-matchable after newer branches'
    heads were evicted."""
    d = Driver(make_config(4, full_pages=400, swa_pages=250))
    stem = seq(256, 41)
    a, b = stem + seq(256, 42), stem + seq(256, 43)
    d.serve(a, chunks=(8,))  # idle branch, oldest
    d.serve(b[:264], chunks=(8,))
    d.serve(b, chunks=(8,))  # newest
    total_live = len(d.tree_swa_pages())
    tails = {n.id: min(n.num_pages, W // 4) for n in d.nodes()}
    heads = total_live - sum(tails.values())
    assert heads > 0
    report = d.cache.evict(swa_tokens=heads * 4)  # every page outside each node's last window
    assert report.swa_pages == heads
    for x in (a, b):
        m = d.cache.match_prefix(x)
        assert (m.prefix_len, m.window) == (len(x), WindowSource.LIVE), len(x)
    # A few pages more must come from the oldest tail, never from a head that is already gone.
    d.cache.evict(swa_tokens=4)
    assert d.cache.match_prefix(b).prefix_len == len(b)


def test_full_insert_does_not_depend_on_swa__sgl29351() -> None:
    """sgl#29351: with an SWA pool barely larger than one window, a long request still inserts
    every full page (compressed KV), and its end is live-matchable."""
    p = 4
    cfg = make_config(p, full_pages=300, swa_pages=W // p + 2)
    d = Driver(cfg)
    x = seq(1024, 44)
    r = d.admit(x)
    d.prefill(r, x, chunks=(4,) * 256)
    assert d.conservation().swa.free_pages == 1
    d.finish(r)
    m = d.cache.match_prefix(x)
    assert (m.cached_len, m.prefix_len) == (1024, 1024)
    assert sum(n.num_pages for n in d.nodes()) == 256


def test_swa_allocation_failure_evicts_swa_not_full__sgl29662() -> None:
    """sgl#29662 ("cache full" with 445K SWA slots evictable): when the SWA pool runs short,
    the SWA pool is evicted (tombstoning), not the full pool; and vice versa."""
    d = Driver(make_config(4, full_pages=400, swa_pages=140))
    x = seq(512, 45)
    d.serve(x, chunks=(8,))  # 128 evictable live SWA pages, 12 free
    assert d.conservation().swa.free_pages == 12
    r = d.admit(seq(100, 46))
    a = d.extend(r, seq(100, 46))  # needs 25 SWA pages: 13 must be evicted
    assert a.evicted.full_pages == 0 and a.evicted.nodes_removed == 0
    assert a.evicted.swa_pages == 13 and a.evicted.nodes_tombstoned == 1
    m = d.cache.match_prefix(x)
    assert (m.cached_len, m.prefix_len) == (512, 512), "the tail window must survive"
    d.finish(r)
    # Now the full pool: fill it so that only evicting a leaf can help.
    d2 = Driver(make_config(4, full_pages=140, swa_pages=200))
    d2.serve(x, chunks=(8,))
    r2 = d2.admit(seq(100, 47))
    a2 = d2.extend(r2, seq(100, 47))  # 25 full pages, 12 free: the leaf goes
    assert a2.evicted.full_pages == 128 and a2.evicted.nodes_removed == 1
    assert d2.cache.match_prefix(x).cached_len == 0


@pytest.mark.parametrize("page", [1, 4, 64, 256])
def test_min_hit_granularity_reported_and_achieved__vllmascend16270(page: int) -> None:
    """vllm-ascend#16270 (short prompts silently 0%): stats report the minimum hit granularity,
    and a prompt of exactly that many tokens (plus one) is reused after insertion."""
    d = Driver(make_config(page, full_pages=max(8, 1024 // page), swa_pages=max(8, 1024 // page)))
    g = d.cache.stats().min_hit_granularity
    assert g == d.config.min_hit_granularity == page
    x = seq(g, 48)
    d.serve(x, chunks=(1,))
    m = d.cache.match_prefix(x + [3])
    assert (m.cached_len, m.prefix_len, m.hit_len) == (g, g, g)
    r = d.admit(x + [3], m)
    d.extend(r, [3, 4, 5, 6])  # reads the ring rows of groups left open at g
    d.finish(r)
    assert d.cache.stats().hit_ratio == pytest.approx(g / (2 * g + 1))


def test_page_size_one_reuses_prefix_ending_mid_group__vllmascend16270() -> None:
    """vllm-ascend#16270: with page 1 a 3-token prompt is a 3-token hit (granularity is the
    page, not lcm(page, 4, 128)); the open C4 group's rows come from the tree's ring rows."""
    d = Driver(make_config(1, full_pages=512, swa_pages=512))
    d.serve([5, 6, 7], chunks=(1,))
    r = d.admit([5, 6, 7, 8, 9])
    assert r.match.hit_len == 3
    a = d.extend(r, [8, 9])
    s4 = a.stream(4)
    assert s4.entry_groups.tolist() == [0]
    assert s4.carry_positions.tolist() == [0, 1, 2]


def test_only_committed_tokens_inserted__sgl35129() -> None:
    """sgl#35129 (speculative overshoot in keys zeroed agent-session hits): inserting while a
    draft is pending inserts committed full pages only."""
    p = 4
    d = Driver(make_config(p, full_pages=200, swa_pages=200, speculative=True))
    x = seq(10, 51)
    r = d.admit(x)
    d.extend(r, x)
    drafted = seq(6, 52)
    d.draft(r, drafted)  # 16 tokens = 4 full pages, but only 10 committed
    assert r.num_committed == 10 and r.length == 16
    d.unfinished(r)
    m = d.cache.match_prefix(x + drafted)
    assert m.cached_len == 8, "draft tokens reached the tree"
    assert sum(n.num_pages for n in d.nodes()) == 2
    d.rollback(r, 6)
    d.extend(r, [1, 2])  # the real continuation: 12 tokens
    d.finish(r)
    assert d.cache.match_prefix(x + [1, 2]).cached_len == 12
    assert d.cache.match_prefix(x + drafted).cached_len == 8


# ==========================================================================================
# Rings, compression state, replay
# ==========================================================================================


@pytest.mark.parametrize("page", [4, 64])
def test_shared_prefix_requests_never_write_shared_ring_rows__sgl35494(page: int) -> None:
    """sgl#35494 (shared-prefix requests aliased one state row): requests resuming on one
    cached page write no ring row of the tree's SWA pages, and a third request still reads the
    prefix's in-flight rows intact."""
    d = Driver(make_config(page, full_pages=4096 // page, swa_pages=2048 // page))
    x = seq(192, 53)  # C128 group [128, 256) left open, C4 overlap rows 184..191
    d.serve(x, chunks=(7,))
    cfg = d.config
    shared = set(d.tree_swa_pages())
    shared_rows = {
        r: {pg * cfg.stream(r).ring_len + k for pg in shared for k in range(cfg.stream(r).ring_len)}
        for r in (4, 128)
    }
    a, b = d.admit(x + [1] * 9), d.admit(x + [2] * 9)
    assert a.match.prefix_len == b.match.prefix_len == 192 // page * page
    d.prefill(a, x + [1] * 9, chunks=(3,))
    d.prefill(b, x + [2] * 9, chunks=(5,))
    for t in range(6):
        alloc = d.extend([a, b], [[t], [t + 1]])
        for ratio in (4, 128):
            assert not set(alloc.stream(ratio).ring_rows.tolist()) & shared_rows[ratio]
        assert not set((alloc.swa_slots // page).tolist()) & shared
    for r in (a, b):
        for alloc in d.allocations[r.id]:
            for ratio in (4, 128):
                assert not set(alloc.stream(ratio).ring_rows.tolist()) & shared_rows[ratio]
    c = d.admit(x + [3])
    a4 = d.extend(c, [3, 3, 3, 3]).stream(4)  # group 48 carries the prefix's rows 188..191
    assert a4.carry_positions.tolist() == [188, 189, 190, 191]
    assert set(a4.carry_rows.tolist()) <= shared_rows[4]


def test_stale_ring_rows_never_read_after_swa_reuse__rocm_atom1417_sgl30339() -> None:
    """ROCm/ATOM#1417, sgl#30339 (stale rings corrupted output): once a cached window is
    tombstoned and its SWA pages reused by another request, a re-match must not resume there;
    every row read afterwards holds the reader's own prefix (oracle)."""
    d = Driver(make_config(4, full_pages=400, swa_pages=W // 4 + 10))
    x = seq(300, 55)
    d.serve(x, chunks=(7,) + (16,) * 19)
    old_pages = set(d.tree_swa_pages())
    assert len(old_pages) >= W // 4
    y = seq(300, 56)
    r = d.admit(y)
    d.prefill(r, y, chunks=(16,) * 19)  # steals (and overwrites) x's SWA pages
    assert old_pages & {int(s) for a in d.allocations[r.id] for s in a.swa_slots // 4}
    m = d.cache.match_prefix(x + [1])
    assert m.cached_len == 300 // 4 * 4
    assert m.prefix_len == 0 and m.window is WindowSource.NONE
    d.finish(r)
    z = d.admit(x + [1])
    d.prefill(z, x + [1], chunks=(16,) * 19)


def test_ring_rows_after_hit_carry_right_fingerprints__sgl30339() -> None:
    """sgl#30339: an oracle that tracks every write catches a read of a wrong row; here it is
    fed a deliberately wrong write to prove it can fail, then real hits pass it."""
    d = Driver(make_config(4, full_pages=400, swa_pages=200))
    x = seq(130, 57)
    d.serve(x, chunks=(7,))
    r = d.admit(x + [4, 4])
    d.extend(r, [4, 4])
    plan = d.cache.read_plan(r)
    assert plan.stream(128).inflight_positions.tolist() == [128, 129]
    assert plan.stream(4).inflight_positions.tolist() == [124, 125, 126, 127, 128, 129]
    assert len(plan.stream(128).entry_slots) == 1 and len(plan.stream(4).entry_slots) == 32
    # Sanity of the oracle itself: pretend another prefix wrote the ring row of position 128.
    bad = copy.deepcopy(d.oracle)
    row = int(plan.stream(128).inflight_rows[0])
    bad.rings[128][row] = bad.rings[128][int(plan.stream(128).inflight_rows[1])]
    with pytest.raises(OracleViolation):
        bad.check_reads(plan, d.tokens[r.id], r.id)


def test_boundary_lengths_page_one__llamacpp26063() -> None:
    """llama.cpp#26063 (diverged from token 129; C4 broke at 4): page size 1, hits ending at
    every boundary 3/4/5, 7/8/9, 127/128/129 resume with correct entries and rings."""
    d = Driver(make_config(1, full_pages=2048, swa_pages=1024))
    x = seq(140, 58)
    d.serve(x, chunks=(7,))
    for n in (3, 4, 5, 7, 8, 9, 127, 128, 129):
        r = d.admit(x[:n] + [9, 9, 9])
        assert r.match.prefix_len == n
        a = d.extend(r, [9, 9, 9])
        groups4 = [g for g in range(n // 4, (n + 3) // 4)]
        assert a.stream(4).entry_groups.tolist() == groups4
        assert a.stream(128).entry_groups.tolist() == ([0] if n < 128 <= n + 3 else [])
        d.cache.abort(r)
        del d.live[r.id]


def test_replay_flagged_bounded_and_writes_no_shared_pool__vllm56227() -> None:
    """vllm#56227 (replay is not bit-identical): a replayed hit is flagged, recomputes exactly
    the last W tokens into private SWA pages, writes no compressed entry, is counted (not as a
    hit), and its approximate rows are never read by another request."""
    p = 4
    d = Driver(make_config(p, full_pages=400, swa_pages=200, bounded_replay=True))
    x = seq(512, 59)
    d.serve(x, chunks=(8,))
    d.cache.evict(swa_tokens=10**6)  # whole window tombstoned
    tree_swa_before = d.tree_swa_pages()
    assert tree_swa_before == []
    m = d.cache.match_prefix(x + [1])
    assert m.is_replay and (m.cached_len, m.prefix_len) == (512, 512)
    assert (m.replay_start, m.replayed_len, m.hit_len) == (512 - W, W, 512 - W)
    r = d.admit(x + [1], m)
    ra = r.replay_allocation
    assert ra is not None and ra.replay
    assert ra.positions.tolist() == list(range(512 - W, 512))
    for s in ra.streams:
        assert s.entry_groups.size == 0 and s.entry_slots.size == 0
    assert not set((ra.swa_slots // p).tolist()) & set(d.tree_swa_pages())
    assert d.cache.read_plan(r).replay_start == 512 - W
    st = d.cache.stats()
    assert (st.replayed_hits, st.replayed_tokens, st.hit_tokens) == (1, W, 512 - W)
    d.extend(r, [1, 2, 3, 4, 5])  # one more full page: inserted as a leaf on finish
    d.finish(r)
    # The replayed window was not inserted as live SWA: another request cannot resume on it.
    m2 = d.cache.match_prefix(x + [1, 2, 3, 4, 5, 6])
    assert m2.cached_len == 516
    assert m2.is_replay and m2.replay_start == 516 - W
    r2 = d.admit(x + [1, 2, 3, 4, 5, 6], m2)
    d.extend(r2, [6])  # the oracle rejects any read of r's approximate rows


# ==========================================================================================
# Speculative decoding
# ==========================================================================================


@pytest.mark.parametrize("page", [4, 64, 256])
@pytest.mark.parametrize("accept", ["none", "some", "all"])
def test_rejected_draft_equals_never_drafted__vllm54360(page: int, accept: str) -> None:
    """vllm#54360: after verifying a draft, tree and pools equal a twin that extended only the
    accepted tokens; later reads (rings included) still match recomputation."""
    cfg = make_config(page, full_pages=4096 // page, swa_pages=2048 // page, speculative=True)
    d = Driver(cfg)
    x = seq(250, 60)
    d.serve(x, chunks=(7,))
    r = d.admit(x + seq(20, 61))
    d.prefill(r, x + seq(20, 61), chunks=(3,))
    for step in range(4):
        k = min(cfg.max_draft_len or 12, 12)
        drafted = seq(k, 70 + step)
        accepted = {"none": 0, "some": k // 2 + step % 2, "all": k}[accept]
        twin_cache, twin = copy.deepcopy((d.cache, r))
        alloc = d.draft(r, drafted)
        assert alloc.evicted.full_pages == alloc.evicted.swa_pages == 0
        d.rollback(r, k - accepted)
        if accepted:
            twin_cache.extend(twin, drafted[:accepted])
        assert snapshot(d.cache) == snapshot(twin_cache)
        assert r.length == twin.length and r.num_draft == 0
        d.extend(r, [step])  # the bonus token; reads checked by the oracle
    d.unfinished(r)
    d.finish(r)
