"""Top-k selection of compressed entries (the C4 indexer), in query tiles of bounded memory.

The indexer's logits of one query cover every visible entry of its request, so a step's logits
are ``N x G``: at a 1M-token context a 8K-token prefill chunk would need 8.6 GB of them. This
module scores a tile of queries at a time (`LOGITS_TILE_BYTES` of fp32 logits), selects each
tile's top-k right away and keeps only the selection, ``(N, k)`` slots and their validity.
"""

from __future__ import annotations

import torch

from adapters import kernels
from adapters.kernels import PoolRows
from adapters.model import ops

#: fp32 logits alive at once while selecting (the memory planner counts them).
LOGITS_TILE_BYTES = 1 << 30


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool slots ``(N, k)`` of the ``k = min(topk, G)`` best-scoring entries of each query
    (ties to the lowest entry index, value descending) and their validity ``(N, k)`` (false
    past the query's visible entries: a valid prefix)."""
    n, k = q.shape[0], min(topk, rows.num_rows)
    slots = torch.zeros((n, k), dtype=torch.long, device=q.device)
    valid = torch.zeros((n, k), dtype=torch.bool, device=q.device)
    for tile in query_tiles(n, rows.num_rows, tile_bytes):
        part = rows.select(tile)
        logits = kernels.index_logits(q[tile], w[tile], keys, part, key_scale=key_scale)
        values, indices = ops.topk_lowest_index(logits, k, lengths=part.lengths)
        slots[tile] = part.slots_of(indices)
        valid[tile] = torch.isfinite(values)
    return slots, valid
