"""Batched decode with per-step metadata computed on the device from raw batch state.

The only per-step inputs are raw state in fixed device buffers: each slot's new token, its
length, and two page tables (virtual pages, and SWA pages indexed by absolute page). Every slot
number the step needs (the new SWA slot, the window, ring rows, the carried rows of a completing
group, its compressed slot, every complete entry) is the core's shadow arithmetic, re-expressed
as tensor ops, so the whole step can be captured once in a CUDA graph and replayed. Writes of
padding slots and of groups that do not complete go to each pool's sentinel row.

The host keeps the device tables current incrementally: decode only appends pages, so a step
uploads the few new page ids, not the tables.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from shadowradix import CacheConfig
from shadowradix.request import Request

from . import kernels, ops
from .buckets import context_bucket, power_bucket
from .kernels import PoolRows
from .model import LayerInput, compress_rows, forward
from .pools import KVPools
from .weights import ModelWeights


@dataclass(frozen=True)
class StreamMeta:
    ring_new: torch.Tensor  # (B,) ring row of the new token (sentinel for padding)
    group_rows: torch.Tensor  # (B, R) ring rows of the group completing at the token
    group_src: torch.Tensor  # (B, R) 0 = ring row, 1 = the new token, 2 = padding
    group: torch.Tensor  # (B,)
    entry_slot: torch.Tensor  # (B,) where the completed entry goes (sentinel if none)
    read_pages: torch.Tensor | None  # (B, G / spp) virtual pages, when page_size >= ratio
    read_slots: torch.Tensor | None  # (B, G) every entry slot, when page_size < ratio
    lengths: torch.Tensor  # (B,) complete entries (a prefix of the G columns; 0 for padding)
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
class DecodeMeta:
    positions: torch.Tensor
    swa_new: torch.Tensor
    window_slots: torch.Tensor
    window_mask: torch.Tensor
    streams: dict[int, StreamMeta]
    late_window_mask: torch.Tensor | None = None  # tail-only: layers after the last KV source


class DecodeBuffers:
    """Fixed device buffers of raw batch state for ``max_batch`` slots."""

    def __init__(self, cache: CacheConfig, max_batch: int, max_context: int, device) -> None:
        pages = -(-max_context // cache.page_size) + 1
        z = {"device": device, "dtype": torch.long}
        self.tokens = torch.zeros(max_batch, **z)
        self.lengths = torch.ones(max_batch, **z)  # length after the new token (position + 1)
        self.valid = torch.zeros(max_batch, device=device, dtype=torch.bool)
        self.vtable = torch.zeros(max_batch, pages, **z)
        self.stable = torch.zeros(max_batch, pages, **z)
        self.max_batch, self.max_context, self.page_size = max_batch, max_context, cache.page_size
        self._uploaded: list[tuple[int, int, int]] = [(-1, 0, 0)] * max_batch  # (req, vp, sp)

    def load(self, requests: list[Request], tokens: list[int]) -> None:
        """Copies the batch's raw state in: tokens, lengths and the page ids added since the
        last step (whole rows when a slot changed request)."""
        b = len(requests)
        if b > self.max_batch:
            raise ValueError(f"batch {b} exceeds the decode buffers ({self.max_batch})")
        rows: list[int] = []
        cols: list[int] = []
        vvals: list[int] = []
        srows: list[int] = []
        scols: list[int] = []
        svals: list[int] = []
        for i, r in enumerate(requests):
            if r.length > self.max_context:
                raise ValueError(f"request length {r.length} exceeds max_context")
            rid, vdone, sdone = self._uploaded[i]
            if rid != r.id:
                vdone, sdone = 0, r.swa_base
            vp = r.vpages
            rows += [i] * (len(vp) - vdone)
            cols += range(vdone, len(vp))
            vvals += vp[vdone:]
            top = r.swa_base + len(r.swa_pages)
            lo = max(sdone, r.swa_base)
            srows += [i] * (top - lo)
            scols += range(lo, top)
            svals += r.swa_pages[lo - r.swa_base :]
            self._uploaded[i] = (r.id, len(vp), top)
        dev = self.tokens.device
        head = np.array(
            [
                tokens + [0] * (self.max_batch - b),
                [r.length for r in requests] + [1] * (self.max_batch - b),
                [1] * b + [0] * (self.max_batch - b),
            ],
            dtype=np.int64,
        )
        head_t = torch.from_numpy(head).to(dev, non_blocking=True)
        self.tokens.copy_(head_t[0])
        self.lengths.copy_(head_t[1])
        self.valid.copy_(head_t[2].bool())
        if rows:
            idx = torch.from_numpy(np.array([rows, cols, vvals], dtype=np.int64)).to(dev)
            self.vtable[idx[0], idx[1]] = idx[2]
        if srows:
            idx = torch.from_numpy(np.array([srows, scols, svals], dtype=np.int64)).to(dev)
            self.stable[idx[0], idx[1]] = idx[2]


def _page_lookup(table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """``table[b, pos // P]`` for ``positions`` of shape ``(B, ...)``."""
    flat = positions.reshape(positions.shape[0], -1) // page_size
    return torch.gather(table, 1, flat).view(positions.shape)


def decode_metadata(
    cache: CacheConfig, pools: KVPools, buf: DecodeBuffers, context: int
) -> DecodeMeta:
    """Every slot of the step from raw batch state (tensor ops only: capturable).
    ``context``: the bucket's maximum length, which fixes the entry columns."""
    p, w = cache.page_size, cache.window
    t = buf.lengths - 1
    valid = buf.valid
    dev = t.device
    swa_sentinel = pools.sentinel(pools.swa[0])
    page_s = _page_lookup(buf.stable, t[:, None], p)[:, 0]
    swa_new = torch.where(valid, page_s * p + t % p, swa_sentinel)
    wpos = t[:, None] - (w - 1) + torch.arange(w, device=dev)[None, :]
    wmask = (wpos >= 0) & valid[:, None]
    wpos = wpos.clamp(min=0)
    window_slots = _page_lookup(buf.stable, wpos, p) * p + wpos % p
    streams = {}
    for s in cache.streams:
        r, ring_len = s.ratio, s.ring_len
        # the first layer of a ratio is a KV source (ModelConfig validates it): it owns pools
        any_layer = next(i for i, x in enumerate(cache.compress_ratios) if x == r)
        ring_sentinel = pools.sentinel(pools.ring[any_layer])
        comp_sentinel = pools.sentinel(pools.compressed[any_layer])
        ring_new = torch.where(valid, page_s * ring_len + t % ring_len, ring_sentinel)
        complete = ((t + 1) % r == 0) & valid
        group = ((t + 1) // r - 1).clamp(min=0)
        width = 2 * r if s.overlap else r
        rpos = (group * r - (r if s.overlap else 0))[:, None] + torch.arange(width, device=dev)
        src = torch.where(rpos < 0, 2, torch.where(rpos == t[:, None], 1, 0))
        rpos_c = rpos.clamp(min=0)
        group_rows = _page_lookup(buf.stable, rpos_c, p) * ring_len + rpos_c % ring_len
        entry_slot = _page_lookup(buf.vtable, t[:, None], p)[:, 0] * s.slots_per_page + (t % p) // r
        entry_slot = torch.where(complete, entry_slot, comp_sentinel)
        read_pages = read_slots = None
        if p >= r:
            npages = -(-context // p)
            read_pages = buf.vtable[:, :npages]
            columns = npages * s.slots_per_page
        else:
            columns = max(1, context // r)
            g = torch.arange(columns, device=dev)
            ends_b = ((g + 1) * r - 1)[None, :].expand(t.shape[0], -1)
            read_slots = _page_lookup(buf.vtable, ends_b, p) * s.slots_per_page
        # no (B, G) mask: the visible entries are a prefix of each row, counted directly
        lengths = torch.where(valid, ((t + 1) // r).clamp(max=columns), 0)
        streams[r] = StreamMeta(
            ring_new,
            group_rows,
            src,
            group,
            entry_slot,
            read_pages,
            read_slots,
            lengths,
            columns,
            s.slots_per_page,
        )
    return DecodeMeta(t, swa_new, window_slots, wmask, streams)


class GraphKeys:
    """`KeySource` of one decode step over `DecodeMeta`. V4.1 sharing as in `PagedKeys`:
    KV-source layers compress, consumers read their source's pools; index sources publish
    their selection, other C4 layers reuse it."""

    def __init__(self, weights: ModelWeights, pools: KVPools, meta: DecodeMeta) -> None:
        self.cfg, self.pools, self.meta = weights.config, pools, meta
        self.selection: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def attend(self, layer: LayerInput) -> torch.Tensor:
        cfg, m, i = self.cfg, self.meta, layer.index
        swa = self.pools.swa[i]
        self.pools.store(swa, m.swa_new, layer.kv)
        mask, pool, extra = m.window_mask, None, None
        last = cfg.last_kv_source
        if m.late_window_mask is not None and last is not None and i > last:
            mask = m.late_window_mask
        ratio = layer.weights.ratio
        if ratio:
            sm, source = m.streams[ratio], cfg.kv_source_of(i)
            if source == i:
                comp = layer.weights.compressor
                assert comp is not None
                self._compress(layer, comp, sm, self.pools.ring[i], self.pools.compressed[i])
            if cfg.is_sparse(ratio):
                slots, vis = self._select(layer, sm)
                extra = PoolRows(slots, vis.sum(-1))
            else:
                extra = sm.rows(self._qrow())
            pool = self.pools.compressed[source]
        return kernels.sparse_attention(
            layer.q,
            swa,
            m.window_slots,
            mask,
            layer.weights.sink,
            cfg.scale,
            pool,
            extra,
            window_scale=self.pools.scale_of(swa),
        )

    def _compress(self, layer, comp, sm: StreamMeta, ring, pool) -> None:
        rows = ops.compressor_rows(layer.x, comp, layer.positions).to(ring.dtype)  # (B, F)
        if ring.is_cuda and ring.dtype == torch.float32 and kernels.TRITON_AVAILABLE:
            self._compress_fused(layer, comp, sm, ring, pool, rows)  # pragma: no cover
            return
        carried = ring[sm.group_rows]  # (B, R, F), read before this step's store
        ring[sm.ring_new] = rows
        pad = torch.zeros_like(rows[0])
        pad[rows.shape[1] // 2 :] = float("-inf")
        src = sm.group_src[:, :, None]
        new = self._new_group_rows(rows, sm)
        group_rows = torch.where(src == 0, carried, torch.where(src == 1, new, pad))
        ent = compress_rows(
            self.cfg, group_rows, layer.weights.ratio, sm.group, comp.norm, self.cfg.rope_dim
        )
        self.pools.store(pool, sm.entry_slot, ent)

    def _compress_fused(  # pragma: no cover - needs a GPU
        self, layer, comp, sm: StreamMeta, ring, pool, rows: torch.Tensor
    ) -> None:
        """The Flash Compressor's decode path: one kernel gathers the group's ring rows, pools
        them and applies RMSNorm + RoPE. Storing the step's rows first cannot overwrite a row a
        group still needs (decode: ring_len > span; verify: see `graph_verify`)."""
        ring[sm.ring_new] = rows
        row_ids = torch.where(sm.group_src == 1, self._own_ring_rows(sm), sm.group_rows)
        ent = kernels.compress_gathered(
            ring, row_ids, layer.weights.ratio, self.cfg.is_overlap(layer.weights.ratio),
            pad=sm.group_src == 2, groups=sm.group, norm=comp.norm, rope_dim=self.cfg.rope_dim,
            theta=self.cfg.rope_theta, eps=self.cfg.norm_eps, out_dtype=self.pools.dtype,
        )  # fmt: skip
        self.pools.store(pool, sm.entry_slot, ent)

    def _select(self, layer: LayerInput, sm: StreamMeta):
        cfg, i = self.cfg, layer.index
        if not cfg.runs_indexer(i):
            return self.selection[cfg.index_source_of(i)]
        idx, source = layer.weights.indexer, cfg.kv_source_of(i)
        assert idx is not None
        if source == i:
            assert idx.compressor is not None
            self._compress(
                layer, idx.compressor, sm, self.pools.index_ring[i], self.pools.index_keys[i]
            )
        n = layer.x.shape[0]
        q = (layer.x @ idx.w_q).view(n, cfg.index_heads, cfg.index_dim)
        q = ops.rope(q, layer.positions, cfg.rope_dim, cfg.rope_theta)
        rows = sm.rows(self._qrow())
        keys = self.pools.index_keys[source]
        w = layer.x @ idx.w_weight
        logits = kernels.index_logits(q, w, keys, rows, key_scale=self.pools.scale_of(keys))
        k = min(cfg.index_topk, rows.num_rows)
        values, chosen = ops.topk_lowest_index(logits, k, lengths=rows.lengths)
        self.selection[i] = (rows.slots_of(chosen), torch.isfinite(values))
        return self.selection[i]

    # -- the layout of a step's rows: one per request here; `VerifyKeys` has T per request --

    def _qrow(self) -> torch.Tensor | None:
        """The batch row of each query row (None: one query per batch row)."""
        return None

    def _new_group_rows(self, rows: torch.Tensor, sm) -> torch.Tensor:
        """This step's compressor rows as the ``group_src == 1`` rows of each group."""
        return rows[:, None, :]

    def _own_ring_rows(self, sm) -> torch.Tensor:
        """Ring rows of the ``group_src == 1`` rows of each group (after this step's store)."""
        return sm.ring_new[:, None].expand_as(sm.group_rows)


def _with_late_mask(meta, pools: KVPools):
    """``meta`` (a decode or verify step's) with the window mask of the layers after the last KV
    source, when tail-only prefill left holes in their SWA; marks the step's own slots held."""
    valid = pools.late_swa_valid
    if valid is None:
        return meta
    valid.index_fill_(0, meta.swa_new, True)  # no host scalar: capturable
    return replace(meta, late_window_mask=meta.window_mask & valid[meta.window_slots])


class GraphDecoder:
    """Decode steps from raw batch state; on CUDA each (batch, context) bucket is captured once
    as a CUDA graph and replayed. On the CPU the same code runs eagerly (tested in CI)."""

    def __init__(
        self,
        weights: ModelWeights,
        pools: KVPools,
        cache: CacheConfig,
        max_batch: int,
        max_context: int,
        use_graphs: bool | None = None,
        min_context_bucket: int = 1024,
    ) -> None:
        self.weights, self.pools, self.cache = weights, pools, cache
        self.buffers = DecodeBuffers(cache, max_batch, max_context, weights.device)
        self.use_graphs = weights.device.type == "cuda" if use_graphs is None else use_graphs
        self.min_context_bucket = min_context_bucket
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @torch.no_grad()
    def _run(self, batch: int, context: int) -> torch.Tensor:
        meta = decode_metadata(self.cache, self.pools, self.buffers, context)
        meta = _with_late_mask(_slice_batch(meta, batch), self.pools)
        keys = GraphKeys(self.weights, self.pools, meta)
        return forward(self.weights, self.buffers.tokens[:batch], meta.positions, keys)

    def step(self, requests: list[Request], tokens: list[int]) -> torch.Tensor:
        """Logits ``(len(requests), V)`` of one decode step; the requests were just extended
        by ``tokens`` (one each)."""
        self.buffers.load(requests, tokens)
        longest = max(r.length for r in requests)
        context = context_bucket(longest, self.min_context_bucket, self.buffers.max_context)
        batch = min(power_bucket(len(requests), 1), self.buffers.max_batch)
        if not self.use_graphs:
            return self._run(batch, context)[: len(requests)]
        return self._replay(batch, context)[: len(requests)]

    # CUDA only (CI has no GPU): bench/gpu_equivalence.py checks graph decode against the
    # reference on the H200, bench/decode_context.py times it (docs/benchmarks.md).

    def _replay(self, batch: int, context: int) -> torch.Tensor:  # pragma: no cover
        key = (batch, context)
        if key not in self._graphs:
            self._graphs[key] = self._capture(batch, context)
        graph, out = self._graphs[key]
        graph.replay()
        return out

    def _capture(self, batch: int, context: int):  # pragma: no cover
        # Warm up on a side stream (allocator pools, lazy inits), then capture. Warm-up and
        # capture write only sentinel rows: padding rows are invalid. The live rows are
        # rewritten identically by the replay that follows.
        saved = [t.clone() for t in (self.buffers.valid,)]
        self.buffers.valid.zero_()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._run(batch, context)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._run(batch, context)
        self.buffers.valid.copy_(saved[0])
        return graph, out


def _slice_batch(meta: DecodeMeta, b: int) -> DecodeMeta:
    def cut(x):
        return x[:b] if isinstance(x, torch.Tensor) else x

    streams = {
        r: StreamMeta(*(cut(getattr(s, f)) for f in StreamMeta.__dataclass_fields__))
        for r, s in meta.streams.items()
    }
    return DecodeMeta(
        meta.positions[:b],
        meta.swa_new[:b],
        meta.window_slots[:b],
        meta.window_mask[:b],
        streams,
    )
