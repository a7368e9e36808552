"""Batched decode with per-step metadata computed on the device from raw batch state.

The only per-step inputs are raw state in fixed device buffers: each slot's new token, its
length, and two page tables (virtual pages, and SWA pages indexed by absolute page). Every slot
number the step needs (the new SWA slot, the window, ring rows, the carried rows of a completing
group, its compressed slot, every complete entry) is the core's slot arithmetic
(`shadowradix.slots`) over torch, in `graph_meta.step_metadata`: a decode step is the one-token
case of a verify step. So the whole step can be captured once in a CUDA graph and replayed.
Writes of padding slots and of groups that do not complete go to each pool's sentinel row.

The device tables follow the core's page-table deltas (`block_tables.DeviceTables`): a step
passes the deltas of its extend (and of every other call that changed its requests' tables
since the last step); a request new to its row is written whole, once.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import replace

import numpy as np
import torch

from adapters import kernels
from adapters.forward.buckets import context_bucket, power_bucket
from adapters.forward.cuda_graphs import CudaGraphs
from adapters.forward.graph_meta import StepMeta, StreamMeta, step_metadata
from adapters.forward.side_stream import Pending, SideStream
from adapters.kernels import PoolRows
from adapters.memory.block_tables import DeviceTables
from adapters.memory.device import upload
from adapters.memory.pools import KVPools
from adapters.memory.residency import GraphResidency
from adapters.model import ops
from adapters.model.candidates import Candidates, select_candidates
from adapters.model.engram import EngramRows, EngramStep, decode_ngrams, pad_token, step_of
from adapters.model.model import LayerInput, LayerPrep, compress_rows, forward
from adapters.model.weights import ModelWeights
from shadowradix import CacheConfig, PageTableDelta
from shadowradix.request import Request

#: a decode step's input tokens: on the host, or on the device (overlap scheduling)
Tokens = list[int] | torch.Tensor
#: a sparse layer's top-k: compressed slots ``(N, k)`` and which of them are valid
Selection = tuple[torch.Tensor, torch.Tensor]


class DecodeBuffers:
    """Fixed device buffers of raw batch state for ``max_batch`` slots (`graph_meta.StepState`
    with one token per request)."""

    num_tokens = 1

    def __init__(self, cache: CacheConfig, max_batch: int, max_context: int, device) -> None:
        pages = -(-max_context // cache.page_size) + 1
        self.tokens = torch.zeros(max_batch, device=device, dtype=torch.long)
        # length after the new token (position + 1)
        self.lengths = torch.ones(max_batch, device=device, dtype=torch.long)
        self.valid = torch.zeros(max_batch, device=device, dtype=torch.bool)
        self.tables = DeviceTables(max_batch, pages, device)
        self.vtable, self.stable = self.tables.vtable, self.tables.stable
        self.max_batch, self.max_context, self.page_size = max_batch, max_context, cache.page_size

    def load(
        self, requests: list[Request], tokens: Tokens, deltas: Iterable[PageTableDelta]
    ) -> None:
        """Copies the batch's raw state in: tokens, lengths, and the page tables updated by
        ``deltas`` (every delta of these requests since the last load, in order; see
        `DeviceTables`). Raises ValueError past the buffers, `TableSyncError` on a missed
        delta."""
        b = len(requests)
        if b > self.max_batch:
            raise ValueError(f"batch {b} exceeds the decode buffers ({self.max_batch})")
        for r in requests:
            if r.length > self.max_context:
                raise ValueError(f"request length {r.length} exceeds max_context")
        self.tables.apply(deltas)
        self.tables.place(requests)
        head = np.array(
            [
                (tokens if isinstance(tokens, list) else [0] * b) + [0] * (self.max_batch - b),
                [r.length for r in requests] + [1] * (self.max_batch - b),
                [1] * b + [0] * (self.max_batch - b),
            ],
            dtype=np.int64,
        )
        head_t = upload(head, self.tokens.device)
        self.tokens.copy_(head_t[0])
        if isinstance(tokens, torch.Tensor):  # overlap: the previous step's, on the device
            self.tokens[:b].copy_(tokens)
        self.lengths.copy_(head_t[1])
        self.valid.copy_(head_t[2].bool())


class GraphKeys:
    """`KeySource` of one decode step over `graph_meta.StepMeta`. V4.1 sharing as in `PagedKeys`:
    KV-source layers compress, consumers read their source's pools; index sources publish
    their selection, other C4 layers reuse it; the candidate source publishes its candidate
    blocks, later indexer layers of its ratio select among them (`adapters.model.candidates`,
    no host synchronisation). ``hisparse``: the C4 KV of its layers is HiSparse's (written
    through to the host mirror, read from the buffer or the mirror: `GraphResidency`)."""

    def __init__(
        self, weights: ModelWeights, pools: KVPools, meta: StepMeta,
        hisparse: GraphResidency | None = None, side: SideStream | None = None,
    ) -> None:  # fmt: skip
        self.cfg, self.pools, self.meta = weights.config, pools, meta
        self.hisparse, self.side = hisparse, side
        self._pending: dict[int, Pending[Selection | None]] = {}
        self.selection: dict[int, Selection] = {}
        self.candidates: Candidates | None = None

    def attend(self, layer: LayerInput) -> torch.Tensor:
        cfg, m, i = self.cfg, self.meta, layer.index
        swa = self.pools.swa[i]
        self.pools.store(swa, m.swa_new, layer.kv)
        mask, pool, extra = m.window_mask, None, None
        last = cfg.last_kv_source
        if m.late_window_mask is not None and last is not None and i > last:
            mask = m.late_window_mask
        if layer.weights.ratio:
            pool, extra = self._read(layer, self._selection(layer))
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

    def prepare(self, layer: LayerPrep) -> None:
        """Multi-stream (``side``): a compressed layer's compressor and indexer, started on the
        side stream before its q / kv projections; `attend` joins them. Else a no-op."""
        if self.side is not None and layer.weights.ratio:
            work = functools.partial(self._prepare_now, layer)
            self._pending[layer.index] = self.side.fork(work, layer)

    def _selection(self, layer: LayerInput) -> Selection | None:
        pending = self._pending.pop(layer.index, None)  # none: not prepared (e.g. TP's keys)
        return self._prepare_now(layer) if pending is None else pending.join()

    def _prepare_now(self, layer: LayerPrep | LayerInput) -> Selection | None:
        """What a compressed layer computes without its q / kv: its compressor's entries (KV
        source), and its top-k (sparse or HiSparse; None for a dense compressed layer)."""
        cfg, i, ratio = self.cfg, layer.index, layer.weights.ratio
        sm, source = self.meta.streams[ratio], cfg.kv_source_of(i)
        hs = self._hisparse_of(source)
        if source == i:
            comp = layer.weights.compressor
            assert comp is not None
            kv_pool = None if hs is not None else self.pools.compressed[i]
            self._compress(layer, comp, sm, self.pools.ring[i], kv_pool)
        return self._select(layer, sm) if hs is not None or cfg.is_sparse(ratio) else None

    def _read(self, layer: LayerInput, sel: Selection | None) -> tuple[torch.Tensor, PoolRows]:
        """The compressed pool and rows the layer's queries read (``sel``: its top-k)."""
        source = self.cfg.kv_source_of(layer.index)
        hs = self._hisparse_of(source)
        if hs is not None:  # HiSparse C4: sparse, read from its buffer or host mirror
            assert sel is not None
            return hs.gather(source, *sel)
        if sel is not None:
            return self.pools.compressed[source], PoolRows(sel[0], sel[1].sum(-1))
        sm = self.meta.streams[layer.weights.ratio]
        return self.pools.compressed[source], sm.rows(self._qrow())

    def _hisparse_of(self, source: int) -> GraphResidency | None:
        hs = self.hisparse
        return hs if hs is not None and hs.holds(source) else None

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
        self._store(layer.index, pool, sm.entry_slot, ent)

    def _store(self, layer: int, pool, slots: torch.Tensor, entries: torch.Tensor) -> None:
        """The step's completed entries into ``pool`` (None: HiSparse's C4 KV of ``layer``)."""
        if pool is None:
            assert self.hisparse is not None
            self.hisparse.store(layer, slots, entries)
        else:
            self.pools.store(pool, slots, entries)

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
        self._store(layer.index, pool, sm.entry_slot, ent)

    def _select(self, layer: LayerPrep | LayerInput, sm: StreamMeta) -> Selection:
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
        if i == cfg.candidate_source:
            self.candidates = select_candidates(
                logits, rows.lengths, cfg.candidate_blocks, cfg.candidate_block
            )
        if cfg.restricts_to_candidates(i):
            assert self.candidates is not None
            logits = self.candidates.restrict(logits)
        k = min(cfg.index_topk, rows.num_rows)
        values, chosen = ops.topk_lowest_index(logits, k, lengths=rows.lengths)
        self.selection[i] = (rows.slots_of(chosen), torch.isfinite(values))
        return self.selection[i]

    # -- the layout of a step's rows: one per request (decode) or T per request (verify) --

    def _qrow(self) -> torch.Tensor | None:
        """The batch row of each query row (None: one query per batch row)."""
        return self.meta.row_batch

    def _new_group_rows(self, rows: torch.Tensor, sm: StreamMeta) -> torch.Tensor:
        """This step's compressor rows as the ``group_src == 1`` rows of each group (decode:
        the row's own, broadcast; verify: gathered from the step's rows)."""
        return rows[:, None, :] if sm.group_new is None else rows[sm.group_new]

    def _own_ring_rows(self, sm: StreamMeta) -> torch.Tensor:
        """Ring rows of the ``group_src == 1`` rows of each group (after this step's store)."""
        if sm.group_new is None:
            return sm.ring_new[:, None].expand_as(sm.group_rows)
        return sm.ring_new[sm.group_new]


def _with_late_mask(meta: StepMeta, pools: KVPools) -> StepMeta:
    """``meta`` (a decode or verify step's) with the window mask of the layers after the last KV
    source, when tail-only prefill left holes in their SWA; marks the step's own slots held."""
    valid = pools.late_swa_valid
    if valid is None:
        return meta
    valid.index_fill_(0, meta.swa_new, True)  # no host scalar: capturable
    return replace(meta, late_window_mask=meta.window_mask & valid[meta.window_slots])


class GraphDecoder:
    """Decode steps from raw batch state; on CUDA each (batch, context) bucket is captured once
    as a CUDA graph (`CudaGraphs`, held) and replayed. On the CPU the same code runs eagerly
    (tested in CI). ``multi_stream``: compressed layers' compressor and indexer on a side
    stream, concurrent with the q / kv projections (`GraphKeys.prepare`; inline on the CPU)."""

    def __init__(
        self,
        weights: ModelWeights,
        pools: KVPools,
        cache: CacheConfig,
        max_batch: int,
        max_context: int,
        use_graphs: bool | None = None,
        min_context_bucket: int = 1024,
        engram: EngramRows | None = None,
        hisparse: GraphResidency | None = None,
        multi_stream: bool = False,
    ) -> None:
        self.weights, self.pools, self.cache = weights, pools, cache
        #: HiSparse: the C4 KV in its host mirror and device buffer (`GraphResidency`)
        self.hisparse, self.side = hisparse, SideStream(weights.device) if multi_stream else None
        self.buffers = DecodeBuffers(cache, max_batch, max_context, weights.device)
        self.use_graphs = weights.device.type == "cuda" if use_graphs is None else use_graphs
        self.min_context_bucket = min_context_bucket
        self.graphs = CudaGraphs(self._run, pools)  # a subclass's `_run` (bound: resolved now)
        #: Engram: the tables, and a fixed buffer of the step's rows (looked up before the
        #: graph runs, in any placement; the graph reads the buffer)
        self.engram, self.engram_memory = engram, _engram_buffer(weights, max_batch, engram)

    @torch.no_grad()
    def _run(self, batch: int, context: int) -> torch.Tensor:
        meta = step_metadata(self.cache, self.pools, self.buffers, batch, context)
        meta = _with_late_mask(meta, self.pools)
        keys = GraphKeys(self.weights, self.pools, meta, self.hisparse, self.side)
        cfg, mem = self.weights.config, self.engram_memory
        engram = None if mem is None else EngramStep(cfg.engram_layers, mem[:, :batch])
        tokens = self.buffers.tokens[:batch]
        return forward(self.weights, tokens, meta.positions, keys, None, engram)

    def step(
        self, requests: list[Request], tokens: Tokens, deltas: Iterable[PageTableDelta]
    ) -> torch.Tensor:
        """Logits ``(len(requests), V)`` of one decode step; the requests were just extended
        by ``tokens`` (one each). ``deltas``: the step plan's, after any other table changes
        of these requests since the last step (`DecodeBuffers.load`). With HiSparse the last
        ended window is planned after this step's launch (`GraphResidency`) and this step's
        reads and writes join the open window."""
        if self.hisparse is not None:
            self.hisparse.before_step()
        self.buffers.load(requests, tokens, deltas)
        self._load_engram(requests, tokens)
        longest = max(r.length for r in requests)
        context = context_bucket(longest, self.min_context_bucket, self.buffers.max_context)
        batch = min(power_bucket(len(requests), 1), self.buffers.max_batch)
        if not self.use_graphs:
            out = self._run(batch, context)[: len(requests)]
        else:
            out = self._replay(batch, context)[: len(requests)]
        if self.hisparse is not None:  # the last step planned while this one runs
            self.hisparse.after_launch(batch * self.buffers.num_tokens)
            self.hisparse.after_step()
        return out

    def _replay(self, batch: int, context: int) -> torch.Tensor:  # pragma: no cover
        return self.graphs.replay(batch, context, self.buffers.valid)

    def _load_engram(self, requests: list[Request], tokens: Tokens) -> None:
        """The step's Engram rows into their buffer: each request's n-gram is its ``n - 1``
        tokens before the new one (host) and the new one (host, or on the device)."""
        if self.engram_memory is None:
            return
        cfg = self.weights.config
        n = cfg.engram_ngram
        lo = [max(0, r.length - n) for r in requests]
        hist = [r.tokens_from(a)[: r.length - 1 - a] for r, a in zip(requests, lo)]
        ngrams = decode_ngrams(hist, tokens, n, pad_token(cfg.vocab_size))
        step = step_of(cfg, ngrams, self.engram)
        assert step is not None
        self.engram_memory[:, : len(requests)].copy_(step.memory)


def _engram_buffer(weights: ModelWeights, max_batch: int, engram: EngramRows | None):
    cfg = weights.config
    if engram is None or not cfg.engram_layers:
        return None
    width = cfg.engram_lookups * cfg.engram_dim
    shape = (len(cfg.engram_layers), max_batch, width)
    return torch.zeros(shape, device=weights.device, dtype=weights.dtype)
