"""The decode step, a role of `Runner`: one token for every request in its decode phase (the
HiSparse buffer's fit chosen in rotation), through the speculative decoder, the graph decoder
or the paged forward."""

from __future__ import annotations

import time

import torch

from .admission import Admission
from .emission import Emission
from .forward import Forward
from .sequence import FailureStage, GenerationResult, _Seq


class Decode(Admission, Forward, Emission):
    """The runner's decode forward of one step."""

    def _decode(self) -> list[GenerationResult]:
        seqs = [s for s in self._running if s.decoding and s.result.finish_reason is None]
        seqs = [s for s in seqs if s.req.length == s.num_tokens - 1]  # one token pending
        if self.offload is not None:
            seqs = self._fit_decode_batch(seqs)
        if not seqs:
            return []
        with self._isolated(seqs, FailureStage.DECODE):  # a raise fails these requests only
            return self._run_decode(seqs)
        return []

    def _run_decode(self, seqs: list[_Seq]) -> list[GenerationResult]:
        if self.spec is not None:
            return self.spec.decode(self, seqs)
        chunks = [[s.result.output[-1]] for s in seqs]
        seqs, chunks, alloc = self._extend(seqs, chunks)
        if alloc is None:
            return []
        if self.decoder is None:
            logits = self._forward(seqs, chunks, alloc, list(range(len(seqs))))
        else:
            logits = self._graph_forward(seqs, [c[0] for c in chunks], alloc.deltas)
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

    def _graph_forward(self, seqs: list[_Seq], tokens: list[int], deltas) -> torch.Tensor:
        assert self.decoder is not None
        t0 = time.perf_counter()
        logits = self.decoder.step([s.req for s in seqs], tokens, deltas)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats.forward_s += time.perf_counter() - t0
        return logits
