"""Result emission, a role of `Runner`: sampling a batch of logits rows, appending each token
and finishing the requests that reach their stop token or ``max_new_tokens``."""

from __future__ import annotations

import torch

from .runner_base import RunnerBase
from .sampling import sample_batch
from .sequence import GenerationResult, _Seq


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
