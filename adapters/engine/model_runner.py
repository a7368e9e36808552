"""The model runner: executes a `ScheduledBatch` on the pools and returns its logits (and, for
a verify step, every row's hidden state). No scheduling decision is taken here: which requests,
which chunks and which slots are the batch's, decided by the scheduler and the core.

Four executions, by the batch's kind and the runner's mode::

    replay, prefill      the paged forward (`forward.Forward`: paged, tail-only, MTP state)
    decode               the graph decoder (`GraphDecoder`, held; CUDA graphs on GPU), else paged
    verify               the graph verifier (`GraphVerifier`, held), else paged over every row

The graph decoder and verifier keep device page tables fed by the core's page-table deltas:
every table change of their requests that is not a step's own (a rollback, a pending token's
commit, a pool re-balance) is `note`d here and handed to the next graph step before its own."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from adapters.engine.batch import BatchKind, ScheduledBatch
from adapters.engine.forward import Forward
from adapters.engine.runner_stats import RunnerStats
from adapters.engine.sequence import _Seq
from adapters.forward.graph_decode import GraphDecoder, Tokens
from adapters.forward.graph_verify import GraphVerifier
from adapters.forward.selection import ForcedRows, TopkStep
from adapters.forward.topk_capture import TopkRecorder, indexer_layers
from adapters.memory.residency import GraphResidency
from shadowradix import PageTableDelta, StepPlan


@dataclass(frozen=True)
class ForwardOutput:
    """A batch's logits ``(len(batch.logit_rows), V)`` (a graph decode: one row per request; a
    verify: every row), and every row's main hidden state where the MTP layer is kept."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None


class ModelRunner:
    """Executes batches: ``paged`` (the paged forward), ``decoder`` (graph decode, or None: the
    paged path), ``verifier`` (graph verify steps, or None), all over the same pools."""

    def __init__(
        self,
        paged: Forward,
        decoder: GraphDecoder | None,
        verifier: GraphVerifier | None,
        stats: RunnerStats,
    ) -> None:
        self.paged, self.decoder, self.verifier, self.stats = paged, decoder, verifier, stats
        self.device = paged.device
        #: table changes not yet given to the graph decoder's / verifier's device tables
        self._deltas: list[PageTableDelta] = []

    @property
    def graph_hisparse(self) -> GraphResidency | None:
        """The graph steps' HiSparse residency (the decoder's or the verifier's), if any."""
        step = self.decoder if self.decoder is not None else self.verifier
        return None if step is None else step.hisparse

    def execute(self, batch: ScheduledBatch, drafts: torch.Tensor | None = None) -> ForwardOutput:
        """Runs ``batch`` (its requests just extended by its chunks) and returns its logits.
        ``drafts``: a verify batch's drafts on the device (`GraphVerifier.verify`; the step is
        then queued, not waited for). Raises whatever the forward raises; the pools then hold
        what it wrote so far, which the core no longer maps once the batch's requests are
        aborted."""
        if batch.kind is BatchKind.VERIFY:
            return self._verify(batch, drafts)
        seqs, chunks = list(batch.seqs), list(batch.chunks)
        topk = self._topk_step(batch)
        if batch.kind is BatchKind.DECODE and self.decoder is not None:
            if topk is None:
                deltas = self.take_deltas() + list(batch.deltas)
                return ForwardOutput(self.graph_forward(seqs, [c[0] for c in chunks], deltas))
            self.note(batch.deltas)  # run paged: the device tables learn them next graph step
        rows = list(batch.logit_rows)
        kw = {} if topk is None else {"topk": topk}
        plans = None if batch.read_plans is None else list(batch.read_plans)
        logits = self.paged._forward(seqs, chunks, batch.plan, rows, plans, **kw)
        if topk is not None and batch.kind is not BatchKind.REPLAY:
            self._record_topk(batch, topk)
        return ForwardOutput(logits)

    def _topk_step(self, batch: ScheduledBatch) -> TopkStep | None:
        """The forward's forced rows (replaying requests' captured selections at their
        positions), or None when no request of the batch captures or replays."""
        if not any(s.params.uses_topk for s in batch.seqs):
            return None
        model, positions = self.paged.model, np.asarray(batch.plan.arrays.positions)
        sizes = [len(c) for c in batch.chunks]
        replays = [(s.params.replay_topk, o, n) for s, o, n in zip(batch.seqs, _offsets(sizes),
                   sizes) if s.params.replay_topk is not None]  # fmt: skip
        step = TopkStep()
        if not replays:
            return step
        n, k = len(positions), model.index_topk
        for layer in indexer_layers(model):
            rows, valid = np.zeros(n, bool), np.zeros((n, k), bool)
            entries = np.zeros((n, k), np.int64)
            for capture, lo, size in replays:
                part = slice(lo, lo + size)
                entries[part], valid[part] = capture.forced(layer, positions[part])
                rows[part] = True
            dev = self.device
            step.forced[layer] = ForcedRows(
                torch.from_numpy(rows).to(dev), torch.from_numpy(entries).to(dev),
                torch.from_numpy(valid).to(dev),
            )  # fmt: skip
        return step

    def _record_topk(self, batch: ScheduledBatch, topk: TopkStep) -> None:
        """Each capturing request's rows of the step's selections, to its recorder (host)."""
        positions = np.asarray(batch.plan.arrays.positions)
        sizes = [len(c) for c in batch.chunks]
        host = {i: (s.entries.cpu().numpy(), s.valid.cpu().numpy()) for i, s in
                topk.selected.items()}  # fmt: skip
        for seq, lo, size in zip(batch.seqs, _offsets(sizes), sizes):
            if not seq.params.capture_topk:
                continue
            if seq.topk is None:
                seq.topk = TopkRecorder(self.paged.model)
            part = slice(lo, lo + size)
            for layer, (entries, valid) in host.items():
                seq.topk.add(layer, positions[part], entries[part], valid[part])

    def graph_forward(self, seqs: list[_Seq], tokens: list[int], deltas) -> torch.Tensor:
        """One serialised graph decode step (synchronised, timed); the seam tests wrap
        (`Runner._graph_forward`)."""
        assert self.decoder is not None
        t0 = time.perf_counter()
        logits = self.decoder.step([s.req for s in seqs], tokens, deltas)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats.forward_s += time.perf_counter() - t0
        return logits

    def launch(self, seqs: list[_Seq], tokens: Tokens, plan: StepPlan) -> torch.Tensor:
        """Queues a graph decode step of ``seqs`` (overlap scheduling: no synchronisation);
        returns its logits, on the device, computed once the device gets there."""
        assert self.decoder is not None
        deltas = self.take_deltas() + list(plan.deltas)
        return self.decoder.step([s.req for s in seqs], tokens, deltas)

    def _verify(self, batch: ScheduledBatch, drafts: torch.Tensor | None) -> ForwardOutput:
        """Logits ``(B*T, V)`` of every row, and the rows' hidden states when MTP is kept."""
        if drafts is not None and self.verifier is None:
            raise ValueError("device drafts need the graph verifier")
        seqs, chunks = list(batch.seqs), list(batch.chunks)
        mtp = self.paged.mtp
        if self.verifier is None:
            logits = self.paged._forward(seqs, chunks, batch.plan, list(batch.logit_rows))
            return ForwardOutput(logits, self.paged.step_hidden if mtp else None)
        t0 = time.perf_counter()
        prev = torch.stack([self.hidden_of(s) for s in seqs]) if mtp else None
        deltas = self.take_deltas() + list(batch.deltas)
        reqs = [s.req for s in seqs]
        logits, hidden = self.verifier.verify(reqs, chunks, prev, deltas=deltas, drafts=drafts)
        if self.device.type == "cuda" and drafts is None:  # pragma: no cover - needs a GPU
            torch.cuda.synchronize(self.device)
        self.stats.forward_s += time.perf_counter() - t0
        return ForwardOutput(logits, hidden if mtp else None)

    def hidden_of(self, seq: _Seq) -> torch.Tensor:
        """The main hidden state at ``seq``'s last committed position (MTP drafts)."""
        return self.paged.hidden_of(seq)

    def note(self, deltas: Iterable[PageTableDelta]) -> None:
        """Keeps table changes for the next graph step (nothing without device tables)."""
        if self.decoder is not None or self.verifier is not None:
            self._deltas += deltas

    def take_deltas(self) -> list[PageTableDelta]:
        """The table changes noted since the last graph step."""
        out, self._deltas = self._deltas, []
        return out


def _offsets(sizes: list[int]) -> list[int]:
    """The flat row where each request's chunk starts."""
    return np.cumsum([0] + sizes[:-1]).tolist()
