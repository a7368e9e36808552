"""One rank's index tensors for a context-parallel prefill, built once and shared by every layer
(as `adapters.forward.paged.PagedStep` is for a paged step): where each local query's window
keys come from, what the halo exchange sends and receives, and per compression ratio which
groups this rank compresses, which raw rows it ships for the overlap, and how the gathered
parts assemble into the whole sequence's entries at their global group indices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from adapters.distributed.cp_layout import I64, CPLayout


def _t(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=I64)).to(device)


@dataclass(frozen=True)
class WindowPlan:
    """SWA keys of the local queries from ``cat(local kv, halo kv)``."""

    rows: torch.Tensor  # (N, W) row of each window position in cat(local, halo); 0 if masked
    mask: torch.Tensor  # (N, W) position >= 0
    sends: dict[int, torch.Tensor]  # dst -> local rows it needs from this rank
    recv_rows: dict[int, int]  # src -> how many halo rows it sends here
    halo_index: dict[int, torch.Tensor]  # src -> where its rows go in the halo
    halo_len: int


@dataclass(frozen=True)
class RankGroups:
    """What one rank contributes to a ratio's all-gather."""

    entry_groups: np.ndarray  # (E,) groups it compresses itself (their rows are all its own)
    row_groups: np.ndarray  # (R,) groups whose raw rows it ships (C4 overlap boundaries)


@dataclass(frozen=True)
class StreamPlan:
    """One compression ratio: every rank's contribution and this rank's inputs."""

    ratio: int
    overlap: bool
    num_groups: int  # complete groups of the whole prompt
    ranks: tuple[RankGroups, ...]
    entry_src: torch.Tensor  # (E, R) this rank's groups' rows in cat(local rows, pad row)
    entry_groups: torch.Tensor  # (E,)
    row_src: torch.Tensor  # (R', ratio) local rows of the groups this rank ships
    cross_groups: torch.Tensor  # (B,) groups whose previous group lives on another rank
    cross_src: torch.Tensor  # (B, 2 ratio) their rows in the bank of every shipped group
    placed: tuple[torch.Tensor, ...]  # per rank: its entry groups (where its entries go)

    def payload_len(self, rank: int, dims: list[tuple[int, int]]) -> int:
        """Elements of ``rank``'s all-gather part for compressors of ``(dim, row width)``."""
        g = self.ranks[rank]
        return sum(len(g.entry_groups) * d + len(g.row_groups) * self.ratio * f for d, f in dims)


def window_plan(layout: CPLayout, rank: int, window: int, device: torch.device) -> WindowPlan:
    pos = layout.positions(rank)
    halo = layout.halo(rank, window)
    want = pos[:, None] - (window - 1) + np.arange(window, dtype=I64)[None, :]
    mask = want >= 0
    want = np.where(mask, want, pos[:1, None] if len(pos) else 0)
    mine = layout.owner(want) == rank
    rows = np.where(mine, layout.local_row(want), len(pos) + np.searchsorted(halo, want))
    rows = np.where(mask, rows, 0)
    src = layout.owner(halo)
    sends = {}
    for dst in range(layout.cp):
        if dst != rank:
            theirs = layout.halo(dst, window)
            sends[dst] = _t(layout.local_row(theirs[layout.owner(theirs) == rank]), device)
    return WindowPlan(
        rows=_t(rows, device),
        mask=torch.from_numpy(mask).to(device),
        sends=sends,
        recv_rows={s: int((src == s).sum()) for s in range(layout.cp) if s != rank},
        halo_index={s: _t(np.flatnonzero(src == s), device) for s in range(layout.cp)},
        halo_len=len(halo),
    )


def _rank_groups(layout: CPLayout, rank: int, ratio: int, overlap: bool) -> RankGroups:
    groups = layout.complete_groups(rank, ratio)
    if not overlap:
        return RankGroups(groups, np.zeros(0, I64))
    cross = layout.crosses(groups, ratio)
    nxt = groups + 1
    feeds_next = (nxt < layout.length // ratio) & layout.crosses(nxt, ratio)
    return RankGroups(groups[~cross], groups[cross | feeds_next])


def _group_rows(layout: CPLayout, groups: np.ndarray, ratio: int) -> np.ndarray:
    return layout.local_row(groups[:, None] * ratio + np.arange(ratio, dtype=I64)[None, :])


def stream_plan(
    layout: CPLayout, rank: int, ratio: int, overlap: bool, device: torch.device
) -> StreamPlan:
    ranks = tuple(_rank_groups(layout, q, ratio, overlap) for q in range(layout.cp))
    own = ranks[rank]
    pad = len(layout.positions(rank))  # the pad row (kv 0, score -inf) after the local rows
    src = _group_rows(layout, own.entry_groups, ratio)
    if overlap:  # group 0's previous group is the pad; every other is local (not crossing)
        prev = np.where(own.entry_groups[:, None] > 0, src - ratio, pad)
        src = np.concatenate((prev, src), axis=1)
    bank = np.concatenate([g.row_groups for g in ranks])  # shipped groups, rank by rank
    cross = np.concatenate([g.row_groups[layout.crosses(g.row_groups, ratio)] for g in ranks])
    cross = np.sort(cross)
    at = {int(g): i for i, g in enumerate(bank)}
    cross_src = np.array([[at[int(g) - 1], at[int(g)]] for g in cross], I64).reshape(-1, 2)
    return StreamPlan(
        ratio=ratio,
        overlap=overlap,
        num_groups=layout.length // ratio,
        ranks=ranks,
        entry_src=_t(src.reshape(len(own.entry_groups), ratio * (2 if overlap else 1)), device),
        entry_groups=_t(own.entry_groups, device),
        row_src=_t(_group_rows(layout, own.row_groups, ratio), device),
        cross_groups=_t(cross, device),
        cross_src=_t(cross_src, device),
        placed=tuple(_t(g.entry_groups, device) for g in ranks),
    )
