"""The torch paths of `adapters.kernels.hisparse_step` (CPU, and the kernels' reference): the
same rows, counts and flags from plain tensor ops, every shape fixed (graph-capturable)."""

from __future__ import annotations

import torch


def gather_selected(
    buf: torch.Tensor, mirror: torch.Tensor, table: torch.Tensor, slots: torch.Tensor,
    valid: torch.Tensor, reads: torch.Tensor, counts: torch.Tensor, spp: int,
) -> torch.Tensor:  # fmt: skip
    """As `hisparse_step.gather_selected` (both gathers, then a select)."""
    page = slots // spp
    slot = table[torch.where(valid, page, table.shape[0] - 1)]
    hit = valid & (slot >= 0)
    miss = valid & (slot < 0)
    brow = torch.where(hit, slot * spp + slots % spp, buf.shape[0] - 1)
    mrow = torch.where(miss, slots, 0)
    out = torch.where(miss[:, None], mirror[mrow], buf[brow])
    reads.index_add_(0, torch.where(valid, page, table.shape[0] - 1),
                     valid.to(reads.dtype))  # fmt: skip
    counts += torch.stack((hit.sum(), valid.sum()))
    return out


def store_written(
    buf: torch.Tensor, mirror: torch.Tensor, table: torch.Tensor, entry_slot: torch.Tensor,
    values: torch.Tensor, wrote: torch.Tensor, spp: int,
) -> None:  # fmt: skip
    """As `hisparse_step.store_written` (a page the table does not map writes the buffer's
    sentinel row, which nothing reads)."""
    page = entry_slot // spp
    slot = table[page]
    brow = torch.where(slot >= 0, slot * spp + entry_slot % spp, buf.shape[0] - 1)
    x = values.to(mirror.dtype)
    buf[brow] = x
    mirror[entry_slot] = x
    wrote.index_fill_(0, page, True)
