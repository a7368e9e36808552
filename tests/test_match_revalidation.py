"""Matches that stay valid across other admissions (issue #13): a longest-prefix-first
scheduler matches its whole queue, then admits; `admit` carries a match over without walking
its tokens again unless a change since could alter it, and then re-matches. Either way the
admission equals one from a match taken at admission time, or is refused as stale."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shadowradix import CacheConfig, ShadowRadixCache, StaleMatchError
from shadowradix.testing import snapshot


def _config(replay: bool) -> CacheConfig:
    return CacheConfig(page_size=2, window=8, compress_ratios=(4, 0), overlap_ratios=(4,),
                       full_capacity=96, swa_capacity=40, bounded_replay=replay)  # fmt: skip


def _prompt(stem: int, length: int) -> list[int]:
    """Prompts of few stems share long prefixes, so matches end inside shared nodes."""
    return [stem] * 3 + list(range(length))


def cached(cache: ShadowRadixCache, prompt: list[int]) -> None:
    """Compute ``prompt`` (all but what the tree holds of its first ``len - 1`` tokens) and
    finish it: it is in the tree."""
    r = cache.admit(prompt, cache.match_prefix(prompt, len(prompt) - 1))
    cache.extend(r, r.prompt_remaining)
    cache.finish(r)


def _key(m):
    return (m.prefix_len, m.hit_len, m.window, m.replay_start, m.approximate)


class _Walks:
    """Counts token walks (`RadixTree.walk`)."""

    def __init__(self, cache: ShadowRadixCache) -> None:
        self.count, tree = 0, cache._tree
        inner = tree.walk

        def walk(*args, **kwargs):
            self.count += 1
            return inner(*args, **kwargs)

        tree.walk = walk  # type: ignore[method-assign]


prompts = st.lists(st.tuples(st.integers(0, 2), st.integers(2, 24)), min_size=1, max_size=5)
ops = st.lists(st.one_of(st.tuples(st.just("insert"), st.integers(0, 2), st.integers(2, 30)),
                         st.tuples(st.just("evict_swa"), st.integers(1, 12)),
                         st.tuples(st.just("evict_full"), st.integers(1, 12)),
                         st.tuples(st.just("none"))), max_size=6)  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(replay=st.booleans(), tree=prompts, queue=prompts, between=ops, data=st.data())
def test_a_queue_matched_first_admits_as_if_matched_at_admission(
    replay, tree, queue, between, data
) -> None:
    cache = ShadowRadixCache(_config(replay))
    for stem, n in tree:
        cached(cache, _prompt(stem, n))
    queue = [_prompt(s, n) + [999] for s, n in queue]
    matches = [cache.match_prefix(q, len(q) - 1) for q in queue]
    order = data.draw(st.permutations(range(len(queue))))
    running = []
    for i, k in enumerate(order):
        if i < len(between):
            op = between[i]
            if op[0] == "insert":
                cached(cache, _prompt(op[1], op[2]))
            elif op[0] == "evict_swa":
                cache.evict(swa_tokens=op[1])
            elif op[0] == "evict_full":
                cache.evict(full_tokens=op[1])
        now = cache.match_prefix(queue[k], len(queue[k]) - 1)
        if _key(now) != _key(matches[k]):
            state = snapshot(cache)
            with pytest.raises(StaleMatchError):
                cache.admit(queue[k], matches[k])
            assert snapshot(cache) == state
            continue
        r = cache.admit(queue[k], matches[k])
        running.append(r)
        pages = now.prefix_len // cache.config.page_size
        assert r.tree_pages == pages and r.length == now.prefix_len
        assert r.vpages[:pages] == _tree_pages(cache, queue[k], pages)
        cache.check_invariants()
    for r in running:
        cache.abort(r)
    cache.check_invariants()


def _tree_pages(cache: ShadowRadixCache, tokens: list[int], pages: int) -> list[int]:
    """The tree's first ``pages`` pages of ``tokens``."""
    walk = cache._tree.walk(np.asarray(tokens[: pages * cache.config.page_size]))
    out: list[int] = []
    for n in walk.nodes:
        out += n.vpages
    return out[:pages]


@settings(max_examples=40, deadline=None)
@given(replay=st.booleans(), tree=prompts, queue=prompts, data=st.data())
def test_admitting_a_matched_queue_walks_no_tokens_again(replay, tree, queue, data) -> None:
    """Admissions alone (splits, locks) never make a queue's matches pay a second walk."""
    cache = ShadowRadixCache(_config(replay))
    for stem, n in tree:
        cached(cache, _prompt(stem, n))
    queue = [_prompt(s, n) + [999] for s, n in queue]
    matches = [cache.match_prefix(q, len(q) - 1) for q in queue]
    expected = [_key(m) for m in matches]
    walks = _Walks(cache)
    admitted = []
    for k in data.draw(st.permutations(range(len(queue)))):
        try:
            admitted.append((k, cache.admit(queue[k], matches[k])))
        except StaleMatchError:  # a replayed window's allocation evicted under another match
            assert replay
    assert walks.count == 0 or replay
    for k, r in admitted:
        assert (r.match.prefix_len, r.match.hit_len) == expected[k][:2]
    cache.check_invariants()
