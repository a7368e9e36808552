"""Speculative verify steps with metadata computed on the device: `GraphDecoder` for T tokens.

A verify step runs ``T = k + 1`` tokens per request (the pending token and k drafts, extended
with ``extend_draft_batch``) at positions ``[length - T, length)``. Every slot is the core's
shadow arithmetic on the raw batch state of `DecodeBuffers` (page tables, lengths), as in
`graph_decode`, now per row ``(b, j)``:

```
SWA slot / window / ring row of t    as in decode, for each of the T positions
group completing at t                its rows [g·r − r·overlap, t]: positions >= length − T
                                     are this step's rows, earlier ones carried from the ring
entries                              every row sees entries g < (t + 1) // r, its own step's
                                     included (written before any row reads)
```

Carried rows are gathered before the step stores its rows. A request's T positions never share
a ring row (``T <= max_draft_len``), and no stored row overwrites a carried one: a new position
``p`` and a carried ``q`` of the same page are less than ``T + span <= ring_len`` apart. The
indexer scores each request's entries once for its T queries. With the MTP layer, the step also
stores the MTP state of its rows (`mtp.write_state`). On CUDA each (batch, context) bucket is
captured once as a CUDA graph; on the CPU the same code runs eagerly.

Rejected drafts leave stale page ids beyond a request's committed pages in the device tables:
`VerifyBuffers.load_block` re-uploads from the first page a draft could have allocated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shadowradix import CacheConfig
from shadowradix.request import Request

from . import ops
from .buckets import context_bucket, power_bucket
from .graph_decode import (
    DecodeBuffers,
    GraphDecoder,
    GraphKeys,
    _page_lookup,
    _with_late_mask,
)
from .kernels import PoolRows
from .model import final_hidden, head_logits
from .mtp import write_state
from .pools import KVPools
from .weights import ModelWeights


class VerifyBuffers(DecodeBuffers):
    """`DecodeBuffers` plus each slot's T tokens and the hidden state before its first one."""

    def __init__(
        self, cache: CacheConfig, max_batch: int, max_context: int, num_tokens: int, weights
    ) -> None:
        super().__init__(cache, max_batch, max_context, weights.device)
        self.num_tokens = num_tokens
        dev = weights.device
        self.block = torch.zeros(max_batch, num_tokens, device=dev, dtype=torch.long)
        self.prev_hidden = torch.zeros(
            max_batch, weights.config.hidden, device=dev, dtype=weights.dtype
        )

    def load_block(
        self, requests: list[Request], chunks: list[list[int]], prev_hidden: torch.Tensor | None
    ) -> None:
        """Raw state of a verify step: ``requests`` were just extended by ``chunks`` (T tokens
        each). Pages from the first one this step's draft could have allocated are uploaded
        again: a rejected draft's pages went back to the allocator, and its page ids may have
        changed since."""
        p, t = self.page_size, self.num_tokens
        for i, r in enumerate(requests):
            rid, vdone, sdone = self._uploaded[i]
            if rid == r.id:
                first_draft_page = -(-(r.length - t) // p)
                self._uploaded[i] = (
                    rid,
                    min(vdone, first_draft_page),
                    min(sdone, first_draft_page),
                )
        super().load(requests, [c[0] for c in chunks])
        b = len(requests)
        self.block[:b] = torch.tensor(chunks, dtype=torch.long).to(self.block.device)
        if prev_hidden is not None:
            self.prev_hidden[:b] = prev_hidden.to(self.prev_hidden.dtype)


@dataclass(frozen=True)
class VerifyStreamMeta:
    ring_new: torch.Tensor  # (N,) ring row of each row's token (sentinel for padding)
    group_rows: torch.Tensor  # (N, R) ring rows of the group completing at the row
    group_src: torch.Tensor  # (N, R) 0 = ring row, 1 = this step's row, 2 = padding
    group_new: torch.Tensor  # (N, R) the step row of each src-1 position
    group: torch.Tensor  # (N,)
    entry_slot: torch.Tensor  # (N,) where the completed entry goes (sentinel if none)
    read_pages: torch.Tensor | None  # (B, G / spp) virtual pages, when page_size >= ratio
    read_slots: torch.Tensor | None  # (B, G) every entry slot, when page_size < ratio
    lengths: torch.Tensor  # (N,) complete entries of each query row (a prefix of G columns)
    width: int  # G
    slots_per_page: int

    def rows(self, qrow: torch.Tensor | None = None) -> PoolRows:
        """Every visible entry of each query row (see `StreamMeta.rows`)."""
        return PoolRows.of_tables(
            self.read_pages, self.read_slots, self.lengths, self.width, self.slots_per_page, qrow
        )


@dataclass(frozen=True)
class VerifyMeta:
    positions: torch.Tensor  # (N,) N = B * T, request-major
    row_batch: torch.Tensor  # (N,)
    swa_new: torch.Tensor
    window_slots: torch.Tensor  # (N, W)
    window_mask: torch.Tensor
    page_rows: torch.Tensor  # (N,) page_hidden row (MTP) of page-ending rows, else sentinel
    streams: dict[int, VerifyStreamMeta]
    late_window_mask: torch.Tensor | None = None  # tail-only: layers after the last KV source


def verify_metadata(
    cache: CacheConfig, pools: KVPools, buf: VerifyBuffers, batch: int, context: int
) -> VerifyMeta:
    """Every slot of a verify step over the first ``batch`` slots (tensor ops only)."""
    p, w, t_len = cache.page_size, cache.window, buf.num_tokens
    valid = buf.valid[:batch, None].expand(-1, t_len)
    dev = valid.device
    start = buf.lengths[:batch] - t_len
    # (B, T); padding slots (length 1) would start below 0: clamped, their writes are sentinels
    pos = (start[:, None] + torch.arange(t_len, device=dev)[None, :]).clamp(min=0)
    stable = buf.stable[:batch]
    page_s = _page_lookup(stable, pos, p)
    swa_new = torch.where(valid, page_s * p + pos % p, pools.sentinel(pools.swa[0]))
    wpos = pos[:, :, None] - (w - 1) + torch.arange(w, device=dev)
    wmask = (wpos >= 0) & valid[:, :, None]
    wpos = wpos.clamp(min=0)
    window_slots = _page_lookup(stable, wpos, p) * p + wpos % p
    page_rows = swa_new.new_zeros(swa_new.shape)
    if pools.page_hidden is not None:
        ends = valid & ((pos + 1) % p == 0)
        page_rows = torch.where(ends, page_s, pools.sentinel(pools.page_hidden))
    row_batch = torch.arange(batch * t_len, device=dev) // t_len
    streams = {}
    for s in cache.streams:
        streams[s.ratio] = _stream_meta(cache, pools, s, buf, batch, context, pos, valid, page_s)
    n = batch * t_len
    return VerifyMeta(
        pos.reshape(n),
        row_batch,
        swa_new.reshape(n),
        window_slots.reshape(n, w),
        wmask.reshape(n, w),
        page_rows.reshape(n),
        streams,
    )


def _stream_meta(cache, pools, s, buf, batch, context, pos, valid, page_s) -> VerifyStreamMeta:
    p, r, ring_len, t_len = cache.page_size, s.ratio, s.ring_len, buf.num_tokens
    layer = next(i for i, x in enumerate(cache.compress_ratios) if x == r)
    dev, n = pos.device, batch * t_len
    stable, vtable = buf.stable[:batch], buf.vtable[:batch]
    ring_new = torch.where(
        valid, page_s * ring_len + pos % ring_len, pools.sentinel(pools.ring[layer])
    )
    complete = ((pos + 1) % r == 0) & valid
    group = ((pos + 1) // r - 1).clamp(min=0)
    width = 2 * r if s.overlap else r
    rpos = (group * r - (r if s.overlap else 0))[:, :, None] + torch.arange(width, device=dev)
    start = pos[:, :1, None]
    src = torch.where(rpos < 0, 2, torch.where(rpos >= start, 1, 0))
    rows_of_b = torch.arange(batch, device=dev)[:, None, None] * t_len
    group_new = rows_of_b + (rpos - start).clamp(0, t_len - 1)
    rpos_c = rpos.clamp(min=0)
    group_rows = _page_lookup(stable, rpos_c, p) * ring_len + rpos_c % ring_len
    entry = _page_lookup(vtable, pos, p) * s.slots_per_page + (pos % p) // r
    entry_slot = torch.where(complete, entry, pools.sentinel(pools.compressed[layer]))
    read_pages = read_slots = None
    if p >= r:
        npages = -(-context // p)
        read_pages = vtable[:, :npages]
        columns = npages * s.slots_per_page
    else:
        columns = max(1, context // r)
        g = torch.arange(columns, device=dev)
        ends = ((g + 1) * r - 1)[None, :].expand(batch, -1)
        read_slots = _page_lookup(vtable, ends, p) * s.slots_per_page
    lengths = torch.where(valid, ((pos + 1) // r).clamp(max=columns), 0)  # (B, T): prefixes
    return VerifyStreamMeta(
        ring_new.reshape(n),
        group_rows.reshape(n, width),
        src.reshape(n, width),
        group_new.reshape(n, width),
        group.reshape(n),
        entry_slot.reshape(n),
        read_pages,
        read_slots,
        lengths.reshape(n),
        columns,
        s.slots_per_page,
    )


class VerifyKeys(GraphKeys):
    """`KeySource` of one verify step over `VerifyMeta`: `GraphKeys` (V4.1 sharing and the
    tail-only mask included) with ``T`` query rows per request."""

    def __init__(self, weights: ModelWeights, pools: KVPools, meta: VerifyMeta, t_len: int):
        super().__init__(weights, pools, meta)  # type: ignore[arg-type]
        self.t_len = t_len

    def _qrow(self) -> torch.Tensor:
        return self.meta.row_batch  # type: ignore[attr-defined]

    def _new_group_rows(self, rows: torch.Tensor, sm) -> torch.Tensor:
        return rows[sm.group_new]

    def _own_ring_rows(self, sm) -> torch.Tensor:
        return sm.ring_new[sm.group_new]

    def _compress_fused_on_cpu(self, layer, comp, sm, ring, pool) -> None:
        """The CUDA path's layout on any device (tests): `kernels.compress_gathered` falls
        back to its torch reference off the GPU."""
        rows = ops.compressor_rows(layer.x, comp, layer.positions).to(ring.dtype)
        self._compress_fused(layer, comp, sm, ring, pool, rows)


class GraphVerifier(GraphDecoder):
    """Verify steps of ``num_tokens`` tokens per request from raw batch state; with ``mtp``
    also the MTP layer's state of every row. CUDA graphs per (batch, context) bucket on GPU,
    eager on the CPU (tested in CI against the paged path and the reference)."""

    def __init__(
        self,
        weights: ModelWeights,
        pools: KVPools,
        cache: CacheConfig,
        max_batch: int,
        max_context: int,
        num_tokens: int,
        mtp: bool = False,
        use_graphs: bool | None = None,
        min_context_bucket: int = 1024,
    ) -> None:
        if mtp and pools.page_hidden is None:
            raise ValueError("MTP state needs KVPools(..., mtp=True)")
        super().__init__(
            weights, pools, cache, max_batch, max_context, use_graphs, min_context_bucket
        )
        self.buffers: VerifyBuffers = VerifyBuffers(  # type: ignore[assignment]
            cache, max_batch, max_context, num_tokens, weights
        )
        self.num_tokens, self.mtp = num_tokens, mtp

    @torch.no_grad()
    def _run(self, batch: int, context: int) -> torch.Tensor:
        """Logits and hidden states of every row, packed into one tensor (one graph output):
        ``(B*T, V + D)`` in fp32, or fp64 for an fp64 model (both halves exact)."""
        buf, w = self.buffers, self.weights
        meta = verify_metadata(self.cache, self.pools, buf, batch, context)
        meta = _with_late_mask(meta, self.pools)
        keys = VerifyKeys(w, self.pools, meta, self.num_tokens)
        tokens = buf.block[:batch].reshape(-1)
        hidden = final_hidden(w, tokens, meta.positions, keys)
        if self.mtp:
            d = hidden.shape[1]
            rows = hidden.view(batch, self.num_tokens, d)
            prev = torch.cat((buf.prev_hidden[:batch, None], rows[:, :-1]), dim=1).view(-1, d)
            write_state(
                w, self.pools, hidden, prev, tokens, meta.positions, meta.swa_new, meta.page_rows
            )
        logits = head_logits(w, hidden)
        packed = torch.promote_types(logits.dtype, hidden.dtype)
        return torch.cat((logits.to(packed), hidden.to(packed)), dim=1)

    def verify(
        self,
        requests: list[Request],
        chunks: list[list[int]],
        prev_hidden: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``(B*T, V)`` (fp32) and hidden states ``(B*T, D)`` of a verify step; the
        requests were just extended by ``chunks`` (``num_tokens`` each). ``prev_hidden``
        ``(B, D)``: the main hidden state before each chunk (needed with ``mtp``)."""
        if any(len(c) != self.num_tokens for c in chunks):
            raise ValueError(f"a verify step takes exactly {self.num_tokens} tokens per request")
        self.buffers.load_block(requests, chunks, prev_hidden)
        longest = max(r.length for r in requests)
        context = context_bucket(longest, self.min_context_bucket, self.buffers.max_context)
        batch = min(power_bucket(len(requests), 1), self.buffers.max_batch)
        if not self.use_graphs:
            packed = self._run(batch, context)
        else:  # pragma: no cover - needs a GPU
            packed = self._replay(batch, context)
        n, v = len(requests) * self.num_tokens, self.weights.config.vocab_size
        return packed[:n, :v].float(), packed[:n, v:].to(self.weights.dtype)
