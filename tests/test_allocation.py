"""Allocations: the decode and one-request fast paths equal the general path, and lazily built
arrays stay valid after later cache operations."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shadowradix import CacheConfig, ShadowRadixCache
from shadowradix.results import StepArrays
from shadowradix.shadows import Run, Shadows
from shadowradix.testing import FingerprintOracle, snapshot


def _config(page: int) -> CacheConfig:
    return CacheConfig(
        page_size=page,
        window=16,
        compress_ratios=(0, 2, 8),
        overlap_ratios=(2,),
        full_capacity=2048,
        swa_capacity=1024,
    )


def _arrays(alloc) -> tuple:  # type: ignore[no-untyped-def]
    a = alloc.arrays
    streams = tuple(
        tuple(np.asarray(getattr(s, f)).tolist() for f in s.__dataclass_fields__) for s in a.streams
    )
    return (
        a.token_offsets.tolist(),
        a.positions.tolist(),
        a.virtual_slots.tolist(),
        a.swa_slots.tolist(),
        streams,
    )


@pytest.mark.parametrize("page", [1, 4, 16])
def test_decode_fast_path_equals_general_path(page: int) -> None:
    rng = np.random.default_rng(page)
    caches = [ShadowRadixCache(_config(page)) for _ in range(3)]
    prompts = [rng.integers(0, 5, 40 + 7 * i).tolist() for i in range(4)]
    batches = []
    for cache in caches:
        reqs = [cache.admit(p) for p in prompts]
        for r in reqs:
            cache.extend(r, r.prompt_remaining)
        batches.append(reqs)
    for step in range(70):
        toks = rng.integers(0, 5, len(prompts)).tolist()
        fast_lists = caches[0].extend_batch(batches[0], [[t] for t in toks])
        fast_array = caches[1].extend_batch(batches[1], np.array(toks).reshape(-1, 1))
        general = caches[2].extend_batch(batches[2], [np.array([t]) for t in toks])
        assert _arrays(fast_lists) == _arrays(general) == _arrays(fast_array), f"step {step}"
    views = [_without_ids(snapshot(c)) for c in caches]
    assert views[0] == views[1] == views[2]


def _without_ids(snap: tuple) -> tuple:
    """Request ids come from a global counter: drop them to compare separate caches."""
    return (snap[0], tuple(r[1:] for r in snap[1]), *snap[2:])


@pytest.mark.parametrize("page", [1, 4, 16])
def test_arrays_built_late_equal_arrays_built_at_once(page: int) -> None:
    """An allocation read after the cache moved on (window trimmed, pages freed and reused)
    still describes the step it was made for."""
    rng = np.random.default_rng(7)
    eager, lazy = ShadowRadixCache(_config(page)), ShadowRadixCache(_config(page))
    oracle = FingerprintOracle(eager.config)
    prompt = rng.integers(0, 5, 90).tolist()
    pending = []
    r_e, r_l = eager.admit(prompt), lazy.admit(prompt)
    for chunk in (prompt[:13], prompt[13:50], prompt[50:]):
        a = eager.extend(r_e, chunk)
        oracle.write(a, {r_e.id: r_e.tokens})
        pending.append((_arrays(a), lazy.extend(r_l, chunk)))
    for _ in range(40):
        t = int(rng.integers(0, 5))
        a = eager.extend_batch([r_e], [[t]])
        oracle.write(a, {r_e.id: r_e.tokens})
        pending.append((_arrays(a), lazy.extend_batch([r_l], [[t]])))
    eager.finish(r_e)
    lazy.finish(r_l)
    for expected, late in pending:
        assert _arrays(late) == expected
    assert pending[0][1].num_tokens == 13 and pending[-1][1].num_tokens == 1


def _fields(a: StepArrays) -> list:  # type: ignore[type-arg]
    arrays = [a.token_offsets, a.positions, a.virtual_slots, a.swa_slots]
    arrays += [np.asarray(getattr(s, f)) for s in a.streams for f in s.__dataclass_fields__]
    return [(x.dtype.str, x.shape, x.tolist()) if isinstance(x, np.ndarray) else x for x in arrays]


@settings(max_examples=300, deadline=None)
@given(
    page=st.sampled_from([1, 2, 4, 16, 64, 256]),
    layout=st.sampled_from(["v4", "small"]),
    speculative=st.booleans(),
    start=st.integers(0, 700),
    length=st.integers(1, 400),
    replay=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_one_request_expansion_equals_the_general_path(
    page: int, layout: str, speculative: bool, start: int, length: int, replay: bool, seed: int
) -> None:
    """`Shadows._expand_one` (a step of one request: every prefill chunk) builds exactly the
    arrays of the general many-request expansion."""
    ratios, overlap, window = (
        ((0, 0, 4, 128), (4,), 128) if layout == "v4" else ((0, 2, 8), (2,), 16)
    )
    cfg = CacheConfig(page_size=page, window=window, compress_ratios=ratios,
                      overlap_ratios=overlap, speculative=speculative,
                      full_capacity=4096 * page, swa_capacity=1024 * page)  # fmt: skip
    rng = np.random.default_rng(seed)
    end = start + length
    swa_first = max(0, (start - window) // page)
    last = (end - 1) // page
    vpages = rng.integers(0, 4096, last + 1 - start // page).tolist()
    spages = rng.integers(0, 1024, last + 1 - swa_first).tolist()
    shadows = Shadows(cfg)
    run = Run(start, end, vpages, swa_first, spages)
    assert _fields(shadows._expand_one(run, replay)) == _fields(shadows._expand_many([run], replay))
