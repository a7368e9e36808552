"""Prompt lengths around every page / group boundary (llama.cpp#26063 diverged from token 129;
C4 broke at 4), for page sizes 1, 4, 64 and 256 with the real window 128 and ratios (0, 4, 128).

Per case: a cold request is admitted, prefilled in odd chunks (7, then the rest), decodes a few
tokens and finishes; later requests re-use its prefix. Every allocation is written into a
fingerprint oracle and every live request's reads are checked against it after every step; the
compressed entries a request completes must be exactly the groups it computed.
"""

from __future__ import annotations

import numpy as np
import pytest

from shadowradix import CacheConfig, Request, ShadowRadixCache, WindowSource
from shadowradix.testing import FingerprintOracle

W = 128
RATIOS = (0, 4, 128)
LENGTHS = (3, 4, 5, 7, 8, 9, 127, 128, 129, 255, 256, 257, 511, 512, 513)
PAGES = (1, 4, 64, 256)
DECODE = [900_001, 900_002, 900_003]  # token ids no prompt or suffix uses
SUFFIX = [800_001, 800_002, 800_003, 800_004, 800_005]


def make_config(page: int) -> CacheConfig:
    capacity = 4096 // page * page  # tokens, whole pages: room for every request of a case
    return CacheConfig(
        page_size=page,
        window=W,
        compress_ratios=RATIOS,
        overlap_ratios=(4,),
        full_capacity=capacity,
        swa_capacity=capacity,
    )


class Driver:
    """One cache, one oracle, the token lists mirrored here, every allocation kept."""

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.cache = ShadowRadixCache(config)
        self.oracle = FingerprintOracle(config)
        self.tokens: dict[int, list[int]] = {}
        self.entries: dict[int, dict[int, list[int]]] = {}
        self.live: dict[int, Request] = {}

    def admit(self, prompt: list[int]) -> Request:
        m = self.cache.match_prefix(prompt)
        r = self.cache.admit(prompt, m)
        self.tokens[r.id] = list(prompt[: m.prefix_len])
        self.entries[r.id] = {ratio: [] for ratio in self.config.ratios}
        self.live[r.id] = r
        self.check()
        return r

    def extend(self, r: Request, toks: list[int]) -> None:
        a = self.cache.extend(r, toks)
        self.tokens[r.id] += toks
        assert a.positions.tolist() == list(
            range(len(self.tokens[r.id]) - len(toks), len(self.tokens[r.id]))
        )
        self.oracle.write(a, {r.id: self.tokens[r.id]})
        for s in a.streams:
            assert set(s.entry_request.tolist()) <= {0}
            self.entries[r.id][s.ratio] += s.entry_groups.tolist()
        self.check()

    def run(
        self,
        r: Request,
        prompt: list[int],
        first_chunk: int,
        decode: list[int],
        checkpoint: bool = False,
    ) -> None:
        """Prefill the rest of ``prompt`` as ``first_chunk`` tokens then the remainder
        (``checkpoint``: then `cache_unfinished`, as an engine does after the last prefill
        chunk), then decode ``decode`` one token at a time."""
        pos = r.length
        if pos < len(prompt):
            self.extend(r, prompt[pos : pos + first_chunk])
        if pos + first_chunk < len(prompt):
            self.extend(r, prompt[pos + first_chunk :])
        if checkpoint:
            self.cache.cache_unfinished(r)
            self.check()
        for t in decode:
            self.extend(r, [t])

    def finish(self, r: Request) -> None:
        self.cache.finish(r)
        del self.live[r.id]
        self.check()

    def check(self) -> None:
        self.cache.check_invariants()
        st = self.cache.stats()
        for pool in (st.full, st.swa):
            total = pool.free_pages + pool.evictable_pages + pool.protected_pages + pool.held_pages
            assert total == pool.capacity_pages, pool
        for r in self.live.values():
            plan = self.cache.read_plan(r)
            n = len(self.tokens[r.id])
            assert plan.length == n
            assert len(plan.stream(4).entry_slots) == n // 4
            assert len(plan.stream(128).entry_slots) == n // 128
            assert plan.swa_positions.tolist() == list(range(max(0, n - W), n))
            self.oracle.check_reads(plan, self.tokens[r.id], r.id)

    def assert_entries(self, r: Request, first_len: int) -> None:
        """The request completed exactly the groups between its resume point and its end."""
        n = len(self.tokens[r.id])
        for ratio in (4, 128):
            assert self.entries[r.id][ratio] == list(range(first_len // ratio, n // ratio)), ratio


def prompt_of(length: int, page: int) -> list[int]:
    return np.random.default_rng(1000 * length + page).integers(0, 50_000, length).tolist()


def kept_window_start(page: int, released_at: int) -> int:
    """First token whose SWA a finished request leaves live in the tree, per the documented
    policy (`_release_window`): the pages intersecting ``[F - W, ...)``, ``F`` the last page
    boundary at or before the start of its last step."""
    last_boundary = released_at // page * page
    return max(0, last_boundary - W) // page * page


@pytest.mark.parametrize("checkpoint", [True, False], ids=["checkpoint", "finish_only"])
@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("length", LENGTHS)
def test_prompt_boundary_roundtrip(length: int, page: int, checkpoint: bool) -> None:
    """Cold request, its continuation, and the same prompt with another suffix.

    ``checkpoint``: the cold request is cached unfinished right after its prefill, so the
    prompt's own end keeps a live window and the same prompt with another suffix reuses its
    whole aligned prefix. Without it only the window before the last boundary at finish is
    kept (DESIGN §3: a long request keeps one window), and the prompt's end is reusable only
    if that window still covers it."""
    d = Driver(make_config(page))
    prompt = prompt_of(length, page)

    # 1. cold: admit, prefill 7 + rest, (cache_unfinished), decode 3, finish
    cold = d.admit(prompt)
    assert (cold.match.cached_len, cold.match.prefix_len) == (0, 0)
    d.run(cold, prompt, 7, DECODE, checkpoint)
    first = list(d.tokens[cold.id])
    assert len(first) == length + len(DECODE)
    d.assert_entries(cold, 0)
    assert d.entries[cold.id][4] == list(range(len(first) // 4))
    assert d.entries[cold.id][128] == list(range(len(first) // 128))
    d.finish(cold)
    inserted = len(first) // page * page

    # 2. continuation (prompt + what was decoded + suffix): the whole inserted prefix, live
    cont_prompt = first + SUFFIX
    m = d.cache.match_prefix(cont_prompt)
    assert (m.cached_len, m.prefix_len, m.hit_len) == (inserted, inserted, inserted)
    assert m.window is (WindowSource.LIVE if inserted else WindowSource.NONE)
    cont = d.admit(cont_prompt)
    d.run(cont, cont_prompt, 3, [700_001, 700_002])
    d.assert_entries(cont, inserted)
    d.finish(cont)

    # 3. the same prompt plus a suffix: the aligned prompt prefix is cached; it resumes there
    #    if the window before it is live (checkpointed, or still covered by the window the
    #    cold request kept at finish), else from scratch (no earlier boundary is live either)
    same_prompt = prompt + SUFFIX
    aligned = length // page * page
    kept = kept_window_start(page, len(first) - 1)
    expected = aligned if checkpoint or max(0, aligned - W) >= kept else 0
    m = d.cache.match_prefix(same_prompt)
    assert m.cached_len == aligned
    assert (m.prefix_len, m.hit_len) == (expected, expected)
    same = d.admit(same_prompt)
    d.run(same, same_prompt, 3, [600_001, 600_002])
    d.assert_entries(same, expected)
    d.finish(same)

    # 4. after all three, every inserted sequence is still fully matchable, live at its end
    for seq_ in (first, d.tokens[cont.id], d.tokens[same.id]):
        n = len(seq_) // page * page
        m = d.cache.match_prefix(seq_)
        assert (m.cached_len, m.prefix_len) == (n, n)
    st = d.cache.stats()
    assert st.evicted.full_pages == st.evicted.swa_pages == 0
    assert st.hit_tokens == inserted + expected


@pytest.mark.parametrize("page", PAGES)
def test_shared_prefix_concurrent_at_every_boundary(page: int) -> None:
    """Two requests resume on one cached prefix at each boundary length and decode in one
    batch; both read only rows their own prefix produced."""
    d = Driver(make_config(page))
    base = prompt_of(600, page)
    d.run(d.admit(base), base, 7, [])
    d.finish(next(iter(d.live.values())))
    for length in LENGTHS:
        a = d.admit(base[:length] + [1, 2, 3])
        b = d.admit(base[:length] + [4, 5, 6])
        assert a.match.prefix_len == b.match.prefix_len == length // page * page
        start = a.length
        d.run(a, base[:length] + [1, 2, 3], 1, [])
        d.run(b, base[:length] + [4, 5, 6], 2, [])
        for t in range(3):
            alloc = d.cache.extend_batch([a, b], [[t], [t + 10]])
            d.tokens[a.id].append(t)
            d.tokens[b.id].append(t + 10)
            d.oracle.write(alloc, {a.id: d.tokens[a.id], b.id: d.tokens[b.id]})
            d.check()
        for r in (a, b):
            d.cache.abort(r)
            del d.live[r.id]
        assert start == length // page * page


def _allocation_fields(a: object) -> list[object]:
    """Every array of an `Allocation` (and its streams) as plain lists, for comparison
    (request ids differ between two caches; streams index requests by batch position)."""
    out: list[object] = [len(a.request_ids), a.evicted, a.replay]  # type: ignore[attr-defined]
    for name in ("token_offsets", "positions", "virtual_slots", "swa_slots"):
        out.append(getattr(a, name).tolist())
    for s in a.streams:  # type: ignore[attr-defined]
        out.append((s.ratio, *(getattr(s, f).tolist() for f in STREAM_ARRAYS)))
    return out


STREAM_ARRAYS = (
    "ring_request",
    "ring_positions",
    "ring_rows",
    "carry_request",
    "carry_positions",
    "carry_rows",
    "entry_request",
    "entry_groups",
    "entry_slots",
)


@pytest.mark.parametrize("page", PAGES)
def test_batched_decode_across_boundaries_equals_general_extend(page: int) -> None:
    """Decoding one token per request (the batched-decode path) across every page and group
    boundary plans exactly what the general multi-token path plans for the same step."""
    d = Driver(make_config(page))
    base = prompt_of(600, page)
    d.run(d.admit(base), base, 7, [])
    d.finish(next(iter(d.live.values())))
    twin = Driver(make_config(page))
    twin.run(twin.admit(base), base, 7, [])
    twin.finish(next(iter(twin.live.values())))
    pairs = []
    for length in (3, 127, 128, 255, 257, 511):
        ours, theirs = d.admit(base[:length] + [1]), twin.admit(base[:length] + [1])
        for drv, r in ((d, ours), (twin, theirs)):
            if r.length == 0:
                drv.extend(r, [1])
        pairs.append((ours, theirs))
    rng = np.random.default_rng(page)
    for step in range(140):
        chosen = [pair for pair in pairs if rng.random() < 0.7] or pairs[:1]
        toks = [int(rng.integers(0, 50_000)) for _ in chosen]
        fast = d.cache.extend_batch([o for o, _ in chosen], [[t] for t in toks])
        general = twin.cache.extend_batch(
            [t for _, t in chosen], [np.array([t], dtype=np.int64) for t in toks]
        )
        assert _allocation_fields(fast) == _allocation_fields(general), step
        for (o, t), tok in zip(chosen, toks):
            d.tokens[o.id].append(tok)
            twin.tokens[t.id].append(tok)
        d.oracle.write(fast, {o.id: d.tokens[o.id] for o, _ in chosen})
        twin.oracle.write(general, {t.id: twin.tokens[t.id] for _, t in chosen})
    d.check()
    twin.check()
