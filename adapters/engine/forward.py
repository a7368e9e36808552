"""The paged forward over the pools, held by the model runner: the step built from the core's
plans and executed (paged, tail-only or with the MTP layer's state), timed into the runner's
stats. It keeps each request's main hidden state at its last computed row for MTP drafts
(`_Seq.hidden`, `step_hidden`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from adapters.distributed.engram_shard import place_engram
from adapters.engine.runner_stats import RunnerStats
from adapters.engine.sequence import _Seq
from adapters.forward.mtp import resume_hidden, run_step_mtp
from adapters.forward.paged import build_step, run_step, run_tail_only_step
from adapters.forward.selection import TopkStep
from adapters.memory.pools import KVPools
from adapters.model.engram import EngramStep, chunk_ngrams, pad_token, step_of
from adapters.model.weights import ModelWeights
from shadowradix import ReadPlan, ShadowRadixCache

if TYPE_CHECKING:
    from adapters.memory.offload import C4Offload


class Forward:
    """One paged forward over ``pools`` (``offload``: the HiSparse executor, or None);
    ``tail_only`` runs chunks longer than the window tail-only, ``mtp`` keeps the MTP layer's
    state. Reads the cache's plans, never changes the cache."""

    def __init__(
        self,
        cache: ShadowRadixCache,
        weights: ModelWeights,
        pools: KVPools,
        offload: C4Offload | None,
        stats: RunnerStats,
        *,
        device: torch.device,
        tail_only: bool,
        mtp: bool,
    ) -> None:
        self.cache, self.weights, self.pools, self.offload = cache, weights, pools, offload
        self.model, self.device, self.stats = weights.config, device, stats
        self.tail_only, self.mtp = tail_only, mtp
        #: the Engram tables where the model's ``engram_placement`` says (None without)
        self.engram = place_engram(self.model, device, weights.dtype)
        #: every row's main hidden state of the last forward (MTP drafts only)
        self.step_hidden: torch.Tensor | None = None

    def _forward(
        self,
        seqs: list[_Seq],
        chunks: list[list[int]],
        alloc,
        rows: list[int],
        plans: list[ReadPlan] | None = None,
        topk: TopkStep | None = None,
    ):
        """Logits of the flat token ``rows`` of one forward over ``chunks`` (``alloc``: their
        step plan; ``plans``: the windows they read, default each request's from its chunk's
        start). A tail-only runner runs chunks longer than the window tail-only (``rows`` are
        then chunk ends). With the MTP layer kept, also its state, and each request's hidden
        state at its chunk's end (every row's in ``step_hidden``). The name is the seam tests
        wrap (`Runner._forward`). ``topk``: forced selections in, the step's out (`TopkStep`;
        a paged, non-tail-only forward)."""
        t0 = time.perf_counter()
        if plans is None:
            plans = [self.cache.read_plan(s.req, start=st) for s, st in zip(seqs, alloc.starts)]
        flat = np.fromiter((t for c in chunks for t in c), np.int64)
        step = build_step(self.model, alloc, plans, flat, self.device)
        if self.offload is not None:
            self.offload.drain()  # every page the forward plans for is unpinned
            self.offload.begin_step()  # releases the pages the cache freed (its events)
        tail_rows = self._tail_rows(chunks) if self.tail_only else None
        if tail_rows is not None:
            rows = np.searchsorted(tail_rows, rows).tolist()  # chunk ends are tail rows
        logit_rows = torch.tensor(rows, device=self.device, dtype=torch.long)
        t1 = time.perf_counter()
        engram = self._engram_step(seqs, chunks, alloc.starts)  # the lookup: forward time
        if self.mtp:  # never tail-only (refused at construction)
            logits = self._forward_mtp(seqs, chunks, alloc, step, logit_rows)
        elif tail_rows is None:
            logits = run_step(
                self.weights, self.pools, step, logit_rows, self.offload, topk, engram=engram
            )
        else:
            tail_t = torch.from_numpy(tail_rows).to(self.device)
            logits = run_tail_only_step(
                self.weights, self.pools, step, tail_t, logit_rows, self.offload, engram=engram
            )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t2 = time.perf_counter()
        self.stats.schedule_s += t1 - t0
        self.stats.forward_s += t2 - t1
        return logits

    def _engram_step(self, seqs: list[_Seq], chunks: list[list[int]], starts) -> EngramStep | None:
        """The Engram memory of the chunks' tokens: each chunk's n-grams reach back ``n - 1``
        tokens into its request (across a chunk or prefix-hit boundary)."""
        cfg = self.model
        if not cfg.engram_layers:
            return None
        n, contexts = cfg.engram_ngram, []
        for seq, chunk, start in zip(seqs, chunks, starts):
            lo = max(0, start - (n - 1))
            history = seq.req.tokens_from(lo)[: start - lo]
            contexts.append(np.concatenate((history, np.asarray(chunk, dtype=np.int64))))
        sizes = [len(c) for c in chunks]
        ngrams = chunk_ngrams(contexts, sizes, n, pad_token(cfg.vocab_size))
        return step_of(cfg, torch.from_numpy(ngrams), self.engram)

    def _tail_rows(self, chunks: list[list[int]]) -> np.ndarray | None:
        """Flat rows of the last ``window`` tokens of every chunk; ``None`` when that is every
        row (no chunk is longer than the window: the forward is exact)."""
        w, sizes = self.model.window, np.array([len(c) for c in chunks], dtype=np.int64)
        if sizes.max() <= w:
            return None
        ends = np.cumsum(sizes)
        keep = np.minimum(sizes, w)
        return np.concatenate([np.arange(e - k, e) for e, k in zip(ends, keep)])

    def _forward_mtp(self, seqs: list[_Seq], chunks: list[list[int]], alloc, step, logit_rows):
        prev = torch.stack([self.hidden_of(s, start) for s, start in zip(seqs, alloc.starts)])
        first = np.cumsum([0] + [len(c) for c in chunks[:-1]])
        logits, hidden = run_step_mtp(
            self.weights,
            self.pools,
            step,
            logit_rows,
            prev,
            torch.from_numpy(first).to(self.device),
            self.cache.config.page_size,
            self.offload,
        )
        ends = torch.from_numpy(np.cumsum([len(c) for c in chunks]) - 1).to(self.device)
        for s, h in zip(seqs, hidden[ends]):  # a copy: the step's (N, D) tensor is not kept
            s.hidden = (s.req, h)
        self.step_hidden = hidden
        return logits

    def hidden_of(self, seq: _Seq, start: int | None = None) -> torch.Tensor:
        """The main hidden state before ``start`` (default: the request's length): kept from
        the request's last forward, or read from the pools when it resumes on a prefix hit."""
        req = seq.req
        if seq.hidden is not None and seq.hidden[0] is req:
            return seq.hidden[1]
        at = req.length if start is None else start
        return resume_hidden(self.pools, req, at, self.cache.config.page_size)
