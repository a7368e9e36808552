"""The `PrefixCache` protocol: `ShadowRadixPrefixCache` and `NaivePrefixCache` side by side.

One Hypothesis machine drives both through the same calls and asserts how their answers
relate. The relationship follows from docs/design.md:

* Both hold the same full-token prefixes. They insert the same whole committed pages
  (design.md §8: only whole pages, committed tokens), and the full pool is sized so that
  shadowradix never evicts it; the naive cache, holding the same prefixes and no more private
  pages, never evicts either. So ``cached_len`` agrees for every query, and so do the pool
  sizes (free, evictable, protected, held tokens) after every step.
* shadowradix may resume earlier: a match ends where the preceding ``window`` tokens are live
  SWA (§6), and SWA is tombstoned by SWA eviction (§7) or entered the tree tombstoned where a
  request had already released it (§5, Known limits). So ``hit_len <= cached_len == naive
  hit``, page-aligned.
* Exact where the window is intact: right after a request's committed pages are inserted
  (``cache_unfinished`` or ``finish``), re-matching them gives the full aligned hit with a live
  window (§5: a request holds ``[F - W, ...)``), and that stays so while no SWA page has been
  evicted since (SWA leaves the tree only by eviction; inserting only adds or revives).
* To keep the two in lockstep, each admission resumes both at shadowradix's point (the naive
  hit is taken with ``max_len`` = that point, which it holds): the two requests then have the
  same tokens, lengths, inserts and locks. shadowradix can refuse an ``extend`` for lack of SWA
  (``CapacityError("swa")``, leaving its state unchanged); the naive cache is then not called.
* Bad input raises the same `shadowradix.errors` type in both and leaves both unchanged.

Eviction order is not compared beyond "evict everything": shadowradix evicts whole nodes, the
naive cache single pages, so partial evictions legitimately free different prefixes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import event, note, settings
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

from shadowradix import CacheConfig, CapacityError, ShadowRadixCache
from shadowradix.errors import InvalidRequestError, LockError, ShadowRadixError
from shadowradix.integrations.naive import NaivePrefixCache
from shadowradix.integrations.protocol import PrefixCache, PrefixLock
from shadowradix.integrations.radix import ShadowRadixPrefixCache
from shadowradix.testing import cache_configs, snapshot

ALPHABET = 3
FULL_PAGES = 1024  # never evicted by a run of the machine
NAMESPACES = (None, "tenant-b")
BAD_TOKENS = ([], [-1, 2], [1.5], "ab", [[1, 2]], None, np.zeros((2, 2), dtype=np.int64))
Call = Callable[[Any, Any], object]


@dataclasses.dataclass(eq=False)
class Pair:
    """One logical request, run by both caches."""

    sr: object
    nv: object
    prompt: list[int]
    namespace: object
    tokens: list[int]  # what both have computed


@dataclasses.dataclass(eq=False)
class LockPair:
    sr: PrefixLock
    nv: PrefixLock


def big_full_pool(config: CacheConfig) -> CacheConfig:
    size = FULL_PAGES * config.page_size
    return dataclasses.replace(config, full_capacity=size, max_full_capacity=size)


class ProtocolMachine(RuleBasedStateMachine):
    pairs = Bundle("pairs")
    locks = Bundle("locks")

    @initialize(config=cache_configs(speculative=False, replay=False), seed=st.integers(0, 2**16))
    def setup(self, config: CacheConfig, seed: int) -> None:
        self.config = big_full_pool(config)
        self.p = self.config.page_size
        self.sr = ShadowRadixPrefixCache(ShadowRadixCache(self.config))
        self.nv = NaivePrefixCache(self.p, FULL_PAGES)
        rng = np.random.default_rng(seed)
        stem_len = 4 * self.p + self.config.window + 8
        self.stems = [rng.integers(0, ALPHABET, stem_len).tolist() for _ in range(3)]
        self.live: set[Pair] = set()
        self.held: set[LockPair] = set()
        self.done: list[Pair] = []  # finished or aborted: no longer usable
        self.released: list[LockPair] = []
        self.exact: list[tuple[object, list[int], int]] = []  # (ns, aligned seq, swa evicted)
        note(f"config={self.config}")

    # -- helpers -------------------------------------------------------------------------

    def _prompt(self, stem: int, cut: int, tail: list[int]) -> list[int]:
        base = self.stems[stem]
        return (base[: cut % (len(base) + 1)] + tail) or [0]

    def _swa_evicted(self) -> int:
        return self.sr.cache.stats().evicted.swa_pages

    def _compare(self, tokens: list[int], namespace: object, max_len: int | None = None) -> int:
        s = self.sr.match(tokens, max_len, namespace=namespace)
        n = self.nv.match(tokens, max_len, namespace=namespace)
        assert n.hit_len == n.prefix_len == n.cached_len, "the naive cache has no window rule"
        assert s.cached_len == n.cached_len, f"both hold the prefix: {s} vs {n}"
        assert s.hit_len == s.prefix_len <= s.cached_len and s.prefix_len % self.p == 0, s
        if s.cached_len:
            event("match: window-shortened hit" if s.hit_len < s.cached_len else "match: full hit")
        return s.hit_len

    def _inserted(self, pair: Pair) -> None:
        full = len(pair.tokens) // self.p * self.p
        if full:
            seq = pair.tokens[:full]
            assert self._compare(seq, pair.namespace) == full, "an insert is a full live hit"
            self.exact.append((pair.namespace, seq, self._swa_evicted()))

    # -- rules ---------------------------------------------------------------------------

    @rule(
        target=pairs,
        stem=st.integers(0, 2),
        cut=st.integers(0, 10**6),
        tail=st.lists(st.integers(0, ALPHABET - 1), max_size=6),
        ns=st.sampled_from(NAMESPACES),
    )
    def admit(self, stem: int, cut: int, tail: list[int], ns: object) -> Pair:
        prompt = self._prompt(stem, cut, tail)
        self._compare(prompt, ns)
        s_hit = self.sr.match(prompt, len(prompt) - 1, namespace=ns)
        n_hit = self.nv.match(prompt, s_hit.prefix_len, namespace=ns)
        assert n_hit.prefix_len == s_hit.prefix_len
        pair = Pair(self.sr.admit(prompt, s_hit), self.nv.admit(prompt, n_hit), prompt, ns,
                    prompt[: s_hit.prefix_len])  # fmt: skip
        note(f"admit: {len(prompt)} tokens in {ns!r}, resume at {s_hit.prefix_len}")
        self.live.add(pair)
        return pair

    @rule(
        stem=st.integers(0, 2),
        cut=st.integers(0, 10**6),
        tail=st.lists(st.integers(0, ALPHABET - 1), max_size=6),
        ns=st.sampled_from(NAMESPACES),
        decode=st.lists(st.integers(0, ALPHABET - 1), max_size=6),
        publish=st.booleans(),
    )
    def serve(self, stem: int, cut: int, tail: list[int], ns: object, decode: list[int],
              publish: bool) -> None:  # fmt: skip
        """A whole request: prefill (publishing it after the last chunk, as engines should),
        decode, finish; so that later requests hit."""
        pair = self.admit(stem, cut, tail, ns)
        while len(pair.tokens) < len(pair.prompt) and self._step(pair, self.p + 1, 0):
            pass
        if publish:
            self.cache_unfinished(pair)
        for tok in decode:
            if not self._step(pair, 1, tok):
                break
        self.finish(pair)

    @rule(pair=pairs, size=st.integers(1, 40), tok=st.integers(0, ALPHABET - 1))
    def compute(self, pair: Pair, size: int, tok: int) -> None:
        if pair in self.live:
            self._step(pair, size, tok)

    def _step(self, pair: Pair, size: int, tok: int) -> bool:
        """A prefill chunk while prompt tokens remain, else one decoded token."""
        rest = pair.prompt[len(pair.tokens) :]
        chunk = rest[: size % (2 * self.p + 3) + 1] if rest else [tok]
        fits = self.sr.can_extend(pair.sr, len(chunk))
        before = snapshot(self.sr.cache)
        try:
            s_pages = self.sr.extend(pair.sr, chunk)
        except CapacityError as err:
            assert not fits and snapshot(self.sr.cache) == before, "a refusal changed the cache"
            event(f"sr refused an extend ({err.pool})")
            note(f"sr refused {len(chunk)} tokens: {err}")
            return
        assert fits, "can_extend said no, extend went through"
        assert self.nv.can_extend(pair.nv, len(chunk))
        n_pages = self.nv.extend(pair.nv, chunk)
        assert len(s_pages) == len(n_pages)
        pair.tokens += chunk
        return True

    @rule(pair=pairs)
    def cache_unfinished(self, pair: Pair) -> None:
        if pair not in self.live:
            return
        self.sr.cache_unfinished(pair.sr)
        self.nv.cache_unfinished(pair.nv)
        self._inserted(pair)

    @rule(pair=consumes(pairs))
    def finish(self, pair: Pair) -> None:
        if pair not in self.live:
            return
        self.sr.finish(pair.sr)
        self.nv.finish(pair.nv)
        self.live.remove(pair)
        self.done.append(pair)
        self._inserted(pair)

    @rule(pair=consumes(pairs))
    def abort(self, pair: Pair) -> None:
        if pair not in self.live:
            return
        self.sr.abort(pair.sr)
        self.nv.abort(pair.nv)
        self.live.remove(pair)
        self.done.append(pair)

    @rule(target=locks, stem=st.integers(0, 2), cut=st.integers(0, 10**6),
          ns=st.sampled_from(NAMESPACES))  # fmt: skip
    def lock(self, stem: int, cut: int, ns: object):
        tokens = self._prompt(stem, cut, [])
        s = self.sr.lock(tokens, namespace=ns)
        if s.tokens == 0:  # nothing live to lock (the naive cache may still hold the pages)
            self.sr.unlock(s)
            return multiple()
        n = self.nv.lock(tokens[: s.tokens], namespace=ns)  # lockstep, as admit
        assert n.tokens == s.tokens
        locked = LockPair(s, n)
        self.held.add(locked)
        return locked

    @rule(locked=consumes(locks))
    def unlock(self, locked: LockPair) -> None:
        self.sr.unlock(locked.sr)
        self.nv.unlock(locked.nv)
        self.held.remove(locked)
        self.released.append(locked)

    @rule(stem=st.integers(0, 2), cut=st.integers(0, 10**6),
          tail=st.lists(st.integers(0, ALPHABET - 1), max_size=6),
          ns=st.sampled_from(NAMESPACES), max_len=st.none() | st.integers(0, 300))  # fmt: skip
    def query(self, stem: int, cut: int, tail: list[int], ns: object, max_len: int | None) -> None:
        self._compare(self._prompt(stem, cut, tail), ns, max_len)

    @precondition(lambda self: self.exact)
    @rule(pick=st.integers(0, 10**6))
    def rematch_inserted(self, pick: int) -> None:
        ns, seq, evicted_then = self.exact[pick % len(self.exact)]
        hit = self._compare(seq, ns)
        if self._swa_evicted() == evicted_then:
            assert hit == len(seq), f"window intact, yet a {hit}-token hit of {len(seq)}"
            event("rematch: window intact")
        else:
            event("rematch: SWA evicted since" + (" (hit shortened)" if hit < len(seq) else ""))

    @precondition(lambda self: not self.live and not self.held)
    @rule()
    def evict_all(self) -> None:
        freed = self.sr.evict(10**9), self.nv.evict(10**9)
        assert freed[0] == freed[1] and self.sr.sizes().cached_tokens == 0, freed
        self.exact.clear()

    @precondition(lambda self: not self.live and not self.held)
    @rule()
    def reset(self) -> None:
        self.sr.reset()
        self.nv.reset()
        self.exact.clear()

    # -- bad input -----------------------------------------------------------------------

    def _both_refuse(self, call: Call, expected: type[ShadowRadixError]) -> None:
        """``call(impl, other)`` raises ``expected`` on both, changing neither."""
        before = snapshot(self.sr.cache), self.nv.snapshot()
        for impl, other in ((self.sr, self.nv), (self.nv, self.sr)):
            try:
                call(impl, other)
            except ShadowRadixError as err:
                assert type(err) is expected, f"{type(impl).__name__}: {err!r}"
            else:
                raise AssertionError(f"{type(impl).__name__} accepted bad input")
        assert (snapshot(self.sr.cache), self.nv.snapshot()) == before, "bad input changed state"

    def _mine(self, item: Pair | LockPair) -> Callable[[object], Any]:
        """``item``'s handle in a given cache."""
        return lambda c: item.sr if c is self.sr else item.nv

    def _bad_calls(self, pick: int) -> dict[str, tuple[Call, type[ShadowRadixError]]]:
        bad = InvalidRequestError
        calls: dict[str, tuple[Call, type[ShadowRadixError]]] = {
            f"{verb}({tokens!r})": (lambda c, _, v=verb, t=tokens: getattr(c, v)(t), bad)
            for verb in ("match", "admit", "lock")
            for tokens in BAD_TOKENS
        }
        calls |= {
            "max_len=-1": (lambda c, _: c.match([1, 2], -1), bad),
            "max_len=True": (lambda c, _: c.match([1, 2], True), bad),
            "max_len=1.5": (lambda c, _: c.match([1, 2], 1.5), bad),
            "namespace=[]": (lambda c, _: c.match([1, 2], namespace=[]), bad),
            "evict(-1)": (lambda c, _: c.evict(-1), bad),
            "foreign hit": (lambda c, o: c.admit(self.stems[0], o.match(self.stems[0])), bad),
        }
        if self.live or self.held:
            calls["reset while in use"] = (lambda c, _: c.reset(), bad)
        if self.live:
            mine = self._mine(sorted(self.live, key=id)[pick % len(self.live)])
            calls |= {
                "extend([])": (lambda c, _: c.extend(mine(c), []), bad),
                "foreign request": (lambda c, o: c.extend(mine(o), [1]), bad),
                "can_extend(0)": (lambda c, _: c.can_extend(mine(c), 0), bad),
            }
        if self.done:
            gone = self._mine(self.done[pick % len(self.done)])
            for verb in ("extend", "cache_unfinished", "finish", "abort", "page_table"):
                args = ([1],) if verb == "extend" else ()
                calls[f"{verb} finished"] = (
                    lambda c, _, v=verb, a=args: getattr(c, v)(gone(c), *a), bad)  # fmt: skip
        if self.released:
            lock = self._mine(self.released[pick % len(self.released)])
            calls["double unlock"] = (lambda c, _: c.unlock(lock(c)), LockError)
        return calls

    @rule(kind=st.integers(0, 10**6), pick=st.integers(0, 10**6))
    def bad_input(self, kind: int, pick: int) -> None:
        calls = self._bad_calls(pick)
        name = sorted(calls)[kind % len(calls)]
        note(f"bad input: {name}")
        self._both_refuse(*calls[name])

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def agree(self) -> None:
        if not hasattr(self, "sr"):
            return
        self.sr.check_invariants()
        self.nv.check_invariants()
        assert self.sr.sizes() == self.nv.sizes(), (self.sr.sizes(), self.nv.sizes())
        for pair in self.live:
            assert pair.sr.length == pair.nv.length == len(pair.tokens)
            assert len(self.sr.page_table(pair.sr)) == len(self.nv.page_table(pair.nv))


def test_both_implement_the_protocol() -> None:
    config = CacheConfig(page_size=4, window=8, compress_ratios=(0, 4), overlap_ratios=(4,),
                         full_capacity=64, swa_capacity=32)  # fmt: skip
    caches: list[PrefixCache[object]] = [
        ShadowRadixPrefixCache(ShadowRadixCache(config)),  # type: ignore[list-item]
        NaivePrefixCache(4, 16),  # type: ignore[list-item]
    ]
    for cache in caches:
        r = cache.admit(list(range(9)))
        cache.extend(r, list(range(9)))
        cache.finish(r)
        assert cache.match(list(range(9))).hit_len == 8
        assert cache.sizes().cached_tokens == 8


TestProtocolMachine = ProtocolMachine.TestCase
# two caches per step: a third of the profile's examples keeps the file within seconds
TestProtocolMachine.settings = settings(
    settings.default, max_examples=max(10, settings.default.max_examples // 3)
)
