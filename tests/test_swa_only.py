"""An SWA-only model (`compress_ratios=(0,)`, documented as valid) through every step kind: the
Allocation's arrays build (no compressed streams) after a prefill chunk, a batched decode and a
general multi-token batch, and the prefix is reused afterwards."""

from __future__ import annotations

import numpy as np

from shadowradix import CacheConfig, ShadowRadixCache


def test_swa_only_steps_build_their_arrays():
    cfg = CacheConfig(page_size=4, window=8, compress_ratios=(0,), overlap_ratios=(),
                      full_capacity=256, swa_capacity=64)  # fmt: skip
    assert cfg.streams == ()
    cache = ShadowRadixCache(cfg)
    a, b = cache.admit(list(range(10))), cache.admit(list(range(50, 57)))
    prefill = cache.extend_batch([a, b], [list(range(10)), list(range(50, 57))])
    arrays = prefill.arrays
    assert arrays.streams == () and len(arrays.positions) == 17
    assert np.array_equal(arrays.positions[:10], np.arange(10))
    decode = cache.extend_batch([a, b], [[5], [6]])
    assert decode.arrays.streams == () and decode.arrays.positions.tolist() == [10, 7]
    mixed = cache.extend_batch([a, b], [[1, 2, 3], [4]])
    assert len(mixed.arrays.swa_slots) == 4
    for r in (a, b):
        cache.cache_unfinished(r)
        cache.finish(r)
    cache.check_invariants()
    hit = cache.match_prefix(list(range(10)) + [5, 1, 2, 3, 9])
    assert hit.prefix_len == 12  # the deepest page boundary with its window live
