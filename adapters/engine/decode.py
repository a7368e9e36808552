"""The decode step, a role of `Runner`: one token for every request in its decode phase (the
HiSparse buffer's fit chosen in rotation), through the speculative decoder, the graph decoder
or the paged forward; overlapped with the next step's scheduling where it can be (`overlap`),
serialised (ending in a device synchronisation) otherwise."""

from __future__ import annotations

import time

import torch

from adapters.engine.overlap import Overlap
from adapters.engine.sequence import FailureStage, GenerationResult, _Seq


class Decode(Overlap):
    """The runner's decode forward of one step."""

    def _decode(self) -> list[GenerationResult]:
        seqs = self._decode_candidates()
        if self.overlap and seqs and self._overlappable(seqs):
            return self._decode_overlapped(seqs)
        done = self._settle_inflight()  # a serialised step reads the step in flight first
        if done or self.overlap:
            seqs = self._decode_candidates()
        if self.offload is not None:
            seqs = self._fit_decode_batch(seqs)
        if not seqs:
            return done
        self.stats.serialised_steps += self.overlap
        with self._isolated(seqs, FailureStage.DECODE):  # a raise fails these requests only
            done += self._run_decode(seqs)
        return done

    def _decode_candidates(self) -> list[_Seq]:
        """The decoding requests with one token to compute: sampled and not yet extended, or
        (overlap) still on the device, in the step in flight."""
        step, out = self._inflight, []
        for s in self._running:
            if not s.decoding or s.result.finish_reason is not None:
                continue
            behind = s.num_tokens - s.req.length
            if behind == 1 or (behind == 0 and step is not None and step.row_of(s) is not None):
                out.append(s)
        return out

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
            deltas = self._take_table_deltas() + list(alloc.deltas)
            logits = self._graph_forward(seqs, [c[0] for c in chunks], deltas)
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
