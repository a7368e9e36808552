"""Hypothesis strategies for configurations and token streams with much shared structure."""

from __future__ import annotations

from hypothesis import strategies as st

from ..config import CacheConfig

PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@st.composite
def cache_configs(
    draw: st.DrawFn,
    speculative: bool | None = None,
    replay: bool | None = None,
    c2: bool | None = None,
) -> CacheConfig:
    """Tiny pools (so eviction is constant), every supported page size from 1 to 256, and both
    toy ratios/windows and the real 128/4/128. ``c2`` (drawn when ``None``): a V4.1 pairwise
    stream too (ratio 2, no overlap; docs/design.md "C2"), beside an overlapped C4 (the toy
    overlapped ratio 2 leaves no room for it)."""
    page = draw(st.sampled_from(PAGE_SIZES))
    pairwise = draw(st.booleans()) if c2 is None else c2
    ratios: tuple[int, ...]
    if page >= 32 or draw(st.booleans()):
        window, ratios, overlap = 128, (0, 4, 128), (4,)
    else:
        c4 = 4 if pairwise else draw(st.sampled_from((2, 4)))
        window = draw(st.integers(2 * c4 - 1, 16))
        dense = draw(
            st.sampled_from([r for r in (4, 8, 16) if r - 1 <= window and r != c4] or [c4])
        )
        ratios, overlap = (0, c4, dense), (c4,)
    if pairwise:
        ratios = (0, 2) + ratios[1:]
    spec = draw(st.booleans()) if speculative is None else speculative
    rep = (not spec and draw(st.booleans())) if replay is None else replay
    window_pages = -(-window // page) + 2
    swa_pages = draw(st.integers(window_pages + 1, window_pages + 8))
    full_pages = draw(st.integers(max(2, window_pages), max(2, window_pages) + 10))
    return CacheConfig(
        page_size=page,
        window=window,
        compress_ratios=ratios,
        overlap_ratios=overlap,
        full_capacity=full_pages * page,
        swa_capacity=swa_pages * page,
        speculative=spec,
        bounded_replay=rep,
    )
