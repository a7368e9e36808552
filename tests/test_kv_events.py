"""KV events (`ShadowRadixCache(config, kv_events=True)`, `take_events`): replayed into a
shadow table after every operation of random workloads, they reproduce the tree's pages exactly
— which virtual pages it holds, each page's chained token hash, and which pages have live SWA
(and with which SWA page) — and every running request's tree page table."""

from __future__ import annotations

import random

import numpy as np
import pytest

from shadowradix import CacheConfig, CapacityError, ConfigError, KvEventKind, ShadowRadixCache
from shadowradix.events import ROOT_HASH, page_hashes

P = 4
CFG = dict(page_size=P, window=8, compress_ratios=(4, 0), overlap_ratios=(4,),
           full_capacity=160, swa_capacity=64)  # fmt: skip


class Shadow:
    """What a connector keeps: virtual page -> token hash, virtual page -> live SWA page. It also
    checks what a stateless consumer relies on: an INSERTED or REVIVED event's hashes follow
    from its ``parent_hash`` and ``token_ids`` alone, and that parent is the hash of the page
    before (the seed at a root); removals name the hashes stored; FREED pages are not the
    tree's."""

    def __init__(self) -> None:
        self.hash: dict[int, int] = {}
        self.swa: dict[int, int] = {}
        self.freed: set[int] = set()  # virtual pages reported FREED

    def _check_chain(self, e, parent_of_first) -> None:
        assert len(e.token_ids) == len(e.vpages) * P
        tokens = np.asarray(e.token_ids, dtype=np.int64)
        assert tuple(page_hashes(e.parent_hash, tokens, P)) == e.page_hashes
        if e.first_page == 0:
            assert e.parent_hash == ROOT_HASH
        elif parent_of_first is not None:
            assert e.parent_hash == self.hash[parent_of_first]

    def apply(self, events, parents=None) -> None:
        """``parents``: virtual page -> the page before it, where known (to check the chain)."""
        parents = parents or {}
        for e in events:
            if e.kind is KvEventKind.INSERTED:
                assert not set(e.vpages) & set(self.hash), "inserted twice"
                self._check_chain(e, parents.get(e.vpages[0]))
                self.hash.update(zip(e.vpages, e.page_hashes))
                live = e.vpages[len(e.vpages) - len(e.swa_pages) :]
                self.swa.update(zip(live, e.swa_pages))
            elif e.kind is KvEventKind.EVICTED:
                assert e.page_hashes == tuple(self.hash[v] for v in e.vpages)
                for v in e.vpages:
                    del self.hash[v]
                    self.swa.pop(v, None)
            elif e.kind is KvEventKind.TOMBSTONED:
                assert e.page_hashes == tuple(self.hash[v] for v in e.vpages)
                for v, s in zip(e.vpages, e.swa_pages, strict=True):
                    assert self.swa.pop(v) == s
            elif e.kind is KvEventKind.REVIVED:
                assert e.page_hashes == tuple(self.hash[v] for v in e.vpages)
                self._check_chain(e, parents.get(e.vpages[0]))
                for v, s in zip(e.vpages, e.swa_pages, strict=True):
                    assert v in self.hash and v not in self.swa
                    self.swa[v] = s
            else:
                assert e.kind is KvEventKind.FREED and not e.page_hashes
                assert not set(e.vpages) & set(self.hash), "a tree page reported FREED"
                assert not set(e.swa_pages) & set(self.swa.values()), "live SWA reported FREED"
                self.freed |= set(e.vpages)


def _parents(cache):
    """Virtual page -> the page before it in its prefix, over the whole tree."""
    out = {}
    for n in cache._tree.nodes():
        pages = np.concatenate([m.vpages for m in n.path_from_root()]).tolist()
        out.update(zip(pages[1:], pages[:-1]))
    return out


def _tree_truth(cache):
    hashes, swa = {}, {}
    for n in cache._tree.nodes():
        path = n.path_from_root()
        tokens = np.concatenate([m.tokens for m in path])
        hs = page_hashes(ROOT_HASH, tokens, P)[n.start_page :]
        hashes.update(zip(n.vpages, hs))
        swa.update(zip(n.vpages[n.live_from :], n.swa_pages))
    return hashes, swa


@pytest.mark.parametrize("seed", range(5))
def test_events_replayed_reproduce_the_tree(seed):
    rng = random.Random(seed)
    cache = ShadowRadixCache(CacheConfig(**CFG), kv_events=True)
    shadow, running, kinds = Shadow(), [], set()
    prefixes = [list(range(b, b + 24)) for b in (0, 100, 200)]
    for _ in range(150):
        op = rng.random()
        try:
            if op < 0.3 and len(running) < 3:
                prompt = rng.choice(prefixes)[: rng.randint(4, 24)] + [rng.randrange(1000)] * 3
                r = cache.admit(prompt)
                running.append(r)
                cache.extend(r, r.prompt_remaining)
            elif op < 0.6 and running:
                r = rng.choice(running)
                cache.extend(r, [rng.randrange(1000) for _ in range(rng.randint(1, 6))])
                if rng.random() < 0.5:
                    cache.cache_unfinished(r)
            elif op < 0.8 and running:
                cache.finish(running.pop(rng.randrange(len(running))))
            elif op < 0.9:
                cache.evict(swa_tokens=rng.randint(1, 12))
            else:
                cache.evict(full_tokens=rng.randint(1, 12))
        except CapacityError:
            pass
        events = cache.take_events()
        kinds |= {e.kind for e in events}
        shadow.apply(events, _parents(cache))
        hashes, swa = _tree_truth(cache)
        assert shadow.hash == hashes and shadow.swa == swa
        for r in running:  # a running request's tree pages are all in the shadow
            assert all(v in shadow.hash for v in r.vpages[: r.tree_pages])
    for r in running:
        cache.finish(r)
    cache.reset()
    shadow.apply(cache.take_events())
    assert shadow.hash == {} and shadow.swa == {}
    assert {KvEventKind.INSERTED, KvEventKind.EVICTED, KvEventKind.TOMBSTONED} <= kinds
    assert KvEventKind.FREED in kinds and shadow.freed


def test_equal_prefixes_hash_equally_across_caches():
    a = ShadowRadixCache(CacheConfig(**CFG), kv_events=True)
    b = ShadowRadixCache(CacheConfig(**CFG), kv_events=True)
    other = b.admit(list(range(500, 520)))
    b.extend(other, other.prompt_remaining)  # holds pages: b's page ids differ from a's
    for cache in (a, b):
        cache.take_events()
        r = cache.admit(list(range(16)))
        cache.extend(r, r.prompt_remaining)
        cache.finish(r)
    (ea,), (eb,) = a.take_events(), b.take_events()
    assert ea.page_hashes == eb.page_hashes and len(ea.page_hashes) == 4
    assert ea.vpages != eb.vpages


def test_events_are_off_by_default():
    cache = ShadowRadixCache(CacheConfig(**CFG))
    with pytest.raises(ConfigError, match="kv_events=True"):
        cache.take_events()
    with pytest.raises(ConfigError):
        ShadowRadixCache(CacheConfig(**CFG), kv_events="yes")  # type: ignore[arg-type]


def test_recomputing_a_tombstoned_prefix_revives_it():
    """A prompt whose SWA was all tombstoned is recomputed from the start by the next request;
    its finish gives the tree's pages live SWA again: REVIVED, and the shadow follows."""
    cache = ShadowRadixCache(CacheConfig(**CFG), kv_events=True)
    shadow, prompt = Shadow(), list(range(24))
    r = cache.admit(prompt)
    cache.extend(r, r.prompt_remaining)
    cache.finish(r)
    cache.evict(swa_tokens=64)
    shadow.apply(cache.take_events())
    assert shadow.swa == {} and len(shadow.hash) == 6
    r = cache.admit(prompt + [1])  # no live window: recomputed from the start
    assert r.length == 0
    cache.extend(r, r.prompt_remaining)
    cache.finish(r)
    events = cache.take_events()
    # its window pages before the last 8 tokens were freed as it moved on (FREED), then its
    # duplicates of the tree's pages; the tree's pages got its window copies back
    kinds = [e.kind for e in events]
    assert [k for k in kinds if k is not KvEventKind.FREED] == [KvEventKind.REVIVED]
    shadow.apply(events, _parents(cache))
    assert (shadow.hash, shadow.swa) == _tree_truth(cache) and len(shadow.swa) == 6
