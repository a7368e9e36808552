"""The graph buffers' device block tables follow the core's page-table deltas (issue #13 item 3):
applied in order they reproduce every request's tables exactly, across prefix sharing (two
requests with one prompt: `cache_unfinished` rewrites the second's table), decode, drafts and
rollbacks; and leaving out any single delta is caught."""

from __future__ import annotations

import pytest

from adapters.forward.graph_decode import DecodeBuffers
from adapters.memory.block_tables import TableSyncError
from shadowradix import CacheConfig, ShadowRadixCache

CC = CacheConfig(
    page_size=4,
    window=8,
    compress_ratios=(0, 4),
    full_capacity=256,
    swa_capacity=128,
    speculative=True,
    debug=True,
)
PROMPT = [(7 * i + 3) % 50 for i in range(29)]


def _run(drop: int | None = None) -> int:
    """The scripted run, every table change fed to the buffers except delta number ``drop``;
    the buffers are checked against the requests after every step. Returns the deltas fed."""
    cache = ShadowRadixCache(CC)
    buf = DecodeBuffers(CC, 2, 64, "cpu")
    reqs = [cache.admit(PROMPT), cache.admit(PROMPT)]
    fed = 0

    def feed(deltas, tokens=(0, 0)) -> None:
        nonlocal fed
        kept = [d for k, d in enumerate(deltas, fed) if k != drop]
        fed += len(deltas)
        buf.load(reqs, list(tokens), kept)
        buf.tables.check(reqs)

    feed(())  # rows placed at admission: from here on only deltas write them
    feed(cache.extend_batch(reqs, [PROMPT, PROMPT]).deltas)
    for t in range(2):
        feed(cache.extend_batch(reqs, [[t], [t + 1]]).deltas)
    before = list(reqs[1].vpages)
    feed([d for r in reqs for d in cache.cache_unfinished(r).deltas])
    assert list(reqs[1].vpages) != before  # b now shares a's pages: its old ids are free
    assert list(reqs[1].vpages[:7]) == list(reqs[0].vpages[:7])
    for step in range(3):
        feed(cache.extend_draft_batch(reqs, [[1, 2, 3], [4, 5, 6]]).deltas)
        feed([d for r, k in zip(reqs, (2, 3 - step)) for d in cache.rollback(r, k).deltas])
        feed(cache.extend_batch(reqs, [[9], [8]]).deltas)
    return fed


def test_deltas_reproduce_the_device_tables_exactly() -> None:
    assert _run() > 10


def test_leaving_out_any_delta_is_caught() -> None:
    """Every delta changes a device row: without it the next step's placement finds the row's
    extent wrong (appends, cuts, the SWA window moving) or the comparison finds stale ids (the
    prefix rewrite of `cache_unfinished`)."""
    for k in range(_run()):
        with pytest.raises(TableSyncError):
            _run(drop=k)


def test_a_request_moving_rows_is_written_whole() -> None:
    """Rows follow the batch order: a request placed in another row (or new to the buffers) is
    written whole there, and the deltas of requests holding no row are not needed."""
    cache = ShadowRadixCache(CC)
    buf = DecodeBuffers(CC, 2, 64, "cpu")
    a, b = cache.admit(PROMPT), cache.admit(PROMPT[:13])
    cache.extend_batch([a, b], [PROMPT, PROMPT[:13]])  # deltas of rows not yet placed
    buf.load([a, b], [0, 0], ())
    buf.tables.check([a, b])
    plan = cache.extend_batch([a, b], [[1], [2]])
    buf.load([b, a], [0, 0], plan.deltas)  # swapped rows
    buf.tables.check([b, a])
    with pytest.raises(ValueError, match="exceeds"):
        buf.load([a, b, a], [0, 0, 0], ())
