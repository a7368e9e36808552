"""The strong guarantee without the capacity pre-check: a page allocation that fails anyway
(a device allocator's refusal, here an injected fault) at any point of a batched step leaves
every request and both free stacks exactly as before, and the cache consistent."""

from __future__ import annotations

import itertools

import pytest

from shadowradix import CacheConfig, CapacityError, ShadowRadixCache
from shadowradix.allocator import PageAllocator

CFG = dict(page_size=4, window=8, compress_ratios=(4, 0), overlap_ratios=(4,),
           full_capacity=256, swa_capacity=128)  # fmt: skip


def _requests_state(cache):
    return tuple((r.id, r.length, tuple(r.vpages), tuple(r.swa_pages), tuple(r.swa_owned),
                  r.swa_base) for r in cache.requests)  # fmt: skip


def _state(cache):
    return (_requests_state(cache), cache._full.free_snapshot(), cache._swa.free_snapshot(),
            cache.stats())  # fmt: skip


def _fail_on(monkeypatch, n):
    """Make the n-th `PageAllocator.allocate` call (0-based) raise."""
    real, calls = PageAllocator.allocate, itertools.count()

    def allocate(self, num_pages):
        if next(calls) == n:
            raise CapacityError(self.name, num_pages, 0)
        return real(self, num_pages)

    monkeypatch.setattr(PageAllocator, "allocate", allocate)


def _three_running(cache):
    rs = [cache.admit(list(range(b, b + 6))) for b in (0, 100, 200)]
    cache.extend_batch(rs, [list(range(b, b + 6)) for b in (0, 100, 200)])
    return rs


@pytest.mark.parametrize("kind", ["prefill", "decode", "draft"])
def test_an_allocation_failing_at_any_point_changes_nothing(monkeypatch, kind):
    speculative = kind == "draft"
    for n in range(6):  # every allocate call of the step (2 pools x 3 requests)
        cache = ShadowRadixCache(CacheConfig(**CFG, speculative=speculative))
        rs = _three_running(cache)
        if kind == "decode":
            for r in rs:  # put every request on a page boundary: each decode token allocates
                cache.extend(r, [1, 2])
        before = _state(cache)
        monkeypatch.undo()
        _fail_on(monkeypatch, n)
        with pytest.raises(CapacityError):
            if kind == "prefill":
                cache.extend_batch(rs, [[1] * 9, [2] * 5, [3] * 13])
            elif kind == "decode":
                cache.extend_batch(rs, [[1], [2], [3]])
            else:
                cache.extend_draft_batch(rs, [[1] * 3, [2] * 3, [3] * 3])
        monkeypatch.undo()
        assert _state(cache) == before, (kind, n)
        cache.check_invariants()
        cache.extend_batch(rs, [[7], [8], [9]])  # and the cache goes on
        cache.check_invariants()
