"""External pins (`pin` / `unpin`): a pinned prefix survives every eviction with its window,
and is evictable again once unpinned; receipts are single-use."""

from __future__ import annotations

import pytest
from core_helpers import cached

from shadowradix import (
    CacheConfig,
    InvalidRequestError,
    InvariantError,
    LockError,
    ShadowRadixCache,
)

CFG = dict(page_size=4, window=8, compress_ratios=(4, 0), overlap_ratios=(4,),
           full_capacity=256, swa_capacity=128)  # fmt: skip
PROMPT = list(range(24))


def test_a_pinned_prefix_survives_eviction_until_unpinned():
    cache = ShadowRadixCache(CacheConfig(**CFG))
    cached(cache, PROMPT)
    cached(cache, list(range(100, 124)))
    pin = cache.pin(PROMPT[:18] + [7])  # ends inside the node: split at 16 tokens
    assert pin.tokens == 16 and pin.full is not None and pin.swa is not None
    cache.check_invariants()
    cache.evict(full_tokens=256, swa_tokens=128)
    m = cache.match_prefix(PROMPT[:16] + [7])
    assert m.prefix_len == 16  # its compressed KV and its live window are still there
    assert cache.match_prefix(list(range(100, 124))).cached_len == 0  # the other one went
    with pytest.raises(InvalidRequestError, match="pin"):
        cache.reset()
    cache.unpin(pin)
    cache.check_invariants()
    cache.evict(full_tokens=256, swa_tokens=128)
    assert cache.match_prefix(PROMPT[:16] + [7]).cached_len == 0
    cache.reset()


def test_receipts_are_single_use_and_local():
    a, b = ShadowRadixCache(CacheConfig(**CFG)), ShadowRadixCache(CacheConfig(**CFG))
    cached(a, PROMPT)
    pin = a.pin(PROMPT)
    with pytest.raises(LockError):
        b.unpin(pin)
    a.unpin(pin)
    with pytest.raises(LockError, match="double unpin"):
        a.unpin(pin)
    with pytest.raises(LockError):
        a.unpin("receipt")  # type: ignore[arg-type]
    empty = a.pin([500, 501, 502, 503, 504])  # nothing cached: nothing pinned
    assert empty.tokens == 0 and empty.full is None and empty.swa is None
    a.unpin(empty)
    a.check_invariants()


def test_pins_count_in_the_invariants():
    cache = ShadowRadixCache(CacheConfig(**CFG))
    cached(cache, PROMPT)
    pin = cache.pin(PROMPT)
    cache._pins.clear()  # a pin the cache forgot: its locks now belong to nobody
    with pytest.raises(InvariantError, match="receipts"):
        cache.check_invariants()
    cache._pins[pin.id] = pin
    cache.check_invariants()
