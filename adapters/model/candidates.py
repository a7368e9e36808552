"""V4.1's two-level selection: shared candidate blocks (docs/sharing.md, "Shared candidates").

One indexer layer (`ModelConfig.candidate_source`) scores its visible entries as usual, takes its
own top-k from all of them, and also publishes, per query, up to ``candidate_blocks`` blocks of
``candidate_block`` consecutive entries. Later indexer layers of the same ratio take their top-k
among the entries of those blocks only. The maths is here, once, for every forward (the dense
reference, the paged path, the graph path): they differ only in how they lay out the logits.

A block is scored by the **max** of its visible entries' logits in the candidate layer. With the
max, a block is kept whenever any one of its entries would be (a sum or mean would let a block of
many middling entries push out one sharp entry), and the candidate layer's own top-k is always
inside its candidates when ``index_topk < candidate_blocks`` (`tests/test_candidates.py`):
ranked by (max descending, block index ascending), a block is preceded only by blocks holding an
entry that the entry top-k ranks before each of its entries. The block of the newest visible
entry is always kept (V4.1: local context is never filtered out); the other
``candidate_blocks - 1`` are the best of the rest. So when a query sees at most
``candidate_blocks * candidate_block`` entries, every visible block is kept and the filter
excludes nothing.

::

    entries   0 1 | 2 3 | 4 5 | 6 7 | 8 9 | 10      block = 2, visible = 11
    blocks      0     1     2     3     4    5      newest: block 5, always kept
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adapters.model import ops


@dataclass(frozen=True)
class Candidates:
    """Per query, the candidate blocks ``blocks (N, M)`` (block ``b`` holds entries
    ``[b * block, (b + 1) * block)``) and which of them are real ``valid (N, M)``."""

    blocks: torch.Tensor
    valid: torch.Tensor
    block: int

    def rows(self, index: torch.Tensor | slice) -> Candidates:
        """The candidates of the queries ``index`` (a tail-only restriction, a query tile)."""
        return Candidates(self.blocks[index], self.valid[index], self.block)

    def entry_mask(self, num_entries: int) -> torch.Tensor:
        """``(N, num_entries)``: entry ``g`` lies in one of the query's candidate blocks."""
        num_blocks = -(-num_entries // self.block)
        # invalid picks land in a spare column; every write is True, so duplicates are harmless
        cols = torch.where(self.valid, self.blocks, num_blocks)
        hit = torch.zeros(
            (cols.shape[0], num_blocks + 1), dtype=torch.bool, device=self.blocks.device
        )
        hit.scatter_(1, cols, True)
        g = torch.arange(num_entries, device=self.blocks.device)
        return hit[:, g // self.block]

    def restrict(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits (N, G)`` with every entry outside the candidates at -inf."""
        return logits.masked_fill(~self.entry_mask(logits.shape[1]), float("-inf"))


def block_scores(logits: torch.Tensor, block: int) -> torch.Tensor:
    """``(N, ceil(G / block))``: the max of each block's logits (-inf past the visible ones)."""
    n, g = logits.shape
    pad = -g % block
    if pad:
        logits = torch.cat((logits, logits.new_full((n, pad), float("-inf"))), dim=1)
    return logits.view(n, -1, block).amax(dim=-1)


def select_candidates(
    logits: torch.Tensor, visible_len: torch.Tensor, num_blocks: int, block: int
) -> Candidates:
    """The candidate blocks of each query from the candidate layer's ``logits (N, G)`` (-inf
    past ``visible_len (N,)``, which is at most ``G``): the newest visible entry's block, then
    the ``num_blocks - 1`` best other blocks by `block_scores` (ties to the lowest block).
    A query that sees nothing gets no valid block. No host synchronisation (CUDA graphs)."""
    scores = block_scores(logits, block)
    newest = ((visible_len - 1).clamp(min=0) // block).to(torch.long)[:, None]
    scores = scores.scatter(1, newest, float("-inf"))  # ranked apart: always kept
    blocks, valid = newest, (visible_len > 0)[:, None]
    k = min(num_blocks - 1, scores.shape[1])
    if k > 0:
        values, best = ops.topk_lowest_index(scores, k)
        blocks = torch.cat((blocks, best), dim=1)
        valid = torch.cat((valid, torch.isfinite(values)), dim=1)
    return Candidates(blocks, valid, block)


def refuse_candidates(cfg, what: str) -> None:
    """Raises `ValueError` when ``cfg`` turns shared candidates on: ``what`` (a forward that
    does not apply them) would otherwise compute another model without saying so."""
    if cfg.candidate_source is not None:
        raise ValueError(f"{what} does not apply V4.1 shared candidates (candidate_source="
                         f"{cfg.candidate_source}); use the reference or the runner")
