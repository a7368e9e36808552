"""`NaivePrefixCache` on its own, under pressure (the protocol machine never fills its pool).

A model-based machine over 2-8 pages: matches return only inserted prefixes, locked prefixes
(running requests' cached parts, explicit locks) stay matchable through eviction, a refused
``extend`` changes nothing and agrees with ``can_extend``. Recency is shown on both protocol
implementations: the least recently used unlocked prefix goes first.
"""

from __future__ import annotations

import pytest
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
)

from shadowradix import CacheConfig, CapacityError, ShadowRadixCache
from shadowradix.integrations.naive import NaivePrefixCache, NaiveRequest
from shadowradix.integrations.protocol import PrefixCache, PrefixLock
from shadowradix.integrations.radix import ShadowRadixPrefixCache

ALPHABET = 2


class NaiveMachine(RuleBasedStateMachine):
    requests = Bundle("requests")
    locks = Bundle("locks")

    @initialize(page=st.sampled_from((1, 2, 4)), pages=st.integers(2, 8))
    def setup(self, page: int, pages: int) -> None:
        self.p = page
        self.cache = NaivePrefixCache(page, pages)
        self.inserted: set[tuple[object, tuple[int, ...]]] = set()
        self.live: set[NaiveRequest] = set()
        self.held: dict[int, tuple[object, list[int]]] = {}

    def _record(self, r: NaiveRequest) -> None:
        for k in range(self.p, r.length // self.p * self.p + 1, self.p):
            self.inserted.add((r.namespace, tuple(r.tokens[:k])))

    @rule(target=requests, prompt=st.lists(st.integers(0, ALPHABET - 1), min_size=1,
                                           max_size=12), ns=st.sampled_from((None, 1)))  # fmt: skip
    def admit(self, prompt: list[int], ns: object) -> NaiveRequest:
        hit = self.cache.match(prompt, len(prompt) - 1, namespace=ns)
        assert hit.hit_len == 0 or (ns, tuple(prompt[: hit.hit_len])) in self.inserted
        r = self.cache.admit(prompt, hit)
        self.live.add(r)
        return r

    @rule(r=requests, size=st.integers(1, 9))
    def extend(self, r: NaiveRequest, size: int) -> None:
        if r not in self.live:
            return
        chunk = (r.prompt[r.length :] or [size % ALPHABET])[:size]
        fits, before = self.cache.can_extend(r, len(chunk)), self.cache.snapshot()
        try:
            self.cache.extend(r, chunk)
        except CapacityError as err:
            note(f"refused: {err}")
            assert not fits and self.cache.snapshot() == before
            return
        assert fits

    @rule(r=requests)
    def cache_unfinished(self, r: NaiveRequest) -> None:
        if r in self.live:
            self.cache.cache_unfinished(r)
            self._record(r)

    @rule(r=consumes(requests), insert=st.booleans())
    def release(self, r: NaiveRequest, insert: bool) -> None:
        if r not in self.live:
            return
        if insert:
            self.cache.finish(r)
            self._record(r)
        else:
            self.cache.abort(r)
        self.live.remove(r)

    @rule(target=locks, prompt=st.lists(st.integers(0, ALPHABET - 1), min_size=1, max_size=12),
          ns=st.sampled_from((None, 1)))  # fmt: skip
    def lock(self, prompt: list[int], ns: object):  # type: ignore[no-untyped-def]
        lock = self.cache.lock(prompt, namespace=ns)
        if not lock.tokens:
            self.cache.unlock(lock)
            return multiple()
        self.held[lock.id] = (ns, prompt[: lock.tokens])
        return lock

    @rule(lock=consumes(locks))
    def unlock(self, lock: PrefixLock) -> None:
        self.cache.unlock(lock)
        del self.held[lock.id]

    @rule(num_tokens=st.integers(0, 12))
    def evict(self, num_tokens: int) -> None:
        evictable = self.cache.sizes().evictable_tokens
        freed = self.cache.evict(num_tokens)
        wanted = -(-num_tokens // self.p) * self.p
        assert min(wanted, evictable) <= freed <= evictable and freed % self.p == 0

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.cache.check_invariants()
        sizes = self.cache.sizes()
        assert sizes.free_tokens + sizes.cached_tokens + sizes.held_tokens == sizes.capacity_tokens
        locked = [(r.namespace, r.tokens[: r.tree_pages * self.p]) for r in self.live]
        for ns, tokens in locked + list(self.held.values()):
            if tokens:
                assert self.cache.match(tokens, namespace=ns).cached_len == len(tokens)


TestNaiveMachine = NaiveMachine.TestCase
TestNaiveMachine.settings = settings(
    settings.default, max_examples=max(10, settings.default.max_examples // 3)
)


def _implementations() -> list[PrefixCache[object]]:
    config = CacheConfig(page_size=2, window=4, compress_ratios=(0, 2), overlap_ratios=(2,),
                         full_capacity=2 * 16, swa_capacity=2 * 16)  # fmt: skip
    return [ShadowRadixPrefixCache(ShadowRadixCache(config)), NaivePrefixCache(2, 16)]  # type: ignore[list-item]


@pytest.mark.parametrize("cache", _implementations(), ids=["shadowradix", "naive"])
def test_least_recently_used_prefix_goes_first(cache: PrefixCache[object]) -> None:
    a, b = [1, 1, 1, 1, 9], [2, 2, 2, 2, 9]
    for prompt in (a, b, a):  # a is used again after b: b is the older
        r = cache.admit(prompt)
        cache.extend(r, prompt[r.length :])  # type: ignore[attr-defined]
        cache.finish(r)
    assert cache.evict(2) >= 2
    assert cache.match(b).cached_len < 4 and cache.match(a).cached_len == 4


@pytest.mark.parametrize("cache", _implementations(), ids=["shadowradix", "naive"])
def test_an_empty_hit_stays_usable_after_the_cache_changed(cache: PrefixCache[object]) -> None:
    hit = cache.match([5], 0)  # a one-token prompt: nothing to match
    other = cache.admit([1, 2, 3, 4, 9])
    cache.extend(other, [1, 2, 3, 4, 9])  # type: ignore[attr-defined]
    cache.finish(other)  # the cache changed since the hit
    r = cache.admit([5], hit)
    assert cache.extend(r, [5]) and cache.page_table(r)


def test_check_invariants_fires_on_corrupted_state() -> None:
    """Both implementations of the protocol's checker fire: the naive one on a page both free
    and in use and on a wrong lock count, the core-backed one through the core's checker."""
    from shadowradix import InvariantError

    naive = NaivePrefixCache(2, 16)
    req = naive.admit([1, 2, 3, 4, 5])
    naive.extend(req, [1, 2, 3, 4, 5])
    naive.cache_unfinished(req)
    naive.check_invariants()
    naive._free.append(req.pages[0])  # a page both free and in use
    with pytest.raises(InvariantError, match="both free and in use"):
        naive.check_invariants()
    naive._free.pop()
    page = naive._pages[req.pages[0]]
    page.locks += 1
    with pytest.raises(InvariantError, match="lock count"):
        naive.check_invariants()
    page.locks -= 1
    naive.check_invariants()
    config = CacheConfig(page_size=2, window=8, compress_ratios=(0, 4), overlap_ratios=(4,),
                         full_capacity=32, swa_capacity=32, debug=True)  # fmt: skip
    core = ShadowRadixCache(config)
    shim = ShadowRadixPrefixCache(core)
    shim.check_invariants()
    core._full._free.append(core._full._free[-1])  # a duplicate free page
    with pytest.raises(InvariantError):
        shim.check_invariants()
