"""HiSparse graph decode's two row movers, each one kernel (`adapters.memory.residency`): a
captured step spends its HiSparse time in these instead of a dozen small torch ops per C4 layer
(page lookups, masks, index arithmetic, counters).

* `gather_selected`: each selected entry from the device buffer when the table maps its page,
  else zero-copy from the pinned host mirror. The page's flag masks the two loads, so a resident
  entry reads the buffer only and a missing one the mirror only (a masked load issues no memory
  traffic: the bus carries the misses, nothing else); an invalid entry (padding past a query's
  top-k) reads the buffer's sentinel row. It adds one read per valid entry to its page's count
  (the window's records) and the hit / read totals to ``counts``.
* `store_written`: each completed entry to its mirror row, and to its buffer row when the table
  maps its page (write-through); flags its page written.

Reference: `adapters.kernels.hisparse_reference` (tested equal under the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: elements of one program's tile (entries x columns)
TILE = 4096


@triton.jit
def _gather_kernel(
    buf, mirror, table, slots, valid, reads, counts, out, R, spp, buf_sentinel,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    inside = r < R
    s = tl.load(slots + r, mask=inside, other=0)
    v = (tl.load(valid + r, mask=inside, other=0) != 0) & inside
    page = s // spp
    slot = tl.load(table + page, mask=v, other=-1)
    miss = v & (slot < 0)
    hit = v & (slot >= 0)
    tl.atomic_add(reads + page, tl.full([BLOCK_R], 1, tl.int32), mask=v)
    tl.atomic_add(counts, tl.sum(hit.to(tl.int64), axis=0))
    tl.atomic_add(counts + 1, tl.sum(v.to(tl.int64), axis=0))
    brow = tl.where(hit, slot * spp + s % spp, buf_sentinel)
    cols = tl.arange(0, BLOCK_D)
    cin = cols < D
    on_buf = (inside & (miss == 0))[:, None] & cin[None, :]
    on_mirror = miss[:, None] & cin[None, :]
    vb = tl.load(buf + brow[:, None] * D + cols[None, :], mask=on_buf, other=0.0)
    vm = tl.load(mirror + s[:, None] * D + cols[None, :], mask=on_mirror, other=0.0)
    tl.store(out + r[:, None] * D + cols[None, :], tl.where(miss[:, None], vm, vb),
             mask=inside[:, None] & cin[None, :])  # fmt: skip


def gather_selected(
    buf: torch.Tensor, mirror: torch.Tensor, table: torch.Tensor, slots: torch.Tensor,
    valid: torch.Tensor, reads: torch.Tensor, counts: torch.Tensor, spp: int,
) -> torch.Tensor:  # fmt: skip
    """Rows ``(R, D)`` of the flat ``(R,)`` compressed ``slots`` (``valid`` masks padding):
    ``buf`` and ``mirror`` are ``(rows, D)`` contiguous in one dtype, the last row of ``buf``
    its sentinel; ``table`` maps a page (``slot // spp``) to its buffer slot or ``-1``.
    ``reads`` (int32, by page) and ``counts`` (int64: entries hit, entries read) are added
    to."""
    rows, d = slots.shape[0], buf.shape[1]
    out = torch.empty((rows, d), dtype=buf.dtype, device=buf.device)
    if rows:
        block_d = triton.next_power_of_2(d)
        block_r = max(1, TILE // block_d)
        _gather_kernel[(triton.cdiv(rows, block_r),)](
            buf, mirror, table, slots, valid.view(torch.int8), reads, counts, out, rows, spp,
            buf.shape[0] - 1,
            D=d, BLOCK_R=block_r, BLOCK_D=block_d,
        )  # fmt: skip
    return out


@triton.jit
def _store_kernel(
    buf, mirror, table, entry_slot, values, wrote, spp, D: tl.constexpr, BLOCK_D: tl.constexpr
):
    r = tl.program_id(0).to(tl.int64)
    e = tl.load(entry_slot + r)
    page = e // spp
    slot = tl.load(table + page)
    cols = tl.arange(0, BLOCK_D)
    cin = cols < D
    x = tl.load(values + r * D + cols, mask=cin).to(mirror.dtype.element_ty)
    tl.store(mirror + e * D + cols, x, mask=cin)
    mapped = (tl.zeros([BLOCK_D], dtype=tl.int64) + slot) >= 0  # the page's flag, per column
    tl.store(buf + (slot * spp + e % spp) * D + cols, x, mask=cin & mapped)
    tl.store(wrote + page, 1)


def store_written(
    buf: torch.Tensor, mirror: torch.Tensor, table: torch.Tensor, entry_slot: torch.Tensor,
    values: torch.Tensor, wrote: torch.Tensor, spp: int,
) -> None:  # fmt: skip
    """``values[r]`` (``(R, D)``, cast to the mirror's dtype) to mirror row ``entry_slot[r]``
    (the mirror's sentinel row for none) and, when ``table`` maps its page, to its buffer row;
    ``wrote[page] = True``."""
    rows, d = entry_slot.shape[0], mirror.shape[1]
    if rows:
        _store_kernel[(rows,)](
            buf, mirror, table, entry_slot, values.contiguous(), wrote.view(torch.int8), spp,
            D=d, BLOCK_D=triton.next_power_of_2(d),
        )  # fmt: skip
