"""Continuous-batching runner: chunked prefill, batched decode, prefix reuse, preemption.

One step is the loop of three parts that call nothing back (docs/runner.md, "The engine")::

    schedule   `Scheduler` (torch-free): admission, preemption, chunk budgeting
               (`chunks.StepBudget`); every extend gives a frozen `ScheduledBatch`
    execute    `ModelRunner`: the batch on the pools (paged, tail-only, graph decode / verify)
    postprocess `Emission`: sampling, appending, finishing; failure isolation

at most one replay and one prefill forward (chunks of several requests, ``chunk_tokens`` in
all), then one decode forward (every request in its decode phase, one token each): plain,
overlapped with the next step's scheduling (`OverlapDecode`) or speculative (the decode
strategy `SpeculativeDecoder` proposes and judges; the loop extends, executes, rolls back and
emits). The cache plans every slot; pool exhaustion preempts, never crashes a step; a forward
that raises finishes its own requests with an error result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from adapters import kernels
from adapters.engine.batch import BatchKind
from adapters.engine.build import (
    check_chunk,
    check_hisparse,
    check_multi_stream,
    check_speculation,
    check_tail_only,
    make_model_runner,
    make_offload,
    make_speculation,
)
from adapters.engine.chunks import StepBudget
from adapters.engine.drafts import DraftSource
from adapters.engine.emission import Emission
from adapters.engine.forward import Forward
from adapters.engine.modes import Modes, UnsupportedModeError, check_modes
from adapters.engine.overlap import OverlapDecode, check_overlap
from adapters.engine.runner_stats import ExecutionPaths, RunnerStats
from adapters.engine.sampling import Sampler, SamplingParams
from adapters.engine.scheduler import Scheduler, SchedulerConfig
from adapters.engine.seams import Through
from adapters.engine.sequence import FailureStage, GenerationResult, RequestFailure, _Seq
from adapters.engine.submission import (
    SubmissionRules,
    UnsupportedRequestError,
    check_priority,
    per_prompt,
    refused,
)
from adapters.engine.waiting import SchedulePolicy
from adapters.forward.memory_plan import prefill_budget
from adapters.memory.device import check_pools_fit, resolve_device
from adapters.memory.formats import CacheFormat
from adapters.memory.pool_resize import apply_rebalance
from adapters.memory.pools import KVPools, pool_bytes
from adapters.model.model_config import ModelConfig
from adapters.model.weights import ModelWeights, init_weights
from shadowradix import CacheConfig, InvalidRequestError, RebalanceReport, ShadowRadixCache

__all__ = [
    "FailureStage", "GenerationResult", "RequestFailure", "Runner", "RunnerStats",
    "SchedulePolicy", "UnsupportedModeError", "UnsupportedRequestError",
]  # fmt: skip


class Runner:
    """Runs the embedded model over a `ShadowRadixCache` (docs/runner.md has each mode).

    ``chunk_tokens``: prefill tokens per step. ``max_running``: decode batch bound.
    ``graph_decode``: decode through `GraphDecoder` (slots computed on the device, CUDA graphs
    on GPU; default on CUDA), else the paged path. ``cache_config.bounded_replay``: hits with
    a tombstoned window served by encoder-side replay (approximate, flagged; not with
    speculation). ``hisparse_pages``: the C4 KV in a host mirror with a device buffer of this
    many pages per C4 layer (`C4Offload`; graph decode only if asked: `GraphResidency`).
    ``tail_only``: decoder-side tail-only prefill (docs/sharing.md; needs layers after the
    last KV source; no prompt logprobs: `UnsupportedRequestError`). ``speculative_tokens=k``:
    ``k`` drafts per request verified per decode step (docs/speculative.md) from ``draft``
    (default `MTPDraft`); needs ``CacheConfig(speculative=True)``, ``k + 1 <= max_draft_len``,
    an SWA pool for ``k + 1`` tokens plus the window; verify runs through `GraphVerifier` with
    ``graph_decode`` (paged with HiSparse). ``memory_budget``: transient device bytes beyond
    pools and weights a step may use (default on CUDA: 85 % of what is free after them); a
    request whose one-token step cannot fit is refused at `submit` (`MemoryBudgetError`).
    ``schedule``: the admission order after priority, `SchedulePolicy.LPM` (longest cached
    prefix first) or `SchedulePolicy.FCFS`. ``overlap``: the host schedules decode step N+1
    while the device runs step N (`OverlapDecode`; default with CUDA graphs; needs the graph
    decoder). ``index_format`` / ``swa_format``: cache formats (docs/formats.md).
    ``multi_stream``: graph decode's compressor and indexer on a side stream (docs/runner.md).
    ``on_logits`` (attribute): called with the results and logits rows of every sampling step.
    Raises `UnsupportedModeError` (a `ConfigError`) for modes that cannot run together
    (`modes.check_modes`, before anything is allocated), `ValueError` for a cache config that
    does not match the model or a chunk the SWA pool cannot hold, `DeviceError` for an
    unusable device, `PoolMemoryError` for pools larger than its free memory. A forward that
    raises fails only its own requests (`Emission.isolated`)."""

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
        multi_stream: bool = False,
    ) -> None:
        self.device, multi_stream = resolve_device(device), check_multi_stream(multi_stream)
        self.modes = check_modes(Modes.of(  # every combination, before anything is allocated
            self.device, model, bounded_replay=cache_config.bounded_replay, overlap=overlap,
            graph_decode=graph_decode, hisparse_pages=hisparse_pages, tail_only=tail_only,
            speculative_tokens=speculative_tokens, draft=draft, memory_budget=memory_budget,
            index_format=index_format, swa_format=swa_format, schedule=schedule,
            multi_stream=multi_stream))  # fmt: skip
        dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        check_chunk(cache_config, chunk_tokens, max_running)
        self.model, self.tail_only = model, check_tail_only(model, tail_only)
        need = pool_bytes(model, cache_config, dtype, index_format, swa_format)
        check_pools_fit(need, self.device)  # before the cache's page lists and the pools
        self.cache = ShadowRadixCache(cache_config)
        check_hisparse(model, hisparse_pages, self.modes, cache_config.page_size, max_running)
        draft = check_speculation(model, cache_config, speculative_tokens, draft)
        mtp = draft is not None and draft.uses_mtp
        self.pools = KVPools(
            model, cache_config, self.device, dtype, offload_c4=hisparse_pages is not None,
            track_late_swa=tail_only, mtp=mtp, index_format=index_format, swa_format=swa_format,
        )  # fmt: skip
        self.offload = make_offload(self.cache, model, self.device, dtype, hisparse_pages)
        self.weights = weights or init_weights(model, self.device, dtype)
        self.chunk_tokens, self.max_running = chunk_tokens, max_running
        self.spec_tokens = speculative_tokens or 0
        self.stats = RunnerStats()
        if graph_decode is None:
            graph_decode = self.device.type == "cuda" and self.offload is None
        paged = Forward(
            self.cache, self.weights, self.pools, self.offload, self.stats,
            device=self.device, tail_only=tail_only, mtp=mtp,
        )  # fmt: skip
        self.model_runner = make_model_runner(
            paged, graph_decode, draft is not None, max_running, self.spec_tokens, multi_stream
        )
        self.spec = make_speculation(self.model_runner, draft, max_running, self.spec_tokens)
        self.memory = prefill_budget(model, dtype, self.device, memory_budget)
        self._rules = SubmissionRules(
            model.vocab_size, self.cache, self.spec_tokens, tail_only, self.memory, model
        )
        self._schedule(schedule, hisparse_pages or 0)
        self.emission = Emission(self.scheduler, self.stats, tail_only=tail_only,
                                 window=model.window)  # fmt: skip
        self.overlap = check_overlap(overlap, self.decoder, self.spec, self.offload)
        self._overlap = (
            OverlapDecode(self.scheduler, self.model_runner, self.emission, self.stats)
            if self.overlap
            else None
        )
        self._next_id = 0
        self._unclaimed: list[GenerationResult] = []

    def _schedule(self, policy: SchedulePolicy, device_pages: int) -> None:
        """The scheduler and its step budget; re-balances reach the pools through
        `_rebalanced`."""
        config = SchedulerConfig(
            self.chunk_tokens, self.max_running, self.spec_tokens, device_pages,
            self.model.index_topk, self.model_runner.graph_hisparse is not None,
        )  # fmt: skip
        self.scheduler = Scheduler(self.cache, config, self.stats, policy)
        self.scheduler.on_rebalance = self._rebalanced
        self.budget = StepBudget(self.scheduler, self.model, self.memory)

    def _rebalanced(self, report: RebalanceReport) -> None:
        """A pool re-balance: its rows moved in the pools, its deltas to the device tables."""
        apply_rebalance(self.pools, report)
        self._note_deltas(report.deltas)

    def _note_deltas(self, deltas) -> None:
        """Table changes outside a step's own extend, for every device table that follows them
        (the graph decoder's or verifier's, the draft source's)."""
        self.model_runner.note(deltas)
        if self.spec is not None:
            self.spec.note(deltas)

    #: the components' state, read and written through (callers and tests use these names)
    _running = Through("scheduler", "running")
    _waiting = Through("scheduler", "waiting")
    _clock = Through("scheduler", "clock")
    share_prefills = Through("scheduler", "share_prefills")
    pool_balance = Through("scheduler", "balance")
    on_logits = Through("emission", "on_logits")
    decoder = Through("model_runner", "decoder")
    #: seams tests wrap: the paged forward, the serialised graph decode step, the tail-only
    #: bookkeeping of a prefill forward, a preemption
    _forward = Through("model_runner.paged", "_forward")
    _graph_forward = Through("model_runner", "graph_forward")
    _count_tail = Through("emission", "_count_tail")
    _requeue = Through("scheduler", "requeue")

    # -- submission ------------------------------------------------------------------------

    def submit(
        self, prompt: Sequence[int], params: SamplingParams | None = None, priority: int = 0
    ) -> int:
        """Queues a request; returns its id. ``priority``: higher is admitted first and
        preempted last (default 0). Raises `InvalidRequestError` (queueing nothing) for an
        empty prompt, tokens outside the vocabulary, a request longer than the full pool can
        ever hold, or a priority that is not an int."""
        params = params or SamplingParams()
        tokens = self._rules.tokens(prompt, params)
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
        step = self._overlap.inflight if self._overlap is not None else None
        waiting, running = len(self.scheduler.waiting), len(self.scheduler.running)
        return waiting + running + (step.num_closing if step else 0)

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
        running = self.scheduler.running
        return len(self.scheduler.waiting) + sum(not s.decoding for s in running)

    # -- the step --------------------------------------------------------------------------

    def step(self) -> list[GenerationResult]:
        """Admits, runs one prefill forward and one decode forward; returns finished results,
        those a failed forward finished with ``finish_reason="error"`` included (a forward
        that raises fails its own requests only: nothing is raised here for it). With overlap
        scheduling the decode forward is launched and the previous step's is read back: its
        tokens are emitted and its results returned by this call."""
        self.scheduler.clock += 1
        self.stats.steps += 1
        self._admit()
        done = self._prefill()
        done += self._decode()
        return done + self.emission.take_salvaged()

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
        results: list[GenerationResult | None] = []
        ids: dict[int, int] = {}
        for i, (prompt, p, prio) in enumerate(per_prompt(prompts, params, priorities)):
            try:
                ids[self.submit(prompt, p, prio)] = i
                results.append(None)
            except InvalidRequestError as exc:
                results.append(refused(prompt, exc))
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

    # -- the loop: schedule -> execute -> postprocess ---------------------------------------

    def _admit(self) -> None:  # (a name the stateful tests call step by step)
        self.scheduler.admit()

    def _prefill(self) -> list[GenerationResult]:
        """Pending replays, then one prefill forward over the chunks that fit this step;
        returns the requests it finished. A forward that raises fails its requests only."""
        seqs, chunks = self.budget.prefill_chunks(self.chunk_tokens - self._replay())
        if not seqs:
            return []
        with self.emission.isolated(seqs, FailureStage.PREFILL):
            batch = self.scheduler.allocate(BatchKind.PREFILL, seqs, chunks)
            if batch is None:
                return []
            output = self.model_runner.execute(batch)
            return self.emission.prefill_done(batch, output.logits)
        return []

    def _replay(self) -> int:
        """Runs pending window rebuilds of replayed hits in one forward; the tokens replayed
        (of the step's budget, even if the forward failed)."""
        seqs, parts = self.budget.replay_slices()
        if not parts:
            return 0
        replayed = sum(hi - lo for _, lo, hi in parts)
        with self.emission.isolated(seqs, FailureStage.PREFILL):
            self.model_runner.execute(self.budget.replay_batch(seqs, parts))
            self.budget.replayed(seqs, parts)
        self.stats.replayed_tokens += replayed
        return replayed

    def _decode(self) -> list[GenerationResult]:
        """One decode forward: overlapped where it can be, else serialised (the step in flight
        read back first)."""
        seqs = self.budget.decode_rows()
        ahead = self._overlap
        if ahead is not None and seqs and ahead.overlappable(seqs):
            return ahead.decode(seqs)
        done = ahead.settle() if ahead is not None else []
        if done or ahead is not None:
            seqs = self.budget.decode_rows()
        seqs = self.budget.fit_decode_batch(seqs)
        if not seqs:
            return done
        self.stats.serialised_steps += self.overlap
        with self.emission.isolated(seqs, FailureStage.DECODE):  # a raise fails these only
            done += self._speculate(seqs) if self.spec is not None else self._decode_one(seqs)
        return done

    def _decode_one(self, seqs: list[_Seq]) -> list[GenerationResult]:
        chunks = [[s.result.output[-1]] for s in seqs]
        batch = self.scheduler.allocate(BatchKind.DECODE, seqs, chunks)
        if batch is None:
            return []
        output = self.model_runner.execute(batch)
        self.stats.decode_tokens += len(batch.seqs)
        return self.emission.emit_all(batch.seqs, output.logits)

    def _speculate(self, seqs: list[_Seq]) -> list[GenerationResult]:
        """One verify step: the strategy proposes, the loop extends and executes, the strategy
        judges and settles (draft values, rollbacks in reverse batch order, hidden states), the
        loop notes the rollbacks' deltas and emits."""
        assert self.spec is not None
        proposal = self.spec.propose(seqs)
        batch = self.scheduler.allocate(BatchKind.VERIFY, proposal.seqs, proposal.chunks)
        if batch is None:
            return []
        self.spec.note(batch.deltas)
        output = self.model_runner.execute(batch, self.spec.device_drafts_of(batch, proposal))
        verdict = self.spec.judge(batch, output, proposal)
        self._note_deltas(self.spec.settle(self.cache, batch, verdict))
        self.stats.decode_tokens += sum(len(e) for e in verdict.emitted)
        return self.emission.emit_tokens(batch.seqs, verdict.emitted)
