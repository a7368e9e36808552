"""Postprocess: what a forward's output does to its requests. Sampling a batch of logits rows,
appending each token, finishing the requests that reach their stop token or
``max_new_tokens``; after a prefill forward, prompt logprobs, tail-only bookkeeping and the
publication of every chunk; and finishing with an error the requests of a forward that raised
(failure isolation). Requests leave the running set through the scheduler (`Scheduler.finish`,
`Scheduler.release`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from adapters.engine.batch import ScheduledBatch
from adapters.engine.drafts import DraftError
from adapters.engine.runner_stats import RunnerStats
from adapters.engine.sampling import sample_batch
from adapters.engine.scheduler import Scheduler
from adapters.engine.sequence import FailureStage, GenerationResult, RequestFailure, _Seq

#: raised through `Emission.isolated` unchanged: an internal invariant broken (the cache's
#: `InvariantError` too), and a draft source that broke its contract (the caller's bug, found
#: before the cache is touched: it would fail every step)
_PROPAGATED = (AssertionError, DraftError)

#: `Runner.on_logits`: called with the results and the logits rows of every sampling step
LogitsHook = Callable[[list[GenerationResult], torch.Tensor], None]


class Emission:
    """Sampling and finishing of the scheduler's running requests. ``tail_only`` with the
    model's ``window``: prefill forwards skip tokens (bookkeeping); ``on_logits``: see
    `Runner`."""

    def __init__(
        self, scheduler: Scheduler, stats: RunnerStats, *, tail_only: bool, window: int
    ) -> None:
        self.scheduler, self.stats = scheduler, stats
        self.tail_only, self.window = tail_only, window
        self.on_logits: LogitsHook | None = None
        #: results finished outside the forward that returns them (an isolated failure, a step
        #: in flight read back early for a preemption), returned by the step they happened in
        self.salvaged: list[GenerationResult] = []

    def emit_all(self, seqs: Sequence[_Seq], logits: torch.Tensor) -> list[GenerationResult]:
        """Samples one token per row of ``logits`` for ``seqs`` and emits it."""
        if not seqs:
            return []
        if self.on_logits is not None:
            self.on_logits([s.result for s in seqs], logits)
        tokens = sample_batch([s.sampler for s in seqs], logits)
        return [res for seq, tok in zip(seqs, tokens) for res in self._emit(seq, tok)]

    def emit_tokens(
        self, seqs: Sequence[_Seq], tokens: Sequence[list[int]]
    ) -> list[GenerationResult]:
        """Emits ``tokens[i]`` for ``seqs[i]`` in order (a verify step's accepted tokens)."""
        done: list[GenerationResult] = []
        for seq, emitted in zip(seqs, tokens):
            for token in emitted:
                done += self._emit(seq, token)
            # the cache holds prompt + output[:-1]: exactly one token pending
            assert seq.request is None or seq.request.length == len(seq.tokens) - 1
        return done

    def _emit(self, seq: _Seq, token: int) -> list[GenerationResult]:
        res = seq.result
        res.output.append(token)
        self.stats.generated_tokens += 1
        res.approximate |= seq.req.approximate
        if seq.params.stop_token is not None and token == seq.params.stop_token:
            res.finish_reason = "stop"
        elif len(res.output) >= seq.params.max_new_tokens:
            res.finish_reason = "length"
        else:
            return []
        if seq.topk is not None:  # capture_topk: what the request computed, at its end
            res.topk = seq.topk.capture(seq.tokens)
        self.scheduler.finish(seq)
        return [res]

    def prefill_done(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[GenerationResult]:
        """After a prefill forward: counts, prompt logprobs, every chunk published
        (`cache_unfinished`), then the first token of each prompt it finished."""
        seqs, chunks = list(batch.seqs), list(batch.chunks)
        self.stats.prefill_tokens += batch.num_tokens
        if self.tail_only:
            self._count_tail(seqs, chunks)
        blocks = torch.split(logits, [len(span) for span in batch.spans])
        for seq, start, block in zip(seqs, batch.plan.starts, blocks):
            if seq.params.prompt_logprobs:
                _record_prompt_logprobs(seq.result, start, block)
        for seq in seqs:
            # After every chunk, as SGLang does: the chunk's pages enter the tree with their
            # live SWA, so a later prompt branching anywhere inside this one still finds a
            # window (SWA eviction tombstones node heads before tails when SWA runs short).
            self.scheduler.cache.cache_unfinished(seq.req)
        ready = batch.ready
        if not ready:
            return []
        return self.emit_all([seqs[i] for i in ready], torch.cat([blocks[i][-1:] for i in ready]))

    def _count_tail(self, seqs: list[_Seq], chunks: list[list[int]]) -> None:
        """Tail-only bookkeeping of one prefill forward: skipped tokens, approximate results
        (the seam tests wrap: `Runner._count_tail`)."""
        skipped = [max(0, len(c) - self.window) for c in chunks]
        for seq, n in zip(seqs, skipped):
            seq.result.approximate |= n > 0
        self.stats.tail_skipped_tokens += sum(skipped)
        self.stats.tail_only_forwards += any(skipped)

    @contextmanager
    def isolated(self, seqs: Sequence[_Seq], stage: FailureStage) -> Iterator[None]:
        """Runs a step's forward over ``seqs`` (extend, forward, emission) so that an exception
        raised inside fails only them: each of ``seqs`` still running is finished with
        ``finish_reason="error"`` and its `RequestFailure`, its cache request aborted (what it
        had published stays cached; what this forward allocated is freed), and the exception
        is not raised further. Results the block had already finished, and the failed ones, are
        kept for `take_salvaged`; requests it preempted stay queued.

        `_PROPAGATED` errors and anything that is not an `Exception` (Ctrl-C) are raised
        unchanged."""
        try:
            yield
        except _PROPAGATED:
            raise
        except Exception as exc:
            failure = RequestFailure(stage, exc)
            for seq in seqs:
                if seq.request is not None:
                    self._fail(seq, failure)
                elif seq.result.finish_reason is not None:  # finished before the raise
                    self.salvaged.append(seq.result)

    def _fail(self, seq: _Seq, failure: RequestFailure) -> None:
        """Finishes the running ``seq`` with ``failure``."""
        self.scheduler.release(seq)
        res = seq.result
        res.finish_reason, res.failure, res.error = "error", failure, failure.message
        self.stats.failed_requests += 1
        self.salvaged.append(res)

    def take_salvaged(self) -> list[GenerationResult]:
        """Results that isolated failures finished (or kept) since the last call."""
        out, self.salvaged = self.salvaged, []
        return out


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
