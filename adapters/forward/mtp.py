"""The MTP layer over the pools: its state in `KVPools`, the paged step that keeps it, and the
drafter that chains the MTP block k times from raw batch state. The layer's maths and its dense
reference are `adapters.model.mtp` (re-exported here).

Its state lives in `KVPools` built with ``mtp=True``: the MTP layer's SWA KV is one more SWA
layer at the same SWA slots as the main layers, and ``page_hidden`` keeps, per SWA page, the
main hidden state of the page's last position (what a request resuming at that page boundary
feeds to its first MTP row). Every forward of a speculative runner writes both (`write_state`);
`MTPDrafter` reads the committed window from the pool and keeps the drafted rows' keys in
temporary tensors, never in the pools.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from adapters.forward.cuda_graphs import CudaGraphs
from adapters.forward.graph_decode import DecodeBuffers
from adapters.forward.graph_meta import page_lookup
from adapters.forward.paged import PagedKeys, PagedStep
from adapters.memory.pools import KVPools
from adapters.model import ops
from adapters.model.model import LayerInput, final_hidden, head_logits
from adapters.model.mtp import (
    mtp_hidden,
    mtp_kv,
    mtp_logits,
    mtp_streams,
    mtp_weights,
    reference_mtp_draft,
    reference_mtp_logits,
)
from adapters.model.tempered import sample_tempered
from adapters.model.weights import ModelWeights
from shadowradix import CacheConfig, PageTableDelta, slots
from shadowradix.request import Request

if TYPE_CHECKING:
    from adapters.memory.offload import C4Offload

__all__ = [
    "MTPDrafter",
    "mtp_hidden",
    "mtp_kv",
    "mtp_logits",
    "mtp_streams",
    "mtp_weights",
    "page_end_rows",
    "reference_mtp_draft",
    "reference_mtp_logits",
    "resume_hidden",
    "run_step_mtp",
    "shift_hidden",
    "write_state",
]


def shift_hidden(hidden: torch.Tensor, first_rows: torch.Tensor, prev: torch.Tensor):
    """Each row's previous-position hidden state: row ``i - 1`` of ``hidden``, except at each
    request's first row (``first_rows``), which takes that request's row of ``prev``."""
    shifted = torch.cat((hidden.new_zeros(1, hidden.shape[1]), hidden[:-1]), dim=0)
    shifted[first_rows] = prev.to(hidden.dtype)
    return shifted


def write_state(
    weights: ModelWeights,
    pools: KVPools,
    hidden: torch.Tensor,
    prev_hidden: torch.Tensor,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    swa_slots: torch.Tensor,
    page_rows: torch.Tensor,
) -> None:
    """Stores the MTP state of a forward's rows: the MTP layer's SWA latent at each row's SWA
    slot, and the main hidden state of every row that ends a page at ``page_rows`` (the row's
    SWA page, or the sentinel row). Tensor ops only (CUDA-graph capturable)."""
    assert pools.page_hidden is not None, "pools built without mtp=True"
    kv = mtp_kv(weights, prev_hidden, tokens, positions)
    pool = pools.swa[weights.config.num_layers]
    pool[swa_slots] = kv.to(pool.dtype)
    pools.page_hidden[page_rows] = hidden.to(pools.page_hidden.dtype)


def page_end_rows(
    pools: KVPools, positions: torch.Tensor, swa_slots: torch.Tensor, page_size: int
) -> torch.Tensor:
    """``page_hidden`` row per forward row: its SWA page where the row ends a page, else the
    sentinel."""
    assert pools.page_hidden is not None
    ends = slots.ends_page(positions, page_size)
    return torch.where(
        ends, slots.page_of(swa_slots, page_size), KVPools.sentinel(pools.page_hidden)
    )


def resume_hidden(pools: KVPools, request: Request, start: int, page_size: int) -> torch.Tensor:
    """The main hidden state at ``start - 1`` for a request whose first computed position is
    ``start`` (zeros at 0). A request resumes only at a page boundary (a prefix hit), whose
    page the window still holds: its ``page_hidden`` row."""
    assert pools.page_hidden is not None
    if start == 0:
        return pools.page_hidden.new_zeros(pools.page_hidden.shape[1])
    if start % page_size:
        raise RuntimeError(f"no hidden state kept for position {start - 1} (mid-page resume)")
    page = request.swa_pages[(start - 1) // page_size - request.swa_base]
    return pools.page_hidden[page]


@torch.no_grad()
def run_step_mtp(
    weights: ModelWeights,
    pools: KVPools,
    step: PagedStep,
    logit_rows: torch.Tensor | None,
    prev_hidden: torch.Tensor,
    first_rows: torch.Tensor,
    page_size: int,
    offload: C4Offload | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`paged.run_step` that also keeps the MTP state of the step's tokens. ``prev_hidden``
    ``(B, D)``: each request's main hidden state before its first new token, ``first_rows``
    ``(B,)``: that token's row. Returns the logits of ``logit_rows`` and every row's hidden.
    ``offload``: the HiSparse executor (its C4 KV), as in `paged.run_step`."""
    keys = PagedKeys(weights.config, pools, step, offload)
    hidden = final_hidden(weights, step.tokens, step.positions, keys)
    prev = shift_hidden(hidden, first_rows, prev_hidden)
    rows = page_end_rows(pools, step.positions, step.swa_slots, page_size)
    write_state(weights, pools, hidden, prev, step.tokens, step.positions, step.swa_slots, rows)
    return head_logits(weights, hidden if logit_rows is None else hidden[logit_rows]), hidden


# -- drafting over the pools ----------------------------------------------------------------------


class _DraftKeys:
    """`KeySource` of draft step ``j``: the committed window ``(B, W-1)`` from the pool, then
    the draft rows' keys kept in ``temp`` (this step's written first); the last W of those."""

    def __init__(self, weights: ModelWeights, committed, mask, temp, valid, j: int) -> None:
        self.cfg, self.committed, self.mask = weights.config, committed, mask
        self.temp, self.valid, self.j = temp, valid, j

    def attend(self, layer: LayerInput) -> torch.Tensor:
        j = self.j
        self.temp[:, j] = layer.kv.to(self.temp.dtype)
        keys = torch.cat((self.committed, self.temp[:, : j + 1]), dim=1)[:, j:]
        own = self.valid[:, None].expand(-1, j + 1)
        mask = torch.cat((self.mask, own), dim=1)[:, j:]
        return ops.sink_attention(layer.q, keys, mask, layer.weights.sink, self.cfg.scale)


class MTPDrafter:
    """k chained MTP steps for a batch, from raw batch state in fixed device buffers (the page
    tables and lengths of `DecodeBuffers`, the pending tokens, the previous hidden states): the
    whole draft is tensor ops, so on CUDA each batch bucket is captured once as a CUDA graph
    (`CudaGraphs`, held); on the CPU it runs eagerly. It writes nothing to the pools."""

    def __init__(
        self,
        weights: ModelWeights,
        pools: KVPools,
        cache: CacheConfig,
        max_batch: int,
        max_context: int,
        num_tokens: int,
        use_graphs: bool | None = None,
    ) -> None:
        mtp_weights(weights)
        if len(pools.swa) <= weights.config.num_layers:
            raise ValueError("MTP drafts need KVPools(..., mtp=True)")
        self.weights, self.pools, self.cache = weights, pools, cache
        self.buffers = DecodeBuffers(cache, max_batch, max_context, weights.device)
        self.use_graphs = weights.device.type == "cuda" if use_graphs is None else use_graphs
        self.graphs = CudaGraphs(self._run, pools)
        self.num_tokens = num_tokens
        cfg = weights.config
        self.hidden = torch.zeros(max_batch, cfg.hidden, device=weights.device, dtype=weights.dtype)
        #: ``(batch bucket, k, V)`` logits of the last draft (a graph's output buffer on CUDA)
        self.last_logits: torch.Tensor | None = None
        #: while `draft_sampled` runs: (temperatures ``(bucket,)``, uniforms ``(bucket, k)``),
        #: and the distributions its tokens were drawn from
        self._sampling: tuple[torch.Tensor, torch.Tensor] | None = None
        self._probs: list[torch.Tensor] = []

    @torch.no_grad()
    def _run(self, batch: int, context: int) -> torch.Tensor:
        cfg, buf, p, w = self.weights.config, self.buffers, self.cache.page_size, self.cache.window
        length, valid = buf.lengths[:batch], buf.valid[:batch]  # length: the pending position
        dev = length.device
        # the pending token's window, itself excluded: [window_first(length + 1), length)
        first = slots.window_first(length + 1, w)
        cpos = first[:, None] + torch.arange(w - 1, device=dev)[None, :]
        cmask = (cpos >= 0) & valid[:, None]
        cpos = cpos.clamp(min=0)
        pool = self.pools.swa[cfg.num_layers]
        committed = pool[slots.page_slot(page_lookup(buf.stable[:batch], cpos, p), cpos, p)]
        temp = committed.new_zeros(batch, self.num_tokens, cfg.head_dim)
        tokens, hidden, out, logits = buf.tokens[:batch], self.hidden[:batch], [], []
        for j in range(self.num_tokens):
            keys = _DraftKeys(self.weights, committed, cmask, temp, valid, j)
            hidden = mtp_hidden(self.weights, hidden, tokens, length + j, keys)
            logits.append(mtp_logits(self.weights, hidden))
            tokens = self._next_tokens(logits[-1], j)
            out.append(tokens)
        self.last_logits = torch.stack(logits, dim=1)
        return torch.stack(out, dim=1)

    def _next_tokens(self, logits: torch.Tensor, j: int) -> torch.Tensor:
        if self._sampling is None:
            return logits.argmax(dim=-1)
        temperatures, uniforms = self._sampling
        tokens, probs = sample_tempered(logits, temperatures, uniforms[:, j])
        self._probs.append(probs)
        return tokens

    def draft_sampled(
        self,
        requests: list[Request],
        pending: list[int],
        hidden: torch.Tensor,
        deltas: Iterable[PageTableDelta],
        temperatures: torch.Tensor,
        uniforms: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`draft` where request ``i`` with ``temperatures[i] > 0`` draws draft ``j`` from
        softmax(MTP logits / T) by inverse CDF at ``uniforms[i, j]`` (greedy where T = 0).
        Returns the tokens and their distributions ``(len(requests), k, V)`` float64 on the
        CPU. Runs eagerly, also on CUDA (no graph for the sampled path)."""
        b = len(requests)
        self.buffers.load(requests, pending, deltas)
        self.hidden[:b] = hidden.to(self.hidden.dtype)
        batch = min(max(1, 1 << (b - 1).bit_length()), self.buffers.max_batch)
        dev = self.hidden.device
        temps = torch.zeros(batch, dtype=torch.float64, device=dev)
        temps[:b] = temperatures.to(dev)
        u = torch.zeros(batch, self.num_tokens, dtype=torch.float64, device=dev)
        u[:b] = uniforms.to(dev)
        self._sampling, self._probs = (temps, u), []
        try:
            tokens = self._run(batch, 0)[:b]
        finally:
            self._sampling = None
        return tokens, torch.stack(self._probs, dim=1)[:b].cpu()

    def draft(
        self,
        requests: list[Request],
        pending: list[int],
        hidden: torch.Tensor,
        deltas: Iterable[PageTableDelta],
    ) -> torch.Tensor:
        """Draft tokens ``(len(requests), num_tokens)``: each request has committed
        ``request.length`` tokens, ``pending[i]`` is its next token (at position ``length``) and
        ``hidden[i]`` the main hidden state at ``length - 1``. ``deltas``: every page-table
        delta of these requests since the last draft (`DecodeBuffers.load`)."""
        b = len(requests)
        self.buffers.load(requests, pending, deltas)
        self.hidden[:b] = hidden.to(self.hidden.dtype)
        batch = min(max(1, 1 << (b - 1).bit_length()), self.buffers.max_batch)
        if not self.use_graphs:
            return self._run(batch, 0)[:b]
        valid = self.buffers.valid
        return self.graphs.replay(batch, 0, valid)[:b]  # pragma: no cover - needs a GPU
