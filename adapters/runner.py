"""Continuous-batching runner: chunked prefill, batched decode, prefix reuse, preemption.

One step = at most one prefill forward (chunks of several requests, ``chunk_tokens`` in all)
plus one decode forward (every request in its decode phase, one token each). The cache plans
every slot; the runner only schedules, executes the plans on the pools and samples.

Pool exhaustion never crashes a step: when an extend raises `CapacityError`, the most recently
admitted running request is preempted (its cache request aborted, its tokens requeued at the
front, recomputed later with whatever prefix is still cached) and the extend is retried.

With ``CacheConfig(bounded_replay=True)`` a hit whose window was tombstoned is served by
encoder-side replay (docs/replay.md): the window rebuild the core plans at admission runs
before the request's first prefill chunk, within the step's token budget, and every result
that read replay-derived state is flagged ``approximate``.
"""

from __future__ import annotations

import operator
import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np
import torch

from shadowradix import CacheConfig, CapacityError, InvalidRequestError, ReadPlan, ShadowRadixCache

from .device import resolve_device
from .formats import CacheFormat
from .graph_decode import GraphDecoder
from .memory_plan import prefill_budget, visible_entries
from .model_config import ModelConfig
from .mtp import resume_hidden, run_step_mtp
from .paged import build_step, run_step, run_tail_only_step
from .pools import KVPools
from .replay import replay_step
from .runner_stats import RunnerStats
from .sampling import Sampler, SamplingParams, sample_batch
from .sequence import GenerationResult, _Seq
from .speculative import DraftSource, MTPDraft, SpeculativeDecoder
from .weights import ModelWeights, init_weights


def _token(t: object) -> int:
    """An int token id; floats, strings and bools are refused, not coerced."""
    if isinstance(t, (bool, np.bool_)):
        raise TypeError(f"{t!r} is a bool")
    return operator.index(t)  # type: ignore[arg-type]


class UnsupportedRequestError(InvalidRequestError):
    """The request asks for something the runner's mode cannot give: prompt logprobs under
    tail-only prefill (the later layers never see most prompt positions)."""


class Runner:
    """Runs the embedded model over a `ShadowRadixCache`.

    ``chunk_tokens``: prefill tokens per step. ``max_running``: decode batch bound. Raises
    ``graph_decode``: decode through `GraphDecoder` (slots computed on the device from raw
    batch state, CUDA graphs on GPU); default on CUDA. Otherwise decode runs the general paged
    path like prefill. Raises `ValueError` for a cache config that does not match the model or
    a chunk the SWA pool cannot hold, and `DeviceError` for an unusable device.

    ``cache_config.bounded_replay``: hits with a tombstoned window are served by encoder-side
    replay (approximate; flagged in results and stats). It combines with graph decode and
    HiSparse; the core refuses it together with speculation (`ConfigError`).

    ``on_logits`` (attribute, default ``None``): called with the results and the logits rows of
    every sampling step, before sampling (benchmarks measure divergence with it).

    ``hisparse_pages``: keep the C4 KV in a host mirror with a device buffer of this many pages
    per C4 layer (`C4Offload`, planned by `hisparse.Coordinator`). Decode then runs the paged
    path (the plan needs the indexer's top-k on the host mid-forward, which a CUDA graph
    cannot do): ``graph_decode=True`` with HiSparse raises `ValueError`.

    ``tail_only``: decoder-side tail-only prefill (V4.1, an approximation; docs/sharing.md):
    in every prefill forward the layers after the model's last KV-source layer compute only the
    last ``window`` tokens of each request's chunk. Needs cross-layer sharing with layers after
    the last KV source (`ValueError` otherwise); results that may differ from an exact run are
    flagged ``approximate``; requests asking for prompt logprobs raise
    `UnsupportedRequestError`.

    ``speculative_tokens=k``: every decode step verifies ``k`` drafted tokens per request in one
    forward (docs/speculative.md); ``draft`` proposes them (default: the model's MTP layer,
    `MTPDraft`). Needs ``CacheConfig(speculative=True)`` with ``k + 1 <= max_draft_len``, an
    SWA pool that holds ``k + 1`` tokens plus the window, greedy requests only, and no HiSparse
    (`ValueError` otherwise). With ``graph_decode`` the verify
    steps run through `GraphVerifier`.

    ``memory_budget``: transient device bytes a forward step may use beyond the pools and the
    weights (`memory_plan.StepMemory`); every prefill step is sized to it. Default: on CUDA,
    85 % of the memory free once pools, weights and graph buffers are allocated; elsewhere no
    budget. A request whose one-token step would not fit is refused at `submit`
    (`MemoryBudgetError`, nothing queued).

    ``index_format`` / ``swa_format``: the cache format of the C4 indexer keys / of the window
    KV (`formats.CacheFormat.FP8`: e4m3 with a power-of-two scale per row, about half the
    bytes; docs/formats.md)."""

    def __init__(
        self,
        model: ModelConfig,
        cache_config: CacheConfig,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        weights: ModelWeights | None = None,
        chunk_tokens: int = 256,
        max_running: int = 32,
        graph_decode: bool | None = None,
        hisparse_pages: int | None = None,
        tail_only: bool = False,
        speculative_tokens: int | None = None,
        draft: DraftSource | None = None,
        memory_budget: int | None = None,
        index_format: CacheFormat = CacheFormat.BF16,
        swa_format: CacheFormat = CacheFormat.BF16,
    ) -> None:
        self.device = resolve_device(device)
        dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        p = cache_config.page_size
        if chunk_tokens < 1 or max_running < 1:
            raise ValueError("chunk_tokens and max_running must be >= 1")
        swa_need = chunk_tokens + cache_config.window + 2 * p
        if swa_need > cache_config.swa_capacity:
            raise ValueError(
                f"SWA pool of {cache_config.swa_capacity} tokens cannot hold a {chunk_tokens}-token"
                f" chunk plus its window (needs {swa_need}); lower chunk_tokens"
            )
        self.model, self.tail_only = model, _check_tail_only(model, tail_only)
        self.cache = ShadowRadixCache(cache_config)
        if hisparse_pages is not None and graph_decode:
            raise ValueError("HiSparse plans on the host mid-forward: no graph decode with it")
        draft = _check_speculation(model, cache_config, speculative_tokens, draft, hisparse_pages)
        self._mtp = draft is not None and draft.uses_mtp
        if self._mtp and tail_only:
            raise ValueError(
                "MTP drafts with tail-only prefill are not supported: the MTP layer reads the "
                "main model's hidden state at every prompt position (use another draft source)"
            )
        self.pools = KVPools(
            model,
            cache_config,
            self.device,
            dtype,
            offload_c4=hisparse_pages is not None,
            track_late_swa=tail_only,
            mtp=self._mtp,
            index_format=index_format,
            swa_format=swa_format,
        )
        self.offload = None
        if hisparse_pages is not None:
            from .offload import C4Offload

            self.offload = C4Offload(
                model, cache_config, self.device, dtype, hisparse_pages, cache_config.debug
            )
            graph_decode = False
            if hisparse_pages < model.index_topk + 1:
                raise ValueError(
                    f"hisparse_pages={hisparse_pages} cannot hold one query's top-"
                    f"{model.index_topk} pages plus the page it writes"
                )
        self._device_pages = hisparse_pages or 0
        self.weights = weights or init_weights(model, self.device, dtype)
        self.chunk_tokens, self.max_running = chunk_tokens, max_running
        self.stats = RunnerStats()
        if graph_decode is None:
            graph_decode = self.device.type == "cuda"
        self.decoder = (
            GraphDecoder(
                self.weights, self.pools, cache_config, max_running, cache_config.full_capacity
            )
            if graph_decode and draft is None
            else None
        )
        self.spec_tokens = speculative_tokens or 0
        self.spec = (
            SpeculativeDecoder(self, self.spec_tokens, draft, graph_decode)
            if draft is not None
            else None
        )
        self.memory = prefill_budget(model, dtype, self.device, memory_budget)
        self._step_hidden: torch.Tensor | None = None
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._next_id = 0
        self._unclaimed: list[GenerationResult] = []
        self._clock = 0
        self.on_logits: Callable[[list[GenerationResult], torch.Tensor], None] | None = None

    # -- submission ------------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], params: SamplingParams | None = None) -> int:
        """Queues a request; returns its id. Raises `InvalidRequestError` (queueing nothing)
        for an empty prompt, tokens outside the vocabulary, or a request longer than the full
        pool can ever hold."""
        params = params or SamplingParams()
        tokens = self._validate(prompt, params)
        rid = self._next_id
        self._next_id += 1
        seq = _Seq(GenerationResult(rid, tokens), params, Sampler(params))
        if params.prompt_logprobs:
            seq.result.prompt_logprobs = [None] * len(tokens)
        self._waiting.append(seq)
        return rid

    def _validate(self, prompt: Sequence[int], params: SamplingParams) -> list[int]:
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be SamplingParams")
        if params.prompt_logprobs and self.tail_only:
            raise UnsupportedRequestError(
                "prompt_logprobs is not supported with tail-only prefill: the layers after the "
                "last KV source compute only the last window of each chunk"
            )
        if self.spec is not None and params.temperature != 0:
            raise InvalidRequestError(
                "speculative decoding here is greedy only (no rejection sampling): "
                "temperature must be 0"
            )
        if isinstance(prompt, (str, bytes)):
            raise InvalidRequestError("prompt must be a sequence of token ids (encode text first)")
        try:
            tokens = [_token(t) for t in prompt]
        except TypeError as exc:
            raise InvalidRequestError(f"prompt must be a sequence of ints: {exc}") from None
        if not tokens:
            raise InvalidRequestError("empty prompt")
        vocab = self.model.vocab_size
        if min(tokens) < 0 or max(tokens) >= vocab:
            raise InvalidRequestError(f"prompt tokens must be in [0, {vocab})")
        total = len(tokens) + params.max_new_tokens + self.spec_tokens
        if total > self.cache.config.full_capacity:
            raise InvalidRequestError(
                f"prompt + max_new_tokens (+ {self.spec_tokens} draft tokens) = {total} tokens "
                f"exceeds the full pool ({self.cache.config.full_capacity} tokens): "
                "it could never run"
            )
        self.memory.check(total, 1 + self.spec_tokens)
        return tokens

    @property
    def num_pending(self) -> int:
        """Requests submitted and not finished (waiting or running)."""
        return len(self._waiting) + len(self._running)

    @property
    def num_prefilling(self) -> int:
        """Requests waiting for admission or with prompt tokens still to compute."""
        return len(self._waiting) + sum(not s.decoding for s in self._running)

    # -- the step --------------------------------------------------------------------------

    def step(self) -> list[GenerationResult]:
        """Admits, runs one prefill forward and one decode forward; returns finished results."""
        self._clock += 1
        self.stats.steps += 1
        self._admit()
        done = self._prefill()
        done += self._decode()
        return done

    def run(
        self, on_step: Callable[[Runner, list[GenerationResult]], None] | None = None
    ) -> list[GenerationResult]:
        """Steps until every submitted request finished; results in completion order."""
        finished = self.take_finished()
        while self.num_pending:
            done = self.step()
            finished += done
            if on_step is not None:
                on_step(self, done)
        return finished

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_running:
            seq = self._waiting[0]
            if self._running and not self._fits(seq):
                return
            tokens = seq.tokens
            keep = 0 if seq.params.prompt_logprobs else len(tokens) - 1  # leave one to compute
            match = self.cache.match_prefix(tokens, max_len=keep)
            # cannot raise CapacityError for a replayed window: `_fits` (or, with nothing
            # running, an all-evictable SWA pool) leaves room for a window and a chunk
            seq.request = self.cache.admit(tokens, match)
            seq.result.cached_tokens = max(seq.result.cached_tokens, match.hit_len)
            if match.hit_len and self.stats.tail_skipped_tokens:  # the prefix may hold holes
                seq.result.approximate = True
            seq.admitted_at = self._clock
            if seq.request.replay_allocation is not None:
                seq.replay_at = seq.request.replay_allocation.starts[0]
                self.stats.replayed_hits += 1
            self._running.append(self._waiting.popleft())

    def _fits(self, seq: _Seq) -> bool:
        """Admission control: room for the whole request in both pools right now."""
        st, p = self.cache.stats(), self.cache.config.page_size
        need = -(-(seq.num_tokens + seq.params.max_new_tokens + self.spec_tokens) // p)
        full_room = st.full.free_pages + st.full.evictable_pages
        swa_room = st.swa.free_pages + st.swa.evictable_pages
        window_pages = -(-(self.cache.config.window + min(self.chunk_tokens, seq.num_tokens)) // p)
        return need <= full_room and window_pages + 1 <= swa_room

    def _preempt(self) -> bool:
        """Requeues the most recently admitted running request; False if none can yield."""
        if len(self._running) <= 1:
            return False
        victim = max(self._running, key=lambda s: s.admitted_at)
        self._running.remove(victim)
        assert victim.request is not None
        self.cache.abort(victim.request)
        victim.request = None
        victim.replay_at = None
        victim.result.preemptions += 1
        self.stats.preemptions += 1
        self._waiting.appendleft(victim)
        return True

    def _extend(self, seqs: list[_Seq], chunks: list[list[int]], draft: bool = False):
        """``extend_batch`` (``extend_draft_batch`` for a ``draft``) that preempts other requests
        until it fits. Returns the surviving (seqs, chunks) and the allocation, or raises
        `CapacityError` if nothing can yield."""
        while True:
            live = [(s, c) for s, c in zip(seqs, chunks) if s.request is not None]
            if not live:
                return [], [], None
            seqs, chunks = [s for s, _ in live], [c for _, c in live]
            try:
                extend = self.cache.extend_draft_batch if draft else self.cache.extend_batch
                alloc = extend([s.req for s in seqs], chunks)
                return seqs, chunks, alloc
            except CapacityError:
                if not self._preempt():
                    raise

    def _forward(
        self,
        seqs: list[_Seq],
        chunks: list[list[int]],
        alloc,
        rows: list[int],
        plans: list[ReadPlan] | None = None,
    ):
        """Logits of the flat token ``rows`` of one forward over ``chunks``. A tail-only runner
        runs chunks longer than the window tail-only (``rows`` are then chunk ends). With the MTP
        layer kept, also its state, and each request's hidden state at its chunk's end (every
        row's in ``_step_hidden``)."""
        t0 = time.perf_counter()
        if plans is None:
            plans = [self.cache.read_plan(s.req, start=st) for s, st in zip(seqs, alloc.starts)]
        flat = np.fromiter((t for c in chunks for t in c), np.int64)
        step = build_step(self.model, alloc, plans, flat, self.device)
        if self.offload is not None:
            self.offload.drain()  # every page the forward plans for is unpinned
            self.offload.begin_step(step.streams[4].entry_slots_np)
        tail_rows = self._tail_rows(chunks) if self.tail_only else None
        if tail_rows is not None:
            rows = np.searchsorted(tail_rows, rows).tolist()  # chunk ends are tail rows
        logit_rows = torch.tensor(rows, device=self.device, dtype=torch.long)
        t1 = time.perf_counter()
        if self._mtp:  # never tail-only (refused at construction)
            logits = self._forward_mtp(seqs, chunks, alloc, step, logit_rows)
        elif tail_rows is None:
            logits = run_step(self.weights, self.pools, step, logit_rows, self.offload)
        else:
            tail_t = torch.from_numpy(tail_rows).to(self.device)
            logits = run_tail_only_step(
                self.weights, self.pools, step, tail_t, logit_rows, self.offload
            )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t2 = time.perf_counter()
        self.stats.schedule_s += t1 - t0
        self.stats.forward_s += t2 - t1
        return logits

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
        prev = torch.stack([self._hidden_of(s, start) for s, start in zip(seqs, alloc.starts)])
        first = np.cumsum([0] + [len(c) for c in chunks[:-1]])
        logits, hidden = run_step_mtp(
            self.weights,
            self.pools,
            step,
            logit_rows,
            prev,
            torch.from_numpy(first).to(self.device),
            self.cache.config.page_size,
        )
        ends = torch.from_numpy(np.cumsum([len(c) for c in chunks]) - 1).to(self.device)
        for s, h in zip(seqs, hidden[ends]):  # a copy: the step's (N, D) tensor is not kept
            s.hidden = (s.req, h)
        self._step_hidden = hidden
        return logits

    def _hidden_of(self, seq: _Seq, start: int | None = None) -> torch.Tensor:
        """The main hidden state before ``start`` (default: the request's length): kept from
        the request's last forward, or read from the pools when it resumes on a prefix hit."""
        req = seq.req
        if seq.hidden is not None and seq.hidden[0] is req:
            return seq.hidden[1]
        at = req.length if start is None else start
        return resume_hidden(self.pools, req, at, self.cache.config.page_size)

    def _graph_forward(self, seqs: list[_Seq], tokens: list[int]) -> torch.Tensor:
        assert self.decoder is not None
        t0 = time.perf_counter()
        logits = self.decoder.step([s.req for s in seqs], tokens)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats.forward_s += time.perf_counter() - t0
        return logits

    def _working_set(self, seq: _Seq, num_tokens: int) -> int:
        """Upper bound of the C4 pages one request's ``num_tokens`` new queries read (HiSparse):
        each reads top-k entries, and no request reads more pages than it has."""
        pages = -(-(seq.req.length + num_tokens) // self.cache.config.page_size)
        return min(num_tokens * self.model.index_topk, pages)

    def _fit_tokens(self, seq: _Seq, wanted: int, pages_left: int) -> int:
        """How many of ``wanted`` tokens fit in the HiSparse device buffer's remaining pages."""
        if self.offload is None or self._working_set(seq, wanted) <= pages_left:
            return wanted
        return min(wanted, pages_left // self.model.index_topk)

    def _replay(self) -> int:
        """Runs pending window rebuilds of replayed hits (each before its request's first
        chunk) in one forward, slices of at most the step's token budget (and, with HiSparse,
        of the device working set); returns the tokens replayed."""
        budget, parts, seqs = self.chunk_tokens, [], []
        pages_left = self._device_pages
        for seq in self._running:
            if seq.replay_at is None or budget == 0:
                continue
            alloc = seq.req.replay_allocation
            assert alloc is not None
            n = self._fit_tokens(seq, min(budget, alloc.ends[0] - seq.replay_at), pages_left)
            if not n:
                break
            budget -= n
            pages_left -= self._working_set(seq, n) if self.offload else 0
            parts.append((alloc, seq.replay_at, seq.replay_at + n))
            seqs.append(seq)
        if not parts:
            return 0
        chunks = [s.token_slice(lo, hi) for s, (_, lo, hi) in zip(seqs, parts)]
        plans = [self.cache.read_plan(s.req) for s in seqs]  # window [replay_start, prefix_len)
        self._forward(seqs, chunks, replay_step(parts), [], plans)
        for seq, (alloc, _, hi) in zip(seqs, parts):
            seq.replay_at = hi if hi < alloc.ends[0] else None
        replayed = self.chunk_tokens - budget
        self.stats.replayed_tokens += replayed
        return replayed

    def _prefill(self) -> list[GenerationResult]:
        budget, seqs, chunks = self.chunk_tokens - self._replay(), [], []
        pages_left, entries = self._device_pages, 0
        for seq in self._running:
            if seq.decoding or seq.replay_at is not None or budget == 0:
                continue
            entries += visible_entries(self.model, seq.num_tokens)
            taken = self.chunk_tokens - budget
            want = min(budget, max(0, self.memory.step_tokens(entries, self.chunk_tokens) - taken))
            chunk = seq.req.prompt_remaining[: self._fit_tokens(seq, want, pages_left)].tolist()
            if not chunk:
                break
            budget -= len(chunk)
            pages_left -= self._working_set(seq, len(chunk)) if self.offload else 0
            seqs.append(seq)
            chunks.append(chunk)
        if not seqs:
            return []
        seqs, chunks, alloc = self._extend(seqs, chunks)
        if alloc is None:
            return []
        last = [len(s.req.prompt_remaining) == 0 for s in seqs]
        spans = self._logit_spans(seqs, chunks, last)
        rows = [r for span in spans for r in span]
        logits = self._forward(seqs, chunks, alloc, rows)
        self.stats.prefill_tokens += sum(len(c) for c in chunks)
        if self.tail_only:
            self._count_tail(seqs, chunks)
        blocks = torch.split(logits, [len(span) for span in spans])
        for seq, start, block in zip(seqs, alloc.starts, blocks):
            if seq.params.prompt_logprobs:
                _record_prompt_logprobs(seq.result, start, block)
        for seq in seqs:
            # After every chunk, as SGLang does: the chunk's pages enter the tree with their
            # live SWA, so a later prompt branching anywhere inside this one still finds a
            # window (SWA eviction tombstones node heads before tails when SWA runs short).
            self.cache.cache_unfinished(seq.req)
        ready = [(seq, block[-1:]) for seq, is_last, block in zip(seqs, last, blocks) if is_last]
        if not ready:
            return []
        return self._emit_all([s for s, _ in ready], torch.cat([b for _, b in ready]))

    @staticmethod
    def _logit_spans(seqs: list[_Seq], chunks: list[list[int]], last: list[bool]) -> list[range]:
        """Per request, the flat rows of the prefill forward whose logits it needs: its whole
        chunk for prompt logprobs, else its last token if its prompt ends in this chunk."""
        spans, end = [], 0
        for seq, chunk, is_last in zip(seqs, chunks, last):
            start, end = end, end + len(chunk)
            first = start if seq.params.prompt_logprobs else end - 1 if is_last else end
            spans.append(range(first, end))
        return spans

    def _count_tail(self, seqs: list[_Seq], chunks: list[list[int]]) -> None:
        """Tail-only bookkeeping of one prefill forward: skipped tokens, approximate results."""
        skipped = [max(0, len(c) - self.model.window) for c in chunks]
        for seq, n in zip(seqs, skipped):
            seq.result.approximate |= n > 0
        self.stats.tail_skipped_tokens += sum(skipped)
        self.stats.tail_only_forwards += any(skipped)

    def _decode(self) -> list[GenerationResult]:
        seqs = [s for s in self._running if s.decoding and s.result.finish_reason is None]
        seqs = [s for s in seqs if s.req.length == s.num_tokens - 1]  # one token pending
        if self.offload is not None:
            seqs = self._fit_decode_batch(seqs)
        if not seqs:
            return []
        if self.spec is not None:
            return self.spec.decode(self, seqs)
        chunks = [[s.result.output[-1]] for s in seqs]
        seqs, chunks, alloc = self._extend(seqs, chunks)
        if alloc is None:
            return []
        if self.decoder is None:
            logits = self._forward(seqs, chunks, alloc, list(range(len(seqs))))
        else:
            logits = self._graph_forward(seqs, [c[0] for c in chunks])
        self.stats.decode_tokens += len(seqs)
        return self._emit_all(seqs, logits)

    def _fit_decode_batch(self, seqs: list[_Seq]) -> list[_Seq]:
        """The decode requests whose working sets fit the HiSparse buffer this step, starting
        at a rotating offset so that requests left out now go first later."""
        if not seqs:
            return seqs
        start = self._clock % len(seqs)
        chosen, pages_left = [], self._device_pages
        for seq in seqs[start:] + seqs[:start]:
            need = self._working_set(seq, 1)
            if need <= pages_left:
                chosen.append(seq)
                pages_left -= need
        return chosen

    def _emit_all(self, seqs: list[_Seq], logits: torch.Tensor) -> list[GenerationResult]:
        if not seqs:
            return []
        if self.on_logits is not None:
            self.on_logits([s.result for s in seqs], logits)
        tokens = sample_batch([s.sampler for s in seqs], logits)
        return [res for seq, tok in zip(seqs, tokens) for res in self._emit(seq, tok)]

    def _emit(self, seq: _Seq, token: int) -> list[GenerationResult]:
        res = seq.result
        res.output.append(token)
        res.approximate |= seq.req.approximate
        if seq.params.stop_token is not None and token == seq.params.stop_token:
            res.finish_reason = "stop"
        elif len(res.output) >= seq.params.max_new_tokens:
            res.finish_reason = "length"
        else:
            return []
        assert seq.request is not None
        self.cache.finish(seq.request)
        seq.request = None
        self._running.remove(seq)
        self.stats.approximate_results += res.approximate
        return [res]

    # -- conveniences ----------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_step: Callable[[Runner, list[GenerationResult]], None] | None = None,
    ) -> list[GenerationResult]:
        """Runs every prompt to completion; results in prompt order. A prompt that fails
        validation gets ``finish_reason="error"`` and never disturbs the others. ``params``:
        one for all, or one per prompt (`InvalidRequestError` if the counts differ). Requests
        submitted earlier keep running; their results wait in `take_finished`."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        results: list[GenerationResult | None] = []
        ids: dict[int, int] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                ids[self.submit(prompt, p)] = i
                results.append(None)
            except InvalidRequestError as exc:
                bad = list(prompt) if isinstance(prompt, (list, tuple)) else []
                results.append(GenerationResult(-1, bad, finish_reason="error", error=str(exc)))
        waiting = set(ids)
        while waiting:
            done = self.step()
            for res in done:
                if res.request_id in waiting:
                    waiting.discard(res.request_id)
                    results[ids[res.request_id]] = res
                else:
                    self._unclaimed.append(res)
            if on_step is not None:
                on_step(self, done)
        return [r for r in results if r is not None]

    def take_finished(self) -> list[GenerationResult]:
        """Results of `submit`ted requests that finished inside a `generate` call."""
        out, self._unclaimed = self._unclaimed, []
        return out


def _check_tail_only(model: ModelConfig, tail_only: bool) -> bool:
    """``tail_only``, validated against the model (`ValueError` if it cannot apply)."""
    last = model.last_kv_source
    if tail_only and last is None:
        raise ValueError(
            "tail_only needs cross-layer KV sharing (ModelConfig.kv_sources): the layers after "
            "the last KV-source layer are the ones it skips"
        )
    if tail_only and last == model.num_layers - 1:
        raise ValueError(f"tail_only: no layer comes after the last KV-source layer {last}")
    return tail_only


def _record_prompt_logprobs(result: GenerationResult, start: int, logits: torch.Tensor) -> None:
    """Stores the log-probabilities of the prompt tokens that the rows ``logits`` (positions
    ``start, start + 1, ...``) predict: position ``p`` predicts token ``p + 1``."""
    assert result.prompt_logprobs is not None
    prompt = result.prompt
    n = min(logits.shape[0], len(prompt) - 1 - start)
    if n <= 0:
        return
    targets = torch.tensor(prompt[start + 1 : start + 1 + n], device=logits.device)
    logprobs = torch.log_softmax(logits[:n].double(), dim=-1)
    picked = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    result.prompt_logprobs[start + 1 : start + 1 + n] = picked


def _check_speculation(
    model: ModelConfig,
    cache_config: CacheConfig,
    num_tokens: int | None,
    draft: DraftSource | None,
    hisparse_pages: int | None,
) -> DraftSource | None:
    """The draft source of a speculative runner (`MTPDraft` by default), ``None`` without
    speculation; `ValueError` for a combination the runner cannot run."""
    if num_tokens is None:
        if draft is not None:
            raise ValueError("a draft source needs speculative_tokens=k")
        return None
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"speculative_tokens must be an int >= 1, got {num_tokens!r}")
    if not cache_config.speculative:
        raise ValueError("speculative decoding needs CacheConfig(speculative=True)")
    limit = cache_config.max_draft_len
    if limit is not None and num_tokens + 1 > limit:
        raise ValueError(
            f"speculative_tokens={num_tokens} verifies {num_tokens + 1} tokens per step, more "
            f"than the cache's max_draft_len={limit}"
        )
    verify_need = num_tokens + 1 + cache_config.window + 2 * cache_config.page_size
    if verify_need > cache_config.swa_capacity:
        raise ValueError(
            f"SWA pool of {cache_config.swa_capacity} tokens cannot hold a verify step of "
            f"{num_tokens + 1} tokens plus its window (needs {verify_need}); lower "
            "speculative_tokens"
        )
    if hisparse_pages is not None:
        raise ValueError("speculative decoding with HiSparse is not supported")
    if draft is None:
        if not model.mtp:
            raise ValueError("the model has no MTP layer: pass a draft source")
        draft = MTPDraft()
    return draft
