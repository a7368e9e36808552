"""Result emission, a role of `Runner`: sampling a batch of logits rows, appending each token,
finishing the requests that reach their stop token or ``max_new_tokens``, and finishing with an
error the requests of a forward that raised (failure isolation)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from adapters.engine.runner_base import RunnerBase
from adapters.engine.sampling import sample_batch
from adapters.engine.sequence import FailureStage, GenerationResult, RequestFailure, _Seq
from adapters.engine.speculative import DraftError

#: raised through `Emission._isolated` unchanged: an internal invariant broken (the cache's
#: `InvariantError` too), and a draft source that broke its contract (the caller's bug, found
#: before the cache is touched: it would fail every step)
_PROPAGATED = (AssertionError, DraftError)


class Emission(RunnerBase):
    """Sampling and finishing of the runner's requests."""

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
        self.stats.generated_tokens += 1
        res.approximate |= seq.req.approximate
        if seq.params.stop_token is not None and token == seq.params.stop_token:
            res.finish_reason = "stop"
        elif len(res.output) >= seq.params.max_new_tokens:
            res.finish_reason = "length"
        else:
            return []
        self._finish(seq)
        return [res]

    def _finish(self, seq: _Seq) -> None:
        """Finishes the running ``seq`` in the cache (its committed pages inserted) and takes
        it off the running set; its result is complete but for, under overlap scheduling, the
        token still in flight."""
        assert seq.request is not None
        self.cache.finish(seq.request)
        seq.request = None
        self._running.remove(seq)
        self.stats.approximate_results += seq.result.approximate

    @contextmanager
    def _isolated(self, seqs: list[_Seq], stage: FailureStage) -> Iterator[None]:
        """Runs a step's forward over ``seqs`` (extend, forward, emission) so that an exception
        raised inside fails only them: each of ``seqs`` still running is finished with
        ``finish_reason="error"`` and its `RequestFailure`, its cache request aborted (what it
        had published stays cached; what this forward allocated is freed), and the exception
        is not raised further. Results the block had already finished, and the failed ones, are
        kept for `step` to return (`_take_salvaged`); requests it preempted stay queued.

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
                    self._salvaged.append(seq.result)

    def _fail(self, seq: _Seq, failure: RequestFailure) -> None:
        """Finishes the running ``seq`` with ``failure``."""
        assert seq.request is not None
        self.cache.abort(seq.request)
        seq.request = None
        seq.replay_at = None
        self._running.remove(seq)
        res = seq.result
        res.finish_reason, res.failure, res.error = "error", failure, failure.message
        self.stats.failed_requests += 1
        self._salvaged.append(res)

    def _take_salvaged(self) -> list[GenerationResult]:
        """Results that isolated failures finished (or kept) since the last call."""
        out, self._salvaged = self._salvaged, []
        return out
