"""Pending tokens (overlap scheduling, #14 item 3): a token extended before its value is known,
then resolved or dropped, leaves the cache exactly as `extend_batch` of the value, or as never
extending it: request tables, free stacks, windows, the tree after `finish`, and the deltas an
engine mirrors."""

from __future__ import annotations

import numpy as np
import pytest

from shadowradix import CacheConfig, InvalidRequestError, ShadowRadixCache
from shadowradix.testing.machines import TableMirror

P = 4
#: no speculation: a pending token needs no doubled rings
CFG = dict(page_size=P, window=16, compress_ratios=(4, 16), overlap_ratios=(4,),
           full_capacity=48 * P, swa_capacity=24 * P, debug=True)  # fmt: skip


def _state(cache: ShadowRadixCache, requests) -> tuple:
    """Everything the two runs must agree on (page ids included)."""
    rows = [(r.tokens, list(r.vpages), r.swa_base, r.released_at // P) for r in requests]
    rows += [(list(r.swa_pages), list(r.swa_owned), r.num_draft) for r in requests]
    st = cache.stats()
    return rows, list(cache._full._free), list(cache._swa._free), st.full, st.swa


def _admitted(cache: ShadowRadixCache, prompts) -> list:
    reqs = [cache.admit(p) for p in prompts]
    cache.extend_batch(reqs, [r.prompt_remaining for r in reqs])
    return reqs


PROMPTS = [list(range(1, 12)), list(range(20, 37)), list(range(1, 7)) + [99] * 9]


@pytest.mark.parametrize("steps", [1, 5, 13, 30])
def test_resolved_equals_extend_and_dropped_equals_never(steps: int) -> None:
    rng = np.random.default_rng(steps)
    plain, late = ShadowRadixCache(CacheConfig(**CFG)), ShadowRadixCache(CacheConfig(**CFG))
    a, b = _admitted(plain, PROMPTS), _admitted(late, PROMPTS)
    mirror = TableMirror()
    for r in b:
        mirror.admitted(r)
    for _ in range(steps):
        tokens = rng.integers(0, 500, len(a)).tolist()
        plain.extend_batch(a, [[t] for t in tokens])
        mirror.apply(late.extend_pending_batch(b).deltas)
        assert all(r.num_draft == 1 for r in b)
        for r, t in zip(b, tokens):
            mirror.apply(late.resolve_pending(r, t).deltas)
        assert _state(plain, a) == _state(late, b)
        for r in b:
            mirror.check(r)
    before = _state(late, b)
    late.extend_pending_batch(b[1:2])  # the middle one: a late stop
    mirror.apply(late.drop_pending(b[1]).deltas)
    mirror.check(b[1])
    assert _state(late, b) == before
    for cache, reqs in ((plain, a), (late, b)):
        for r in reqs:
            cache.finish(r)
        cache.check_invariants()
    assert _state(plain, []) == _state(late, [])
    for r in a:
        query = r.tokens + [7]
        assert plain.match_prefix(query).hit_len == late.match_prefix(query).hit_len > 0


def test_pending_tokens_are_settled_before_anything_else() -> None:
    cache = ShadowRadixCache(CacheConfig(**CFG))
    (r,) = _admitted(cache, PROMPTS[:1])
    with pytest.raises(InvalidRequestError, match="no pending token"):
        cache.resolve_pending(r, 3)
    with pytest.raises(InvalidRequestError, match="no pending token"):
        cache.drop_pending(r)
    cache.extend_pending_batch([r])
    before = _state(cache, [r])
    with pytest.raises(InvalidRequestError):
        cache.extend_batch([r], [[1]])
    with pytest.raises(InvalidRequestError):
        cache.extend_pending_batch([r])
    with pytest.raises(InvalidRequestError, match="rollback"):
        cache.finish(r)
    for bad in (-1, 2.0, True, "x"):
        with pytest.raises(InvalidRequestError):
            cache.resolve_pending(r, bad)  # type: ignore[arg-type]
    assert _state(cache, [r]) == before
    cache.resolve_pending(r, 5)
    assert r.tokens[-1] == 5 and r.num_draft == 0
    cache.finish(r)
    cache.check_invariants()
