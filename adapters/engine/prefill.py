"""The prefill step, a role of `Runner`: pending window rebuilds of replayed hits first, then
the prompt chunks of running requests, within the step's token budget, the memory budget and
the HiSparse device buffer; prompt logprobs and tail-only bookkeeping of each forward."""

from __future__ import annotations

import torch

from adapters.engine.admission import Admission
from adapters.engine.emission import Emission
from adapters.engine.forward import Forward
from adapters.engine.sequence import FailureStage, GenerationResult, _Seq
from adapters.forward.memory_plan import visible_entries
from adapters.forward.replay import replay_step


class Prefill(Admission, Forward, Emission):
    """The runner's prefill forward of one step."""

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
        with self._isolated(seqs, FailureStage.PREFILL):
            plans = [self.cache.read_plan(s.req) for s in seqs]  # window [replay_start, prefix)
            self._forward(seqs, chunks, replay_step(parts), [], plans)
            for seq, (alloc, _, hi) in zip(seqs, parts):
                seq.replay_at = hi if hi < alloc.ends[0] else None
        replayed = self.chunk_tokens - budget  # of the step's budget, even if the forward failed
        self.stats.replayed_tokens += replayed
        return replayed

    def _prefill(self) -> list[GenerationResult]:
        """One prefill forward over the chunks that fit this step (after pending replays);
        returns the requests it finished. A forward that raises fails its requests only
        (`Emission._isolated`)."""
        seqs, chunks = self._prefill_chunks(self.chunk_tokens - self._replay())
        if not seqs:
            return []
        with self._isolated(seqs, FailureStage.PREFILL):
            return self._run_prefill(seqs, chunks)
        return []

    def _prefill_chunks(self, budget: int) -> tuple[list[_Seq], list[list[int]]]:
        """The prefilling requests of this step and their chunks, within ``budget`` tokens, the
        memory budget and the HiSparse buffer."""
        seqs, chunks = [], []
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
        return seqs, chunks

    def _run_prefill(self, seqs: list[_Seq], chunks: list[list[int]]) -> list[GenerationResult]:
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
