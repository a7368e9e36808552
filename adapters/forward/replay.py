"""Encoder-side bounded replay (V4.1): executing the core's window rebuild on the pools.

A REPLAY match resumes a request at ``prefix_len`` (the deepest cached page boundary) although
the SWA window before it was tombstoned. The core then hands the adapter
``request.replay_allocation``, which this module turns into forwards. What it contains, and
therefore all that the replay executes::

    positions   [0 ............. replay_start) [replay_start ......... prefix_len) [prefix_len ..
    compressed  cached entries: read            cached entries: read, never written  chunks
    SWA         tombstoned: never read          recomputed: every position's latent
    rings       -                               the rows later reads need (the last
                                                ring_len of each page), compressor and
                                                indexer rings alike; no carry rows

``replay_start = prefix_len - window``. No compressed entry and no indexer key is written (the
allocation has no ``entry_slots`` and no ``carry_rows``): compressed KV stays as cached. The
replay's queries attend to windows truncated at ``replay_start`` (`paged._window` masks the
positions before a plan's ``replay_start``: they are not live) and to the cached entries
visible at their positions (C4 through the indexer's top-k over the cached indexer keys, C128
dense). The recomputed hidden states therefore differ from a cold prefill's: the latents and
in-flight rows it writes, and everything later computed from them, are approximate (the core's
lineage flags; `reference_replay` is the oracle).

A replay is split into slices ``[lo, hi)`` so that it shares the prefill token budget and,
under HiSparse, the device working set; slices of several requests run in one forward
(`replay_step`). A slice only needs the SWA written by earlier slices, so any split is exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shadowradix import Allocation, EvictionReport, StreamWrites
from shadowradix.results import StepArrays

I64 = np.int64
_EMPTY = np.zeros(0, dtype=I64)


class ReplayPlanError(ValueError):
    """An allocation that is not a one-request window rebuild (never produced by the core)."""


def check_replay(allocation: Allocation) -> None:
    """Raises `ReplayPlanError` unless ``allocation`` is what `admit` plans for a replayed hit:
    one request, ``replay=True``, ring rows only (no carry rows, no compressed entries)."""
    if not allocation.replay or len(allocation.request_ids) != 1:
        raise ReplayPlanError(f"not a one-request replay allocation: {allocation!r}")
    for s in allocation.streams:
        if len(s.carry_rows) or len(s.entry_slots):
            raise ReplayPlanError(
                f"a replay must not carry rows or write compressed entries (stream C{s.ratio})"
            )


def replay_step(parts: Sequence[tuple[Allocation, int, int]]) -> Allocation:
    """One `Allocation` executing positions ``[lo, hi)`` of each replay allocation (one part
    per request, in batch order): the slice's SWA slots and those of its ring rows whose
    positions fall inside it. Raises `ReplayPlanError` for a bad allocation or slice."""
    for alloc, lo, hi in parts:
        check_replay(alloc)
        if not alloc.starts[0] <= lo < hi <= alloc.ends[0]:
            raise ReplayPlanError(
                f"slice [{lo}, {hi}) outside the replay [{alloc.starts[0]}, {alloc.ends[0]})"
            )
    ids = tuple(alloc.request_ids[0] for alloc, _, _ in parts)
    starts = [lo for _, lo, _ in parts]
    ends = [hi for _, _, hi in parts]
    return Allocation(ids, starts, ends, EvictionReport(), True, lambda: _merge(parts))


def _merge(parts: Sequence[tuple[Allocation, int, int]]) -> StepArrays:
    """Concatenates the slices' per-token arrays and ring rows (request index = part index)."""
    tokens, rings = [], []
    for index, (alloc, lo, hi) in enumerate(parts):
        arrays = alloc.arrays
        i, j = lo - alloc.starts[0], hi - alloc.starts[0]
        tokens.append((arrays.positions[i:j], arrays.virtual_slots[i:j], arrays.swa_slots[i:j]))
        rings.append([_ring_slice(s, index, lo, hi) for s in arrays.streams])
    positions, virtual_slots, swa_slots = (np.concatenate(x) for x in zip(*tokens))
    streams = []
    for k, first in enumerate(parts[0][0].arrays.streams):
        req, pos, rows = (np.concatenate(x) for x in zip(*(r[k] for r in rings)))
        streams.append(StreamWrites(first.ratio, req, pos, rows, *(_EMPTY,) * 6))
    sizes = [hi - lo for _, lo, hi in parts]
    offsets = np.concatenate(([0], np.cumsum(sizes))).astype(I64)
    return StepArrays(offsets, positions, virtual_slots, swa_slots, tuple(streams))


def _ring_slice(
    s: StreamWrites, index: int, lo: int, hi: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ring rows of positions ``[lo, hi)``, owned by request ``index`` of the step."""
    keep = (s.ring_positions >= lo) & (s.ring_positions < hi)
    pos = s.ring_positions[keep]
    return np.full(len(pos), index, dtype=I64), pos, s.ring_rows[keep]
