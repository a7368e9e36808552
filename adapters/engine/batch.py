"""What the scheduler hands the model runner: one forward's requests, their chunks and the
core's step plan (`ScheduledBatch`). Torch-free, frozen: the scheduler decides it once, the
model runner executes it, emission reads it back; nobody changes it on the way."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from adapters.engine.sequence import _Seq
from shadowradix import Allocation, PageTableDelta, ReadPlan, StepPlan


class BatchKind(Enum):
    """Which forward a batch is."""

    #: window rebuilds of replayed hits (bounded replay): no logits are read
    REPLAY = "replay"
    #: prompt chunks (chunked prefill): logits of each finishing prompt's last row, or of
    #: every row for prompt logprobs
    PREFILL = "prefill"
    #: one token per decoding request
    DECODE = "decode"
    #: the pending token and ``k`` drafts per request (speculative decoding): every row's
    #: logits
    VERIFY = "verify"


@dataclass(frozen=True)
class ScheduledBatch:
    """One forward. ``seqs[i]`` computes ``chunks[i]``, at the positions ``plan`` (the core's
    `Allocation` for the chunks, or the merged slices of a replay) gives. ``logit_rows``: the
    flat rows whose logits the batch needs, ``spans[i]`` those of request ``i`` (in order).
    ``read_plans``: the windows a replay reads (``None``: each request's own from its chunk's
    start). ``last[i]``: request ``i``'s prompt ends with this chunk (its first output token
    is sampled from its last row)."""

    kind: BatchKind
    seqs: tuple[_Seq, ...]
    chunks: tuple[list[int], ...]
    plan: Allocation
    logit_rows: tuple[int, ...] = ()
    spans: tuple[range, ...] = ()
    read_plans: tuple[ReadPlan, ...] | None = None
    last: tuple[bool, ...] = ()

    @property
    def deltas(self) -> tuple[PageTableDelta, ...]:
        """The page-table changes of the batch's extend (a replay's plan changes no table)."""
        return self.plan.deltas if isinstance(self.plan, StepPlan) else ()

    @property
    def num_tokens(self) -> int:
        """Tokens this forward computes."""
        return sum(len(c) for c in self.chunks)

    @property
    def ready(self) -> list[int]:
        """The requests whose prompt this prefill finishes (a first token to sample)."""
        return [i for i, is_last in enumerate(self.last) if is_last]


def with_logit_rows(batch: ScheduledBatch) -> ScheduledBatch:
    """``batch`` with the rows whose logits it needs, just after its extend: a prefill request
    its whole chunk for prompt logprobs, else its last row if its prompt ends in this chunk;
    a decode request its row; a verify request every row; a replay none."""
    if batch.kind is BatchKind.REPLAY:
        return batch
    spans, end = [], 0
    last = [len(s.req.prompt_remaining) == 0 for s in batch.seqs]
    for seq, chunk, is_last in zip(batch.seqs, batch.chunks, last):
        start, end = end, end + len(chunk)
        if batch.kind is BatchKind.PREFILL and not seq.params.prompt_logprobs:
            start = end - 1 if is_last else end
        spans.append(range(start, end))
    rows = tuple(r for span in spans for r in span)
    return replace(batch, logit_rows=rows, spans=tuple(spans), last=tuple(last))


def with_every_row(batch: ScheduledBatch) -> ScheduledBatch:
    """`with_logit_rows`, but a prefill asks for every row of every chunk (a benchmark that
    scores each computed position: `Scheduler.logit_rows`)."""
    batch = with_logit_rows(batch)
    if batch.kind is not BatchKind.PREFILL:
        return batch
    ends = [sum(len(c) for c in batch.chunks[: i + 1]) for i in range(len(batch.chunks))]
    spans = tuple(range(end - len(c), end) for c, end in zip(batch.chunks, ends))
    return replace(batch, logit_rows=tuple(range(batch.num_tokens)), spans=spans)
