"""Top-k selection of compressed entries (the C4 indexer), in query tiles of bounded memory.

The indexer's logits of one query cover every visible entry of its request, so a step's logits
are ``N x G``: at a 1M-token context a 8K-token prefill chunk would need 8.6 GB of them. This
module scores a tile of queries at a time (`LOGITS_TILE_BYTES` of fp32 logits), selects each
tile's top-k right away and keeps only the selection, ``(N, k)`` slots and their validity.

Two things change a layer's top-k per tile, before only the selection is kept: the shared
candidates of V4.1 (`adapters.model.candidates`: the candidate layer publishes blocks, later
layers are restricted to them) and a forced replay (rows whose selection is given, not
computed: `ForcedRows`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from adapters import kernels
from adapters.kernels import PoolRows
from adapters.model import ops
from adapters.model.candidates import Candidates, select_candidates

#: fp32 logits alive at once while selecting (the memory planner counts them).
LOGITS_TILE_BYTES = 1 << 30


@dataclass(frozen=True)
class Selection:
    """A layer's top-k per query: pool ``slots (N, k)``, their validity ``valid (N, k)`` (a
    valid prefix) and the ``entries (N, k)`` they are (entry indices within the request: what
    a capture records). ``candidates``: what the layer published, if it is the candidate
    source."""

    slots: torch.Tensor
    valid: torch.Tensor
    entries: torch.Tensor
    candidates: Candidates | None = None

    def rows(self, index: torch.Tensor) -> Selection:
        """The selection of the queries ``index`` only (tail-only prefill)."""
        cands = None if self.candidates is None else self.candidates.rows(index)
        return Selection(self.slots[index], self.valid[index], self.entries[index], cands)


@dataclass(frozen=True)
class ForcedRows:
    """Queries whose selection is given (a forced replay): where ``rows (N,)`` is true, the
    query takes ``entries (N, K)`` with validity ``valid (N, K)`` (``K >= k``: the columns past
    the step's ``k`` must be invalid) instead of its top-k."""

    rows: torch.Tensor
    entries: torch.Tensor
    valid: torch.Tensor

    def apply(
        self, tile: slice, entries: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The tile's computed ``entries`` / ``valid`` ``(t, k)`` with its forced rows given."""
        k, use = entries.shape[1], self.rows[tile][:, None]
        forced_entries, forced_valid = self.entries[tile, :k], self.valid[tile, :k]
        return torch.where(use, forced_entries, entries), torch.where(use, forced_valid, valid)


def logits_tile_rows(num_rows: int, tile_bytes: int = LOGITS_TILE_BYTES) -> int:
    """Queries per tile when each scores ``num_rows`` entries: the largest power of two whose
    logits fit ``tile_bytes``.

    A power of two, so that a chunk of a power-of-two token count splits into equal tiles and a
    long prompt meets only a handful of tile shapes: every new shape of the indexer and top-k
    launches is a new Triton specialisation (divisibility, CTAs per row), seconds of compiling
    the first time (at 1M tokens, 13 shapes cost about half the prefill before this rule)."""
    most = max(1, tile_bytes // (4 * max(1, num_rows)))
    return 1 << (most.bit_length() - 1)


def query_tiles(
    num_queries: int, num_rows: int, tile_bytes: int = LOGITS_TILE_BYTES
) -> list[slice]:
    """The query ranges `select_entries` scores at once."""
    step = logits_tile_rows(num_rows, tile_bytes)
    return [slice(a, min(a + step, num_queries)) for a in range(0, num_queries, step)]


def select_entries(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: torch.Tensor,
    rows: PoolRows,
    topk: int,
    *,
    key_scale: torch.Tensor | None = None,
    tile_bytes: int = LOGITS_TILE_BYTES,
    candidates: Candidates | None = None,
    publish: tuple[int, int] | None = None,
    forced: ForcedRows | None = None,
) -> Selection:
    """The ``k = min(topk, G)`` best-scoring entries of each query (ties to the lowest entry
    index, value descending) as a `Selection` (invalid past the query's visible entries).

    ``candidates``: only entries in these blocks compete (a later layer of the candidate
    source's ratio). ``publish = (num_blocks, block)``: also select this layer's candidate
    blocks from its logits (the candidate source), returned in ``Selection.candidates``.
    ``forced``: rows whose selection is given instead (candidates are still published from
    their logits)."""
    n, k = q.shape[0], min(topk, rows.num_rows)
    slots = torch.zeros((n, k), dtype=torch.long, device=q.device)
    valid = torch.zeros((n, k), dtype=torch.bool, device=q.device)
    entries = torch.zeros((n, k), dtype=torch.long, device=q.device)
    blocks: list[Candidates] = []
    for tile in query_tiles(n, rows.num_rows, tile_bytes):
        part = rows.select(tile)
        logits = kernels.index_logits(q[tile], w[tile], keys, part, key_scale=key_scale)
        if publish is not None:
            blocks.append(select_candidates(logits, part.lengths, *publish))
        if candidates is not None:
            logits = candidates.rows(tile).restrict(logits)
        values, indices = ops.topk_lowest_index(logits, k, lengths=part.lengths)
        chosen = torch.isfinite(values)
        if forced is not None:
            indices, chosen = forced.apply(tile, indices, chosen)
        slots[tile], valid[tile], entries[tile] = part.slots_of(indices), chosen, indices
    published = None
    if blocks:
        published = Candidates(
            torch.cat([b.blocks for b in blocks]), torch.cat([b.valid for b in blocks]),
            blocks[0].block,
        )  # fmt: skip
    return Selection(slots, valid, entries, published)


@dataclass
class TopkStep:
    """One forward's top-k hooks (a capture or forced replay, docs/runner.md): ``forced`` per
    indexer layer goes in; the forward fills ``selected`` with every indexer layer's
    `Selection` of the step (per query row, in step order)."""

    forced: dict[int, ForcedRows] = field(default_factory=dict)
    selected: dict[int, Selection] = field(default_factory=dict)
