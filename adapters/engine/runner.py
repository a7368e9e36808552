"""Continuous-batching runner: chunked prefill, batched decode, prefix reuse, preemption.

One step = at most one prefill forward (chunks of several requests, ``chunk_tokens`` in all)
plus one decode forward (every request in its decode phase, one token each). The cache plans
every slot; the runner only schedules, executes the plans on the pools and samples.

Pool exhaustion never crashes a step: when an extend raises `CapacityError`, a running request
(the lowest priority, then the most recently admitted) is preempted (its cache request aborted,
its tokens requeued at its rank, recomputed later with whatever prefix is still cached) and the
extend is retried. Waiting requests are admitted by priority, then longest cached prefix first
(or arrival order: ``schedule``). A forward that raises finishes its own requests with an error
result; the others go on.

With ``CacheConfig(bounded_replay=True)`` a hit whose window was tombstoned is served by
encoder-side replay (docs/replay.md): the window rebuild the core plans at admission runs
before the request's first prefill chunk, within the step's token budget, and every result
that read replay-derived state is flagged ``approximate``.

`Runner` is made of its roles, one module each, over the fields `runner_base` declares:
`admission` (submission checks, admission control, preemption, the HiSparse fit), `prefill`
(replays and prompt chunks), `decode` (one token per decoding request), `forward` (one paged
forward over the pools) and `emission` (sampling and finishing). This module builds it and
holds its public face: `submit`, `step`, `run`, `generate`, `take_finished`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from adapters import kernels
from adapters.engine.admission import UnsupportedRequestError, check_priority
from adapters.engine.decode import Decode
from adapters.engine.overlap import check_overlap
from adapters.engine.prefill import Prefill
from adapters.engine.runner_stats import ExecutionPaths, RunnerStats
from adapters.engine.sampling import Sampler, SamplingParams
from adapters.engine.sequence import FailureStage, GenerationResult, RequestFailure, _Seq
from adapters.engine.speculative import DraftSource, MTPDraft, SpeculativeDecoder
from adapters.engine.waiting import SchedulePolicy, WaitingQueue
from adapters.forward.graph_decode import GraphDecoder
from adapters.forward.memory_plan import prefill_budget
from adapters.memory.device import check_pools_fit, resolve_device
from adapters.memory.formats import CacheFormat
from adapters.memory.pools import KVPools, pool_bytes
from adapters.model.model_config import ModelConfig
from adapters.model.weights import ModelWeights, init_weights
from shadowradix import CacheConfig, InvalidRequestError, ShadowRadixCache

__all__ = [
    "FailureStage",
    "GenerationResult",
    "RequestFailure",
    "Runner",
    "RunnerStats",
    "SchedulePolicy",
    "UnsupportedRequestError",
]


class Runner(Prefill, Decode):
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

    ``schedule``: the order waiting requests are admitted in, after their priority
    (`submit`'s ``priority``: higher first): `SchedulePolicy.LPM` (default) the longest cached
    prefix first, `SchedulePolicy.FCFS` arrival order (`waiting.WaitingQueue`). When memory
    runs out the lowest-priority, most recently admitted request is preempted; a waiting
    request preempts lower-priority running ones for room, never one of its priority or higher.

    A forward that raises fails only its own requests: they finish with
    ``finish_reason="error"`` and a `RequestFailure` (the exception, typed), their cache state
    released, and `step` / `run` / `generate` return as usual (`Emission._isolated`).

    ``overlap``: the host schedules decode step N+1 while the device runs step N (`Overlap`;
    default: with CUDA graphs); needs the graph decoder (`ValueError` with speculation,
    HiSparse or ``graph_decode=False``); `paths` names it.

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
        schedule: SchedulePolicy = SchedulePolicy.LPM,
        overlap: bool | None = None,
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
        need = pool_bytes(model, cache_config, dtype, index_format, swa_format)
        check_pools_fit(need, self.device)  # before the cache's page lists and the pools
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
            from adapters.memory.offload import C4Offload

            self.offload = C4Offload(
                model, cache_config, self.device, dtype, hisparse_pages, cache_config.debug,
                events=self.cache.subscribe_events(),  # its own queue: take_events is untouched
            )  # fmt: skip
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
        self.spec = None
        if draft is not None:
            self.spec = SpeculativeDecoder(self, self.spec_tokens, draft, graph_decode)
        self.memory = prefill_budget(model, dtype, self.device, memory_budget)
        self.overlap = check_overlap(overlap, self.decoder, self.spec, self.offload)
        self._inflight, self._table_deltas = None, []
        self._step_hidden: torch.Tensor | None = None
        self._waiting = WaitingQueue(self.cache, schedule)
        self._running: list[_Seq] = []
        self._next_id = 0
        self._unclaimed: list[GenerationResult] = []
        self._salvaged: list[GenerationResult] = []
        self._clock = 0
        self.on_logits: Callable[[list[GenerationResult], torch.Tensor], None] | None = None

    # -- submission ------------------------------------------------------------------------

    def submit(
        self, prompt: Sequence[int], params: SamplingParams | None = None, priority: int = 0
    ) -> int:
        """Queues a request; returns its id. ``priority``: higher is admitted first and
        preempted last (default 0). Raises `InvalidRequestError` (queueing nothing) for an
        empty prompt, tokens outside the vocabulary, a request longer than the full pool can
        ever hold, or a priority that is not an int."""
        params = params or SamplingParams()
        tokens = self._validate(prompt, params)
        priority = check_priority(priority)
        rid = self._next_id
        self._next_id += 1
        seq = _Seq(GenerationResult(rid, tokens), params, Sampler(params), priority=priority)
        if params.prompt_logprobs:
            seq.result.prompt_logprobs = [None] * len(tokens)
        self._waiting.push(seq)
        return rid

    @property
    def num_pending(self) -> int:
        """Requests submitted and not finished (waiting, running, or awaiting their last token
        from the step in flight)."""
        step = self._inflight
        return len(self._waiting) + len(self._running) + (step.num_closing if step else 0)

    @property
    def paths(self) -> ExecutionPaths:
        """Which code this runner's steps take (no silent fallback; the run summary prints it)."""
        if self.spec is not None:
            decode = "speculative"
        elif self.decoder is None:
            decode = "paged"
        else:
            decode = "cuda graphs" if self.decoder.use_graphs else "eager"
        fused = kernels.SPARSE_KERNELS and kernels.TRITON_AVAILABLE and self.device.type == "cuda"
        copies = self.offload.copy_path if self.offload is not None else None
        scheduling = "overlapped" if self.overlap else "serialised"
        return ExecutionPaths("triton" if fused else "torch", decode, copies, scheduling)

    @property
    def num_prefilling(self) -> int:
        """Requests waiting for admission or with prompt tokens still to compute."""
        return len(self._waiting) + sum(not s.decoding for s in self._running)

    # -- the step --------------------------------------------------------------------------

    def step(self) -> list[GenerationResult]:
        """Admits, runs one prefill forward and one decode forward; returns finished results,
        those a failed forward finished with ``finish_reason="error"`` included (a forward
        that raises fails its own requests only: nothing is raised here for it). With overlap
        scheduling the decode forward is launched and the previous step's is read back: its
        tokens are emitted and its results returned by this call."""
        self._clock += 1
        self.stats.steps += 1
        self._admit()
        done = self._prefill()
        done += self._decode()
        return done + self._take_salvaged()

    def run(
        self, on_step: Callable[[Runner, list[GenerationResult]], None] | None = None
    ) -> list[GenerationResult]:
        """Steps until every submitted request finished; results in completion order. Requests
        whose forward raised are among them, with ``finish_reason="error"``."""
        finished = self.take_finished()
        while self.num_pending:
            done = self.step()
            finished += done
            if on_step is not None:
                on_step(self, done)
        return finished

    # -- conveniences ----------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_step: Callable[[Runner, list[GenerationResult]], None] | None = None,
        *,
        priorities: Sequence[int] | None = None,
    ) -> list[GenerationResult]:
        """Runs every prompt to completion; results in prompt order. A prompt that fails
        validation, or whose forward raises, gets ``finish_reason="error"`` (with its
        ``failure``) and never disturbs the others. ``params``: one for all, or one per prompt;
        ``priorities``: one per prompt (default 0 each; see `submit`); `InvalidRequestError`
        if a count differs. Requests submitted earlier keep running; their results wait in
        `take_finished`."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        priorities = [0] * len(prompts) if priorities is None else priorities
        if not len(params) == len(priorities) == len(prompts):
            raise InvalidRequestError(
                f"{len(prompts)} prompts but {len(params)} SamplingParams and "
                f"{len(priorities)} priorities"
            )
        results: list[GenerationResult | None] = []
        ids: dict[int, int] = {}
        for i, (prompt, p, prio) in enumerate(zip(prompts, params, priorities)):
            try:
                ids[self.submit(prompt, p, prio)] = i
                results.append(None)
            except InvalidRequestError as exc:
                bad = list(prompt) if isinstance(prompt, (list, tuple)) else []
                failure = RequestFailure(FailureStage.SUBMIT, exc)
                results.append(
                    GenerationResult(
                        -1, bad, finish_reason="error", error=str(exc), failure=failure
                    )
                )
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
