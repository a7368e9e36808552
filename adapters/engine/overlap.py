"""Overlap scheduling: the host schedules decode step N+1 (admission, the cache's bookkeeping,
the page-table upload) while the device runs step N. `OverlapDecode` is the runner's decode
phase when it overlaps; it holds the scheduler, the model runner and emission, and the step in
flight.

One call of `Runner.step` with step N in flight::

    admit · prefill · extend_pending_batch(N+1) · launch N+1 (its inputs: N's tokens, gathered
    on the device) · resolve N: wait for N's token copy, emit the tokens · commit N+1's pending
    tokens (their values are N's) · close the requests whose N+1 token is their last

The host learns a step's tokens one step late, so a value-dependent stop (``stop_token``) is
applied one step late: a request that stopped at N was launched again at N+1; its pending token
is dropped (`ShadowRadixCache.drop_pending`) before it finishes, so the cache ends exactly as
without overlap, and its N+1 row is ignored. ``max_new_tokens`` needs no value: a request whose
next token is its last is finished in the cache right after its launch (`_commit`) and never
enters another step; its result is returned when that token is read back.

What runs serialised: a decode step with a non-greedy request (its sampler draws on the host),
or with ``on_logits`` set (it reads the logits) — the step in flight is resolved first
(`RunnerStats.serialised_steps`); prefill forwards (they sample on the host). Preempting a
request of the step in flight resolves that step first (the scheduler's ``settle`` port:
`settle_for_preemption`), so the victim requeues with its last token (or finishes, if that
token was its stop token)."""

from __future__ import annotations

import time

from adapters.engine.emission import _PROPAGATED, Emission
from adapters.engine.inflight import InFlightStep, input_tokens
from adapters.engine.model_runner import ModelRunner
from adapters.engine.runner_stats import RunnerStats
from adapters.engine.scheduler import Scheduler
from adapters.engine.sequence import FailureStage, GenerationResult, _Seq
from adapters.forward.graph_decode import GraphDecoder
from shadowradix import StepPlan


def check_overlap(
    overlap: bool | None,
    decoder: GraphDecoder | None,
    spec: object | None,
    offload: object | None,
) -> bool:
    """Whether a runner schedules with overlap: by default where decode replays CUDA graphs;
    ``True`` needs the graph decoder (`ValueError` naming what stays serialised otherwise)."""
    if overlap is None:
        return decoder is not None and decoder.use_graphs
    if not isinstance(overlap, bool):
        raise ValueError(f"overlap must be a bool or None, got {overlap!r}")
    if overlap and decoder is None:
        what = (
            "speculative decoding" if spec is not None
            else "HiSparse decode" if offload is not None
            else "the paged decode path (graph_decode=False)"
        )  # fmt: skip
        raise ValueError(f"overlap scheduling needs the graph decoder: {what} runs serialised")
    return overlap


class OverlapDecode:
    """The overlapped decode step and the settling of the step before it."""

    def __init__(
        self,
        scheduler: Scheduler,
        model_runner: ModelRunner,
        emission: Emission,
        stats: RunnerStats,
    ) -> None:
        self.scheduler, self.model_runner, self.emission = scheduler, model_runner, emission
        self.stats = stats
        self._inflight: InFlightStep | None = None
        scheduler.settle = self.settle_for_preemption

    @property
    def inflight(self) -> InFlightStep | None:
        """The decode step launched and not yet read back (the scheduler sees it too)."""
        return self._inflight

    @inflight.setter
    def inflight(self, step: InFlightStep | None) -> None:
        self._inflight = self.scheduler.inflight = step

    def overlappable(self, seqs: list[_Seq]) -> bool:
        """Whether this decode batch can run overlapped (greedy rows, nothing reads logits, no
        top-k capture or replay: those run paged)."""
        return self.emission.on_logits is None and all(
            s.sampler.greedy and not s.params.uses_topk for s in seqs
        )

    def decode(self, batch: list[_Seq]) -> list[GenerationResult]:
        """Launches the decode step of ``batch``, then resolves the step in flight; returns
        what that finished. A launch that raises fails ``batch``'s requests only, after the
        step in flight is resolved (their tokens from it are kept)."""
        prev = self.inflight
        try:
            seqs, plan = self.scheduler.extend_pending(batch)
            step = self._launch(seqs, plan, prev) if plan is not None else None
        except _PROPAGATED:
            raise
        except Exception as exc:
            return self._failed_launch(batch, prev, exc)
        self.inflight = step
        done = self._resolve(prev) if prev is not None else []
        if step is not None:
            self._commit(step)
        return done

    def settle(self) -> list[GenerationResult]:
        """Resolves the step in flight, if any (a serialised step, or nothing left to launch)."""
        return self._resolve(self.inflight) if self.inflight is not None else []

    def settle_for_preemption(self) -> None:
        """`settle`, its results kept for the step that preempts (`Emission.salvaged`)."""
        self.emission.salvaged += self.settle()

    def _launch(self, seqs: list[_Seq], plan: StepPlan, prev: InFlightStep | None) -> InFlightStep:
        """Queues the decode forward of ``seqs`` and its greedy sampling on the device; no
        synchronisation (``forward_s`` counts the host time of the launch only)."""
        t0 = time.perf_counter()
        logits = self.model_runner.launch(seqs, input_tokens(seqs, prev), plan)
        step = InFlightStep(seqs, logits.argmax(dim=-1))
        self.stats.forward_s += time.perf_counter() - t0
        self.stats.decode_tokens += len(seqs)
        self.stats.overlapped_steps += 1
        return step

    def _resolve(self, step: InFlightStep) -> list[GenerationResult]:
        """Reads ``step``'s tokens back and emits them; returns the requests they finished. A
        row whose request had stopped one step earlier (or failed) is ignored."""
        if step.resolved:
            return []
        tokens = step.copy.values()
        step.resolved = True
        if self.inflight is step:
            self.inflight = None
        done = []
        for seq, token, closing in zip(step.seqs, tokens, step.closing):
            if closing:
                done.append(self._closed_result(seq, token))
            elif seq.request is not None:
                done += self._emit_late(seq, token)
        return done

    def _emit_late(self, seq: _Seq, token: int) -> list[GenerationResult]:
        """Appends a token read back one step late; a stop token finishes the request, its
        pending token (the stop token, launched again) dropped first."""
        res = seq.result
        res.output.append(token)
        self.stats.generated_tokens += 1
        res.approximate |= seq.req.approximate
        if seq.params.stop_token is None or token != seq.params.stop_token:
            return []
        if seq.req.num_draft:
            self.scheduler.cache.drop_pending(seq.req)
            self.stats.late_stop_tokens += 1
        res.finish_reason = "stop"
        self.scheduler.finish(seq)
        return [res]

    def _closed_result(self, seq: _Seq, token: int) -> GenerationResult:
        """The result of a request closed at its launch, with its last token."""
        res = seq.result
        res.output.append(token)
        self.stats.generated_tokens += 1
        stop = seq.params.stop_token
        res.finish_reason = "stop" if stop is not None and token == stop else "length"
        return res

    def _commit(self, step: InFlightStep) -> None:
        """Gives every row's pending token its value (its output's last token, now on the
        host), then closes the requests whose token in ``step`` is their last: finished in the
        cache now, which never holds that token, as without overlap."""
        for row, seq in enumerate(step.seqs):
            if seq.request is None:  # stopped one step earlier: its row is ignored
                continue
            changes = self.scheduler.cache.resolve_pending(seq.req, seq.result.output[-1])
            self.model_runner.note(changes.deltas)
            if len(seq.result.output) + 1 >= seq.params.max_new_tokens:
                seq.result.approximate |= seq.req.approximate
                self.scheduler.finish(seq)
                step.closing[row] = True

    def _failed_launch(
        self, batch: list[_Seq], prev: InFlightStep | None, exc: Exception
    ) -> list[GenerationResult]:
        """``batch``'s launch raised ``exc``: the step in flight is resolved first (its tokens,
        and its stops, as without overlap), then the requests of ``batch`` still running fail
        (`Emission.isolated`: their pending tokens are freed with them)."""
        self.inflight = None
        done = self._resolve(prev) if prev is not None else []
        running = [s for s in batch if s.request is not None]
        with self.emission.isolated(running, FailureStage.DECODE):
            raise exc
        return done
