"""Paged forward: executes one `Allocation` of the cache on the `KVPools`.

All slot numbers come from the core (`Allocation`, `ReadPlan`); this module only turns them into
index tensors, in bulk with NumPy, once per step (shared by all layers), and runs each layer in
the order the core prescribes: write SWA, gather carried in-flight rows, store new ring rows,
compress completed groups into their slots, then read window and entries.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from adapters import kernels
from adapters.forward.selection import Selection, TopkStep, select_entries
from adapters.kernels import PoolRows
from adapters.memory.pools import KVPools
from adapters.model import ops
from adapters.model.candidates import Candidates
from adapters.model.engram import EngramStep
from adapters.model.model import LayerInput, compress_rows, forward, forward_tail_only
from adapters.model.model_config import ModelConfig
from adapters.model.weights import Compressor, ModelWeights
from shadowradix import Allocation, ReadPlan, StreamWrites

if TYPE_CHECKING:
    from adapters.memory.offload import C4Offload

I64 = np.int64

#: Compress prefill groups with the Flash Compressor on CUDA (fp32 in-flight rows); benchmarks
#: set it to False to time the PyTorch chain in the same process.
USE_PREFILL_KERNEL = kernels.TRITON_AVAILABLE


@dataclass(frozen=True)
class StreamStep:
    """Index tensors of one compressed stream for one step (shared by its layers)."""

    ratio: int
    ring_dst: torch.Tensor  # ring rows to store
    ring_src: torch.Tensor  # ... taken from these new tokens
    carry_rows: torch.Tensor  # (C,) ring rows gathered before the store
    entry_src: torch.Tensor  # (E, R) rows of each completed group in cat(new, carry, pad)
    entry_groups: torch.Tensor  # (E,)
    entry_slots: torch.Tensor  # (E,)
    entry_slots_np: np.ndarray  # the same on the host (HiSparse plans with it)
    read_slots: torch.Tensor  # (B, G) every complete entry of each request at its end
    visible_len: torch.Tensor  # (N,) entries complete at the token's position (a prefix)


@dataclass(frozen=True)
class PagedStep:
    tokens: torch.Tensor
    positions: torch.Tensor
    token_request: torch.Tensor  # (N,) index into the batch
    swa_slots: torch.Tensor  # (N,) where each new token's latent goes
    window_slots: torch.Tensor  # (N, W)
    window_mask: torch.Tensor  # (N, W)
    streams: dict[int, StreamStep]

    def restrict(self, rows: torch.Tensor) -> PagedStep:
        """The step's per-query tensors for the queries ``rows`` only (tail-only prefill). The
        write-side tensors of the streams stay: layers after the last KV source write none."""
        streams = {r: replace(s, visible_len=s.visible_len[rows]) for r, s in self.streams.items()}
        return PagedStep(
            tokens=self.tokens[rows],
            positions=self.positions[rows],
            token_request=self.token_request[rows],
            swa_slots=self.swa_slots[rows],
            window_slots=self.window_slots[rows],
            window_mask=self.window_mask[rows],
            streams=streams,
        )


def _window(
    plans: list[ReadPlan], req: np.ndarray, pos: np.ndarray, window: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of positions ``(t - W, t]`` for every token, from each request's read plan, as
    ``(N, W)`` device tensors (slots, mask). Only the plans' short slot lists cross to the
    device; the ``(N, W)`` grid is built there.

    Positions before 0, and before a replayed request's ``replay_start`` (the replay rebuilt
    the window from there: nothing earlier is live), are masked (their keys are gathered from
    the plan's first, live slot, never from a stale row); any other position the plan does not
    cover is a bug (`RuntimeError`), checked per request on the host."""
    sizes = np.array([len(p.swa_slots) for p in plans], dtype=I64)
    base = np.cumsum(sizes) - sizes
    first = np.array([p.swa_positions[0] if len(p.swa_positions) else 0 for p in plans], I64)
    live_from = np.array([p.replay_start or 0 for p in plans], dtype=I64)
    _check_window_covered(req, pos, window, first, live_from)
    flat = _device(np.concatenate([p.swa_slots for p in plans]), device)
    req_t = _device(req, device)
    want = _device(pos, device)[:, None] - (window - 1) + torch.arange(window, device=device)
    mask = want >= _device(live_from, device)[req_t][:, None]
    local = torch.where(mask, want - _device(first, device)[req_t][:, None], 0)
    return flat[_device(base, device)[req_t][:, None] + local], mask


def _check_window_covered(
    req: np.ndarray, pos: np.ndarray, window: int, first: np.ndarray, live_from: np.ndarray
) -> None:
    """The earliest live window position of each request (its first token's, positions
    ascend within a request) must be in its plan."""
    if not len(req):
        return
    starts = np.flatnonzero(np.r_[True, req[1:] != req[:-1]])
    r = req[starts]
    earliest = np.maximum(pos[starts] - (window - 1), live_from[r])
    if (earliest < first[r]).any():
        raise RuntimeError("read plan does not cover a query's window (pass start=)")


def _device(a: np.ndarray, device, dtype=torch.long) -> torch.Tensor:
    return torch.from_numpy(np.require(a, requirements=["C", "W"])).to(device=device, dtype=dtype)


def _stream_step(
    s: StreamWrites,
    model: ModelConfig,
    plans: list[ReadPlan],
    alloc: Allocation,
    req: np.ndarray,
    pos: np.ndarray,
) -> dict[str, np.ndarray]:
    r, offsets = s.ratio, alloc.token_offsets
    starts = np.asarray(alloc.starts, dtype=I64)
    n, c, b = len(pos), len(s.carry_rows), len(plans)
    # carried rows of request i are positions [carry_first[i], starts[i]) at carry_base[i]
    carry_base = np.zeros(b, I64)
    carry_first = np.zeros(b, I64)
    if c:
        uniq, first_idx = np.unique(s.carry_request, return_index=True)
        carry_base[uniq] = first_idx
        carry_first[uniq] = s.carry_positions[first_idx]
    overlap = model.is_overlap(r)
    width = 2 * r if overlap else r
    e_req = s.entry_request
    need = (s.entry_groups * r - (r if overlap else 0))[:, None] + np.arange(width, dtype=I64)
    sreq = starts[e_req][:, None]
    src = np.where(
        need >= sreq,
        offsets[e_req][:, None] + need - sreq,
        np.where(
            need >= 0, n + carry_base[e_req][:, None] + need - carry_first[e_req][:, None], n + c
        ),
    )
    entries = [p.stream(r).entry_slots for p in plans]
    g = max(1, max(len(e) for e in entries))
    read = np.zeros((b, g), I64)
    for i, e in enumerate(entries):
        read[i, : len(e)] = e
    return dict(
        ring_dst=s.ring_rows,
        ring_src=offsets[s.ring_request] + s.ring_positions - starts[s.ring_request],
        carry_rows=s.carry_rows,
        entry_src=src.reshape(len(e_req), width),
        entry_groups=s.entry_groups,
        entry_slots=s.entry_slots,
        read_slots=read,
        visible_len=(pos + 1) // r,
    )


def build_step(
    model: ModelConfig, alloc: Allocation, plans: list[ReadPlan], tokens: np.ndarray, device
) -> PagedStep:
    """Index tensors for executing ``alloc``; ``plans[i]`` is ``read_plan(request_i,
    start=alloc.starts[i])`` taken after the extend, ``tokens`` the new tokens in step order."""
    arrays = alloc.arrays
    pos = arrays.positions
    req = np.repeat(np.arange(len(plans), dtype=I64), np.diff(arrays.token_offsets))
    win, win_mask = _window(plans, req, pos, model.window, device)

    def t(a: np.ndarray, dtype=torch.long) -> torch.Tensor:
        return _device(a, device, dtype)

    streams = {}
    for s in arrays.streams:
        parts = _stream_step(s, model, plans, alloc, req, pos)
        streams[s.ratio] = StreamStep(
            s.ratio, **{k: t(v) for k, v in parts.items()}, entry_slots_np=parts["entry_slots"]
        )
    return PagedStep(
        tokens=t(tokens),
        positions=t(pos),
        token_request=t(req),
        swa_slots=t(arrays.swa_slots),
        window_slots=win,
        window_mask=win_mask,
        streams=streams,
    )


class PagedKeys:
    """`KeySource` over the pools for one `PagedStep`. With ``offload`` (HiSparse), the C4 KV
    of C4 KV-source layers lives in its host mirror / device buffer instead of
    ``pools.compressed``.

    V4.1 sharing: a KV-source layer compresses into its pools; a consumer layer reads its
    source's pools and compresses nothing. An index-source layer scores against its KV source's
    indexer keys and publishes its selection for the step; other C4 layers reuse it. With
    ``pools.late_swa_valid`` (tail-only), windows of the layers after the last KV source are
    masked to the SWA slots those layers hold. The candidate source publishes its candidate
    blocks, later indexer layers of its ratio select among them. ``topk``: `TopkStep`."""

    def __init__(
        self, model: ModelConfig, pools: KVPools, step: PagedStep,
        offload: C4Offload | None = None, topk: TopkStep | None = None,
    ) -> None:  # fmt: skip
        self.model, self.pools, self.step, self.offload = model, pools, step, offload
        self.topk = topk
        self.selection: dict[int, Selection] = {}
        self.candidates: Candidates | None = None
        self._late_mask: torch.Tensor | None = None

    def restrict(self, rows: torch.Tensor) -> PagedKeys:
        assert self.topk is None, "top-k capture / replay is not run tail-only"
        keys = PagedKeys(self.model, self.pools, self.step.restrict(rows), self.offload)
        keys.selection = {i: s.rows(rows) for i, s in self.selection.items()}
        keys.candidates = None if self.candidates is None else self.candidates.rows(rows)
        return keys

    def attend(self, layer: LayerInput) -> torch.Tensor:
        cfg, st, i = self.model, self.step, layer.index
        swa = self.pools.swa[i]
        self.pools.store(swa, st.swa_slots, layer.kv)
        extra_kv, extra = self._extra(layer) if layer.weights.ratio else (None, None)
        return kernels.sparse_attention(
            layer.q, swa, st.window_slots, self._window_mask(i), layer.weights.sink, cfg.scale,
            extra_kv, extra, window_scale=self.pools.scale_of(swa),
        )  # fmt: skip

    def _window_mask(self, layer: int) -> torch.Tensor:
        st, valid, last = self.step, self.pools.late_swa_valid, self.model.last_kv_source
        if valid is None or last is None or layer <= last:
            return st.window_mask
        if self._late_mask is None:
            self._late_mask = st.window_mask & valid[st.window_slots]
        return self._late_mask

    def _entry_rows(self, ss: StreamStep) -> PoolRows:
        """Every complete entry of each query's request, read through the request's slot row:
        the queries of one request share it, each up to its own causal length."""
        return PoolRows(ss.read_slots, ss.visible_len, self.step.token_request)

    def _extra(self, layer: LayerInput) -> tuple[torch.Tensor, PoolRows]:
        """The pool of compressed entries the layer's queries read, and which rows: every
        complete entry (dense ratios) or the top-k selection (C4), from the KV source's pool,
        which a source layer first extends with the step's completed groups."""
        cfg, i, ratio = self.model, layer.index, layer.weights.ratio
        ss, source = self.step.streams[ratio], cfg.kv_source_of(i)
        offloaded = self.offload is not None and source in self.offload.buffer
        new = None
        if source == i:
            comp = layer.weights.compressor
            assert comp is not None
            pool = None if offloaded else self.pools.compressed[i]
            new = self._compress(layer, comp, ss, self.pools.ring[i], pool)
        if not cfg.is_sparse(ratio):
            return self.pools.compressed[source], self._entry_rows(ss)
        slots, chosen_mask = self._select(layer, ss)
        selected = PoolRows(slots, chosen_mask.sum(-1))
        if self.offload is not None and offloaded:
            if new is None:  # a consumer: reads the source's buffer, writes nothing
                chosen = self.offload.read(source, slots, chosen_mask)
            else:
                chosen = self.offload.exchange(i, ss.entry_slots_np, new, slots, chosen_mask)
            return _as_pool(chosen, selected)
        return self.pools.compressed[source], selected

    def _compress(
        self,
        layer: LayerInput,
        comp: Compressor,
        ss: StreamStep,
        ring: torch.Tensor,
        pool: torch.Tensor | None,
    ) -> torch.Tensor:
        """Stores the step's in-flight rows and compresses the completed groups; returns the
        entries ``(E, dim)``, also stored at their slots of ``pool`` unless it is ``None``."""
        rows = ops.compressor_rows(layer.x, comp, layer.positions).to(ring.dtype)
        carried = ring[ss.carry_rows]  # before the store: carry and store may share rows
        ring[ss.ring_dst] = rows[ss.ring_src]
        if ss.entry_slots.numel() == 0:
            return rows.new_zeros((0, comp.norm.shape[0]))
        pad = torch.zeros_like(rows[:1])
        pad[:, rows.shape[1] // 2 :] = float("-inf")
        source = torch.cat((rows, carried, pad), dim=0)
        if source.is_cuda and source.dtype == torch.float32 and USE_PREFILL_KERNEL:
            ent = self._compress_fused(comp, ss, source)  # pragma: no cover - needs a GPU
        else:
            ent = compress_rows(
                self.model,
                source[ss.entry_src],
                ss.ratio,
                ss.entry_groups,
                comp.norm,
                self.model.rope_dim,
            )
        if pool is not None:
            self.pools.store(pool, ss.entry_slots, ent)
        return ent

    def _compress_fused(  # pragma: no cover - needs a GPU
        self, comp: Compressor, ss: StreamStep, source: torch.Tensor
    ) -> torch.Tensor:
        """The Flash Compressor over gathered rows: each completed group's rows (its own, the
        previous group's under the overlap, the padding row before group 0) are read from
        ``source`` by index, pooled, normed and roped in one kernel."""
        cfg = self.model
        return kernels.compress_gathered(
            source, ss.entry_src, ss.ratio, cfg.is_overlap(ss.ratio), groups=ss.entry_groups,
            norm=comp.norm, rope_dim=cfg.rope_dim, theta=cfg.rope_theta, eps=cfg.norm_eps,
        )  # fmt: skip

    def _select(self, layer: LayerInput, ss: StreamStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots of the top-k entries per token, and which of them are real: the layer's own
        indexer over its KV source's keys (a source first stores the step's keys), published
        for reuse; or the selection of its index source."""
        cfg, i = self.model, layer.index
        if not cfg.runs_indexer(i):
            chosen = self.selection[cfg.index_source_of(i)]
            return chosen.slots, chosen.valid
        idx, source = layer.weights.indexer, cfg.kv_source_of(i)
        assert idx is not None
        if source == i:
            assert idx.compressor is not None
            self._compress(
                layer, idx.compressor, ss, self.pools.index_ring[i], self.pools.index_keys[i]
            )
        n = layer.x.shape[0]
        q = (layer.x @ idx.w_q).view(n, cfg.index_heads, cfg.index_dim)
        q = ops.rope(q, layer.positions, cfg.rope_dim, cfg.rope_theta)
        rows = self._entry_rows(ss)
        keys = self.pools.index_keys[source]
        publish = (cfg.candidate_blocks, cfg.candidate_block)
        chosen = select_entries(
            q, layer.x @ idx.w_weight, keys, rows, cfg.index_topk,
            key_scale=self.pools.scale_of(keys),
            candidates=self.candidates if cfg.restricts_to_candidates(i) else None,
            publish=publish if i == cfg.candidate_source else None,
            forced=None if self.topk is None else self.topk.forced.get(i),
        )  # fmt: skip
        self.candidates = chosen.candidates or self.candidates
        if self.topk is not None:
            self.topk.selected[i] = chosen
        self.selection[i] = chosen
        return chosen.slots, chosen.valid


def _as_pool(chosen: torch.Tensor, selected: PoolRows) -> tuple[torch.Tensor, PoolRows]:
    """Gathered entries ``(N, k, d)`` (the HiSparse device buffer's) as a pool of ``N * k``
    rows that query ``n`` reads at rows ``[n * k, n * k + count)``."""
    n, k, d = chosen.shape
    table = torch.arange(n * k, device=chosen.device).view(n, k)
    return chosen.reshape(n * k, d), PoolRows(table, selected.lengths)


@torch.no_grad()
def run_step(
    weights: ModelWeights, pools: KVPools, step: PagedStep, logit_rows: torch.Tensor | None,
    offload: C4Offload | None = None, topk: TopkStep | None = None,
    engram: EngramStep | None = None,
) -> torch.Tensor:  # fmt: skip
    """Runs the layers over the step's new tokens; returns logits of ``logit_rows``.
    ``topk``: forced selections in, the step's selections out (`TopkStep`). ``engram``: the
    step's Engram memory (an Engram model's; `adapters.model.engram`)."""
    if pools.late_swa_valid is not None:  # every layer computes every token
        pools.late_swa_valid[step.swa_slots] = True
    keys = PagedKeys(weights.config, pools, step, offload, topk)
    return forward(weights, step.tokens, step.positions, keys, logit_rows, engram)


@torch.no_grad()
def run_tail_only_step(
    weights: ModelWeights, pools: KVPools, step: PagedStep, tail_rows: torch.Tensor,
    logit_rows: torch.Tensor | None, offload: C4Offload | None = None,
    engram: EngramStep | None = None,
) -> torch.Tensor:  # fmt: skip
    """Tail-only prefill (`model.forward_tail_only`): the layers after the last KV source run
    over ``tail_rows`` only; ``logit_rows`` index into ``tail_rows``. Marks in
    ``pools.late_swa_valid`` (required) which SWA slots those layers now hold: the tail's,
    not the other tokens' (whatever a reused slot held before is never read)."""
    valid = pools.late_swa_valid
    if valid is None:
        raise ValueError("tail-only steps need KVPools(track_late_swa=True)")
    valid[step.swa_slots] = False
    valid[step.swa_slots[tail_rows]] = True
    keys = PagedKeys(weights.config, pools, step, offload)
    return forward_tail_only(
        weights, step.tokens, step.positions, keys, tail_rows, logit_rows, engram
    )
