"""Speculative verify steps with metadata computed on the device: `GraphDecoder` for T tokens.

A verify step runs ``T = k + 1`` tokens per request (the pending token and k drafts, extended
with ``extend_draft_batch``) at positions ``[length - T, length)``. Every slot comes from
`graph_meta.step_metadata` on the raw batch state of `DecodeBuffers`, the same builder as a
decode step's (which is its ``T = 1`` case), now per row ``(b, j)``.

Carried rows are gathered before the step stores its rows. A request's T positions never share
a ring row (``T <= max_draft_len``), and no stored row overwrites a carried one: a new position
``p`` and a carried ``q`` of the same page are less than ``T + span <= ring_len`` apart. The
indexer scores each request's entries once for its T queries. With the MTP layer, the step also
stores the MTP state of its rows (`mtp.write_state`). On CUDA each (batch, context) bucket is
captured once as a CUDA graph; on the CPU the same code runs eagerly.

Rejected drafts leave page ids beyond a request's committed pages that went back to the
allocator: the `rollback` deltas cut the rows' extents and the next extend's deltas write the
pages it allocates there (`block_tables.DeviceTables`); nothing is re-uploaded.

With HiSparse (``hisparse``: a `GraphResidency` sized for ``max_batch * T`` query rows) the C4
KV is read and written through the residency table exactly as in a decode step, T rows per
request: entries of rejected drafts were written through to the mirror (and a resident
buffer page) like any other; no later step reads them before the accepted tokens rewrite
their slots, and a page the rollback freed ends its life by the cache's FREED event
(`GraphResidency.before_step`), as a finished request's does.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from adapters.forward.buckets import context_bucket, power_bucket
from adapters.forward.graph_decode import DecodeBuffers, GraphDecoder, GraphKeys, _with_late_mask
from adapters.forward.graph_meta import StepMeta, step_metadata
from adapters.forward.mtp import write_state
from adapters.memory.device import upload
from adapters.memory.pools import KVPools
from adapters.memory.residency import GraphResidency
from adapters.model import ops
from adapters.model.model import final_hidden, head_logits
from adapters.model.weights import ModelWeights
from shadowradix import CacheConfig, PageTableDelta
from shadowradix.request import Request


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
        self,
        requests: list[Request],
        chunks: list[list[int]],
        prev_hidden: torch.Tensor | None,
        deltas: Iterable[PageTableDelta],
        drafts: torch.Tensor | None = None,
    ) -> None:
        """Raw state of a verify step: ``requests`` were just extended by ``chunks`` (T tokens
        each); ``deltas`` as in `DecodeBuffers.load` (the last step's rollbacks, then this
        step's extend). ``drafts`` ``(B, T - 1)`` on the device: tokens ``1..T-1`` of every
        chunk, copied on the device over the chunks' (placeholder) values, so the host never
        reads them. Nothing here waits for the device (non-blocking uploads)."""
        super().load(requests, [c[0] for c in chunks], deltas)
        b = len(requests)
        self.block[:b].copy_(upload(np.asarray(chunks, dtype=np.int64), self.block.device))
        if drafts is not None:
            self.block[:b, 1:].copy_(drafts)
        if prev_hidden is not None:
            self.prev_hidden[:b] = prev_hidden.to(self.prev_hidden.dtype)


class VerifyKeys(GraphKeys):
    """`KeySource` of one verify step over `StepMeta`: `GraphKeys` (V4.1 sharing and the
    tail-only mask included) with ``T`` query rows per request."""

    def __init__(
        self, weights: ModelWeights, pools: KVPools, meta: StepMeta, t_len: int,
        hisparse: GraphResidency | None = None,
    ) -> None:  # fmt: skip
        super().__init__(weights, pools, meta, hisparse)
        self.t_len = t_len

    def _compress_fused_on_cpu(self, layer, comp, sm, ring, pool) -> None:
        """The CUDA path's layout on any device (tests): `kernels.compress_gathered` falls
        back to its torch reference off the GPU."""
        rows = ops.compressor_rows(layer.x, comp, layer.positions).to(ring.dtype)
        self._compress_fused(layer, comp, sm, ring, pool, rows)


class GraphVerifier(GraphDecoder):
    """Verify steps of ``num_tokens`` tokens per request from raw batch state; with ``mtp``
    also the MTP layer's state of every row; with ``hisparse`` the C4 KV through its residency
    table (module docstring). CUDA graphs per (batch, context) bucket on GPU, eager on the CPU
    (tested in CI against the paged path and the reference)."""

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
        hisparse: GraphResidency | None = None,
    ) -> None:
        if mtp and pools.page_hidden is None:
            raise ValueError("MTP state needs KVPools(..., mtp=True)")
        if hisparse is not None and hisparse.max_rows < max_batch * num_tokens:
            raise ValueError(
                f"the residency holds {hisparse.max_rows} query rows a step, verify steps have "
                f"up to {max_batch} x {num_tokens}"
            )
        super().__init__(
            weights, pools, cache, max_batch, max_context, use_graphs, min_context_bucket,
            hisparse=hisparse,
        )  # fmt: skip
        self.buffers: VerifyBuffers = VerifyBuffers(  # type: ignore[assignment]
            cache, max_batch, max_context, num_tokens, weights
        )
        self.num_tokens, self.mtp = num_tokens, mtp

    @torch.no_grad()
    def _run(self, batch: int, context: int) -> torch.Tensor:
        """Logits and hidden states of every row, packed into one tensor (one graph output):
        ``(B*T, V + D)`` in fp32, or fp64 for an fp64 model (both halves exact)."""
        buf, w = self.buffers, self.weights
        meta = step_metadata(self.cache, self.pools, buf, batch, context)
        meta = _with_late_mask(meta, self.pools)
        keys = VerifyKeys(w, self.pools, meta, self.num_tokens, self.hisparse)
        tokens = buf.block[:batch].reshape(-1)
        hidden = final_hidden(w, tokens, meta.positions, keys)
        if self.mtp:
            d = hidden.shape[1]
            rows = hidden.view(batch, self.num_tokens, d)
            prev = torch.cat((buf.prev_hidden[:batch, None], rows[:, :-1]), dim=1).view(-1, d)
            assert meta.page_rows is not None  # mtp: the pools keep page_hidden
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
        *,
        deltas: Iterable[PageTableDelta],
        drafts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``(B*T, V)`` (fp32) and hidden states ``(B*T, D)`` of a verify step; the
        requests were just extended by ``chunks`` (``num_tokens`` each). ``prev_hidden``
        ``(B, D)``: the main hidden state before each chunk (needed with ``mtp``).
        ``deltas``: the page-table deltas of these requests since the last step, this step's
        extend last (`VerifyBuffers.load_block`). ``drafts``: the chunks' drafts on the device
        (their values in ``chunks`` are then placeholders). The step is queued, not waited
        for."""
        if any(len(c) != self.num_tokens for c in chunks):
            raise ValueError(f"a verify step takes exactly {self.num_tokens} tokens per request")
        if drafts is not None and tuple(drafts.shape) != (len(chunks), self.num_tokens - 1):
            raise ValueError(f"device drafts must be ({len(chunks)}, {self.num_tokens - 1})")
        if self.hisparse is not None:
            self.hisparse.before_step()
        self.buffers.load_block(requests, chunks, prev_hidden, deltas, drafts)
        longest = max(r.length for r in requests)
        context = context_bucket(longest, self.min_context_bucket, self.buffers.max_context)
        batch = min(power_bucket(len(requests), 1), self.buffers.max_batch)
        if not self.use_graphs:
            packed = self._run(batch, context)
        else:  # pragma: no cover - needs a GPU
            packed = self._replay(batch, context)
        if self.hisparse is not None:  # the last window planned while this step runs
            self.hisparse.after_launch(batch * self.num_tokens)
            self.hisparse.after_step()
        n, v = len(requests) * self.num_tokens, self.weights.config.vocab_size
        return packed[:n, :v].float(), packed[:n, v:].to(self.weights.dtype)
