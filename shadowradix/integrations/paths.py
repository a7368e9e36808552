"""The page ids a `MatchResult` reuses, before any request holds them.

Engines report a hit's blocks at lookup time (SGLang's ``device_indices``, vLLM's computed
blocks), but the core hands page ids out only through an admitted `Request`. Until it offers a
read-only view of a match's pages, this module is the one place in the shims that reads tree
nodes (``path_from_root``, ``start_page``, ``vpages``, ``swa_pages``, ``live_from``): pure
reads along the matched path. Call it right after `match_prefix`: a match's node describes the
tree as it was then (a later split moves its pages).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..results import MatchResult, WindowSource


def prefix_vpages(match: MatchResult) -> list[int]:
    """Virtual page ids of ``match``'s first ``prefix_len`` tokens, in prefix order."""
    if match.prefix_len == 0:
        return []
    path = match.node.path_from_root()
    out = [v for n in path[:-1] for v in n.vpages]
    out += path[-1].vpages[: match.node_pages]
    return out


def window_swa_pages(match: MatchResult, first_page: int) -> list[int]:
    """The tree's SWA page ids of pages ``[first_page, prefix_len / page)``: the live window a
    LIVE match reuses (empty for NONE and REPLAY matches: a replayed window is private)."""
    if match.window is not WindowSource.LIVE:
        return []
    out: list[int] = []
    path = match.node.path_from_root()
    for i, n in enumerate(path):
        used = match.node_pages if i == len(path) - 1 else n.num_pages
        lo = max(first_page - n.start_page, 0)
        if lo >= used:
            continue
        assert lo >= n.live_from, "a LIVE match's window is live SWA"
        out.extend(n.swa_pages[lo - n.live_from : used - n.live_from])
    return out


def slots_of(vpages: Sequence[int], length: int, page_size: int) -> np.ndarray:
    """Virtual slots of positions ``[0, length)`` for a page table (SGLang's KV indices)."""
    pages = np.asarray(vpages[: -(-length // page_size)], dtype=np.int64)
    slots = (pages[:, None] * page_size + np.arange(page_size, dtype=np.int64)).ravel()
    return slots[:length]
