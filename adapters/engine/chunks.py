"""Chunk budgeting, the scheduler's other half: which replay slices, prompt chunks and decode
rows one step computes, within the step's ``chunk_tokens``, the memory budget and the HiSparse
device buffer. Torch-free. `StepBudget` reads the scheduler's running set and the core's
request state; it allocates nothing (`Scheduler.allocate` does) and changes nothing but each
replaying request's progress (`replayed`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from adapters.engine.batch import BatchKind, ScheduledBatch
from adapters.engine.scheduler import Scheduler
from adapters.engine.sequence import _Seq
from adapters.forward.replay import replay_step
from adapters.model.model_config import ModelConfig
from shadowradix import Allocation

if TYPE_CHECKING:
    from adapters.forward.memory_plan import PrefillBudget

#: one request's replay slice: (its replay allocation, first position, end position)
ReplaySlice = tuple[Allocation, int, int]


class StepBudget:
    """What fits one step, for ``scheduler``'s running requests."""

    def __init__(self, scheduler: Scheduler, model: ModelConfig, memory: PrefillBudget) -> None:
        self.scheduler, self.model, self.memory = scheduler, model, memory
        self.config = scheduler.config

    # -- bounded replay --------------------------------------------------------------------

    def replay_slices(self) -> tuple[list[_Seq], list[ReplaySlice]]:
        """Pending window rebuilds of replayed hits (each before its request's first chunk),
        slices of at most the step's token budget (and, with HiSparse, of the device working
        set), in running order."""
        budget, parts, seqs = self.config.chunk_tokens, [], []
        pages_left = self.config.device_pages
        for seq in self.scheduler.running:
            if seq.replay_at is None or budget == 0:
                continue
            alloc = seq.req.replay_allocation
            assert alloc is not None
            n = self.fit_tokens(seq, min(budget, alloc.ends[0] - seq.replay_at), pages_left)
            if not n:
                break
            budget -= n
            pages_left -= self.working_set(seq, n) if self.config.hisparse else 0
            parts.append((alloc, seq.replay_at, seq.replay_at + n))
            seqs.append(seq)
        return seqs, parts

    def replay_batch(self, seqs: list[_Seq], parts: list[ReplaySlice]) -> ScheduledBatch:
        """The forward of ``parts``: their slices merged into one plan (`replay.replay_step`),
        each reading its window from ``replay_start`` (the request's read plan)."""
        chunks = tuple(s.token_slice(lo, hi) for s, (_, lo, hi) in zip(seqs, parts))
        plans = tuple(self.scheduler.cache.read_plan(s.req) for s in seqs)
        plan = replay_step(parts)
        return ScheduledBatch(BatchKind.REPLAY, tuple(seqs), chunks, plan, read_plans=plans)

    @staticmethod
    def replayed(seqs: list[_Seq], parts: list[ReplaySlice]) -> None:
        """Advances each request's replay past its slice (done at the slice of its end)."""
        for seq, (alloc, _, hi) in zip(seqs, parts):
            seq.replay_at = hi if hi < alloc.ends[0] else None

    # -- prefill ---------------------------------------------------------------------------

    def prefill_chunks(self, budget: int) -> tuple[list[_Seq], list[list[int]]]:
        """The prefilling requests of this step and their chunks, within ``budget`` tokens, the
        memory budget and the HiSparse buffer."""
        seqs, chunks, most = [], [], self.config.chunk_tokens
        pages_left, entries = self.config.device_pages, 0
        for seq in self.scheduler.running:
            if seq.decoding or seq.replay_at is not None or budget == 0:
                continue
            entries += sum(seq.num_tokens // r for r in self.model.ratios)
            taken = most - budget
            want = min(budget, max(0, self.memory.step_tokens(entries, most) - taken))
            chunk = seq.req.prompt_remaining[: self.fit_tokens(seq, want, pages_left)].tolist()
            if not chunk:
                break
            budget -= len(chunk)
            pages_left -= self.working_set(seq, len(chunk)) if self.config.hisparse else 0
            seqs.append(seq)
            chunks.append(chunk)
        return seqs, chunks

    # -- decode ----------------------------------------------------------------------------

    def decode_rows(self) -> list[_Seq]:
        """The decoding requests with one token to compute: sampled and not yet extended, or
        (overlap) still on the device, in the step in flight."""
        step, out = self.scheduler.inflight, []
        for s in self.scheduler.running:
            if not s.decoding or s.result.finish_reason is not None:
                continue
            behind = s.num_tokens - s.req.length
            if behind == 1 or (behind == 0 and step is not None and step.row_of(s) is not None):
                out.append(s)
        return out

    def fit_decode_batch(self, seqs: list[_Seq]) -> list[_Seq]:
        """The decode requests whose working sets fit the HiSparse buffer this step (all of
        ``seqs`` without HiSparse, or when they all fit), in the order of ``seqs``: a request
        keeps its row of the device block tables from step to step (a new order rewrites
        every moved row whole). When not all fit, they are chosen from a rotating offset, so
        that requests left out now go first later. A step computes ``1 + spec_tokens`` tokens
        a request (a verify step's ``k + 1``); a graph step (``graph_reads``, no top-k capture
        or replay in the batch: those run paged) needs only the pages it writes."""
        if not seqs or not self.config.hisparse:
            return seqs
        tokens = 1 + self.config.spec_tokens
        if self.config.graph_reads and not any(s.params.uses_topk for s in seqs):
            needs = [written_pages(s.req.length, tokens, self._page_size) for s in seqs]
        else:
            needs = [self.working_set(seq, tokens) for seq in seqs]
        if sum(needs) <= self.config.device_pages:
            return seqs
        start = self.scheduler.clock % len(seqs)
        chosen, pages_left = set(), self.config.device_pages
        for i in [*range(start, len(seqs)), *range(start)]:
            if needs[i] <= pages_left:
                chosen.add(i)
                pages_left -= needs[i]
        return [seq for i, seq in enumerate(seqs) if i in chosen]

    # -- the HiSparse device buffer --------------------------------------------------------

    def working_set(self, seq: _Seq, num_tokens: int) -> int:
        """Upper bound of the C4 pages one request's ``num_tokens`` new tokens touch (HiSparse):
        each query reads top-k entries, the tokens write into the pages they span (a completed
        entry lands in its own page, which the reads need not cover), and no request touches
        more pages than it has."""
        p, start = self._page_size, seq.req.length
        pages = -(-(start + num_tokens) // p)
        written = written_pages(start, num_tokens, p)
        return min(num_tokens * self.config.index_topk + written, pages)

    @property
    def _page_size(self) -> int:
        return self.scheduler.cache.config.page_size

    def fit_tokens(self, seq: _Seq, wanted: int, pages_left: int) -> int:
        """How many of ``wanted`` tokens fit in the HiSparse device buffer's remaining pages."""
        if not self.config.hisparse or self.working_set(seq, wanted) <= pages_left:
            return wanted
        n = min(wanted, pages_left // self.config.index_topk)
        while n and self.working_set(seq, n) > pages_left:  # the pages the tokens write too
            n -= 1
        return n


def written_pages(start: int, num_tokens: int, page_size: int) -> int:
    """The pages tokens ``[start, start + num_tokens)`` span: where their entries land."""
    return (start + num_tokens - 1) // page_size - start // page_size + 1


def max_pages_spanned(num_tokens: int, page_size: int) -> int:
    """The most pages ``num_tokens`` consecutive tokens can span (starting a token before a
    page boundary)."""
    return (num_tokens + page_size - 2) // page_size + 1
