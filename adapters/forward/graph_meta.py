"""The metadata of a graph step: every slot it writes or reads, computed on the device from raw
batch state (page tables, lengths) with the core's formulas (`shadowradix.slots` over torch).

One builder serves decode and verify: a verify step runs ``T`` tokens per request at positions
``[length - T, length)``, a decode step is its ``T = 1`` case. Rows are request-major, ``N = B*T``::

    SWA slot / window / ring row of t    slots.page_slot / window_first / ring_row, per row
    group completing at t                its rows [group_first(g), t]: positions >= length - T
                                         are this step's rows, earlier ones carried from the ring
    entries                              every row sees visible_entries(t), its own step's
                                         included (written before any row reads)

Tensor ops only, no host syncs, no data-dependent shapes: the builder is captured in the step's
CUDA graph. Writes of padding rows and of groups that do not complete go to each pool's sentinel
row. With ``T = 1`` the per-row step layout (``row_batch``, ``group_new``) is None: a decode row
is its batch row, and its one new row is broadcast, not gathered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from adapters.kernels import PoolRows
from adapters.memory.pools import KVPools
from shadowradix import CacheConfig, slots
from shadowradix.config import StreamSpec


class StepState(Protocol):
    """The raw batch state a step reads: ``(max_batch,)`` lengths after the step (padding: 1)
    and validity, the two device page tables, and ``num_tokens`` (T) per request."""

    lengths: torch.Tensor
    valid: torch.Tensor
    vtable: torch.Tensor
    stable: torch.Tensor
    num_tokens: int


@dataclass(frozen=True)
class StreamMeta:
    ring_new: torch.Tensor  # (N,) ring row of each row's token (sentinel for padding)
    group_rows: torch.Tensor  # (N, R) ring rows of the group completing at the row
    group_src: torch.Tensor  # (N, R) 0 = ring row, 1 = this step's row, 2 = padding
    group_new: torch.Tensor | None  # (N, R) the step row of each src-1 position (T > 1)
    group: torch.Tensor  # (N,)
    entry_slot: torch.Tensor  # (N,) where the completed entry goes (sentinel if none)
    read_pages: torch.Tensor | None  # (B, G / spp) virtual pages, when page_size >= ratio
    read_slots: torch.Tensor | None  # (B, G) every entry slot, when page_size < ratio
    lengths: torch.Tensor  # (N,) complete entries of each query row (a prefix of G columns)
    width: int  # G: the entry columns of the bucket's context
    slots_per_page: int

    def rows(self, qrow: torch.Tensor | None = None) -> PoolRows:
        """Every visible entry of each query row's request, read in place through the page
        table (``page_size >= ratio``) or the slot table; ``qrow``: the batch row of each
        query row (None: one query per batch row)."""
        return PoolRows.of_tables(
            self.read_pages, self.read_slots, self.lengths, self.width, self.slots_per_page, qrow
        )


@dataclass(frozen=True)
class StepMeta:
    positions: torch.Tensor  # (N,)
    row_batch: torch.Tensor | None  # (N,) batch row of each row (None when T = 1)
    swa_new: torch.Tensor  # (N,)
    window_slots: torch.Tensor  # (N, W)
    window_mask: torch.Tensor  # (N, W)
    page_rows: torch.Tensor | None  # (N,) page_hidden row (MTP) of page-ending rows, else sentinel
    streams: dict[int, StreamMeta]
    late_window_mask: torch.Tensor | None = None  # tail-only: layers after the last KV source


def page_lookup(table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """``table[b, pos // P]`` for ``positions`` of shape ``(B, ...)``."""
    flat = slots.page_of(positions.reshape(positions.shape[0], -1), page_size)
    return torch.gather(table, 1, flat).view(positions.shape)


def step_metadata(
    cache: CacheConfig, pools: KVPools, state: StepState, batch: int, context: int
) -> StepMeta:
    """Every slot of a step over the first ``batch`` rows of ``state`` (tensor ops only).
    ``context``: the bucket's maximum length, which fixes the entry columns."""
    p, w, t_len = cache.page_size, cache.window, state.num_tokens
    valid = state.valid[:batch, None].expand(-1, t_len)
    dev = valid.device
    start = state.lengths[:batch] - t_len
    # (B, T); padding rows (length 1) would start below 0: clamped, their writes are sentinels
    pos = (start[:, None] + torch.arange(t_len, device=dev)[None, :]).clamp(min=0)
    stable = state.stable[:batch]
    page_s = page_lookup(stable, pos, p)
    swa_new = torch.where(valid, slots.page_slot(page_s, pos, p), pools.sentinel(pools.swa[0]))
    wpos = slots.window_first(pos + 1, w)[:, :, None] + torch.arange(w, device=dev)
    wmask = (wpos >= 0) & valid[:, :, None]
    wpos = wpos.clamp(min=0)
    window_slots = slots.page_slot(page_lookup(stable, wpos, p), wpos, p)
    page_rows = None
    if pools.page_hidden is not None:
        ends = valid & slots.ends_page(pos, p)
        page_rows = torch.where(ends, page_s, pools.sentinel(pools.page_hidden)).reshape(-1)
    row_batch = None
    if t_len > 1:
        row_batch = torch.arange(batch * t_len, device=dev) // t_len
    streams = {
        s.ratio: _stream_meta(cache, pools, s, state, batch, context, pos, valid, page_s)
        for s in cache.streams
    }
    n = batch * t_len
    return StepMeta(
        pos.reshape(n),
        row_batch,
        swa_new.reshape(n),
        window_slots.reshape(n, w),
        wmask.reshape(n, w),
        page_rows,
        streams,
    )


def _stream_meta(
    cache: CacheConfig,
    pools: KVPools,
    s: StreamSpec,
    state: StepState,
    batch: int,
    context: int,
    pos: torch.Tensor,
    valid: torch.Tensor,
    page_s: torch.Tensor,
) -> StreamMeta:
    p, r, ring_len, t_len = cache.page_size, s.ratio, s.ring_len, state.num_tokens
    # the first layer of a ratio is a KV source (ModelConfig validates it): it owns pools
    layer = next(i for i, x in enumerate(cache.compress_ratios) if x == r)
    dev, n = pos.device, batch * t_len
    stable, vtable = state.stable[:batch], state.vtable[:batch]
    ring_new = torch.where(
        valid, slots.ring_row(page_s, pos, ring_len), pools.sentinel(pools.ring[layer])
    )
    complete = slots.completes_group(pos, r) & valid
    group = slots.group_of(pos, r).clamp(min=0)
    width = 2 * r if s.overlap else r
    rpos = slots.group_first(group, r, s.overlap)[:, :, None] + torch.arange(width, device=dev)
    first = pos[:, :1, None]  # the step's first position
    src = torch.where(rpos < 0, 2, torch.where(rpos >= first, 1, 0))
    group_new = None
    if t_len > 1:
        rows_of_b = torch.arange(batch, device=dev)[:, None, None] * t_len
        group_new = (rows_of_b + (rpos - first).clamp(0, t_len - 1)).reshape(n, width)
    rpos_c = rpos.clamp(min=0)
    group_rows = slots.ring_row(page_lookup(stable, rpos_c, p), rpos_c, ring_len)
    spp = s.slots_per_page
    entry = slots.compressed_slot(page_lookup(vtable, pos, p), pos, p, r, spp)
    entry_slot = torch.where(complete, entry, _entry_sentinel(cache, pools, layer, spp))
    read_pages = read_slots = None
    if p >= r:
        npages = -(-context // p)
        read_pages = vtable[:, :npages]
        columns = npages * spp
    else:
        columns = max(1, context // r)
        ends = slots.group_end(torch.arange(columns, device=dev), r)[None, :]
        ends_b = ends.expand(batch, -1)
        read_slots = slots.compressed_slot(page_lookup(vtable, ends_b, p), ends, p, r, spp)
    # no (N, G) mask: the visible entries are a prefix of each row, counted directly
    lengths = torch.where(valid, slots.visible_entries(pos, r).clamp(max=columns), 0)
    return StreamMeta(
        ring_new.reshape(n),
        group_rows.reshape(n, width),
        src.reshape(n, width),
        group_new,
        group.reshape(n),
        entry_slot.reshape(n),
        read_pages,
        read_slots,
        lengths.reshape(n),
        columns,
        spp,
    )


def _entry_sentinel(cache: CacheConfig, pools: KVPools, layer: int, spp: int) -> int:
    """The slot a step's rows that complete no entry write to: the compressed pool's sentinel
    row, or, for C4 KV held by HiSparse (no device pool), the first row of its host mirror's
    sentinel page (`C4Offload` allocates ``max_full_pages + 1`` pages)."""
    if layer in pools.compressed:
        return pools.sentinel(pools.compressed[layer])
    return cache.max_full_pages * spp
