"""Speculative decoding as a decode strategy: `SpeculativeDecoder` gets the model runner (for
the hidden states MTP drafts start from) and answers two questions of the runner's loop, what
to verify (`propose`) and, given the verify forward's output, what to emit and what to roll
back (`judge`, a `Verdict`); the loop applies them. The draft sources live in `drafts`
(re-exported here).

One verify step per decoding request (docs/speculative.md)::

    propose: source.propose(...)                  k tokens after the pending token
    loop:    extend_draft_batch(requests, [pending, d1..dk])   T = k + 1 tokens, private pages
    loop:    one target forward over all T rows (`ModelRunner.execute`): logits of every row
    judge:   greedy: the longest prefix with d_i == argmax(row i-1), plus the target's token
             T > 0:  rejection sampling (`rejection`): d_i kept with probability min(1, p/q),
             then a residual or bonus sample; cut at max_new_tokens / the stop token
    loop:    rollback(request, T - emitted), in reverse batch order; emit

so the cache holds exactly ``prompt + output[:-1]`` afterwards, as without speculation, and the
output is the target's greedy output (or a sample of the target's distribution) whatever the
draft proposes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from adapters.engine.batch import ScheduledBatch
from adapters.engine.drafts import (
    DraftBatch,
    DraftContext,
    DraftError,
    DraftSource,
    MTPDraft,
    OracleDraft,
    SampledDraft,
    device_source,
)
from adapters.engine.model_runner import ForwardOutput, ModelRunner
from adapters.engine.rejection import accept_sampled
from adapters.engine.sequence import _Seq
from adapters.forward.graph_verify import GraphVerifier
from shadowradix import PageTableDelta, ShadowRadixCache

__all__ = [
    "DraftBatch",
    "DraftContext",
    "DraftError",
    "DraftSource",
    "MTPDraft",
    "OracleDraft",
    "Proposal",
    "SampledDraft",
    "SpecStats",
    "SpeculativeDecoder",
    "Verdict",
    "accept_greedy",
    "cut_emission",
]


@dataclass
class SpecStats:
    """Counts of the verify steps. A request-step verifies one request once."""

    forwards: int = 0
    request_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0  # drafts the target agreed with
    emitted_tokens: int = 0  # accepted drafts + the target's token, after max_new / stop cuts
    draft_s: float = 0.0
    device_steps: int = 0  # verify steps whose drafts stayed on the device (one host read)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per request-step (1 = every draft rejected)."""
        return self.emitted_tokens / self.request_steps if self.request_steps else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.emitted_tokens / self.forwards if self.forwards else 0.0


def accept_greedy(drafts: Sequence[Sequence[int]], targets: Sequence[Sequence[int]]):
    """Per request: the longest prefix of its draft that agrees with the target's greedy
    tokens (``targets[i][j]``: argmax of row ``j``, the token after row ``j``'s token), then
    the target's token after it. Returns ``(emitted tokens, accepted draft count)`` lists."""
    emitted, accepted = [], []
    for d, t in zip(drafts, targets):
        a = 0
        while a < len(d) and d[a] == t[a]:
            a += 1
        emitted.append(list(d[:a]) + [t[a]])
        accepted.append(a)
    return emitted, accepted


def cut_emission(tokens: list[int], room: int, stop_token: int | None) -> list[int]:
    """``tokens`` cut to ``room`` (max_new_tokens left) and just after a stop token."""
    tokens = tokens[:room]
    if stop_token is not None and stop_token in tokens:
        tokens = tokens[: tokens.index(stop_token) + 1]
    return tokens


@dataclass(frozen=True)
class Proposal:
    """What a verify step computes: per request (in ``seqs`` order) its pending token and its
    ``k`` drafts (``chunks``), and the distributions the drafts were sampled from ``(B, k, V)``
    (``probs``; ``None``: a deterministic source). ``device``: the drafts ``(B, k)`` on the
    device, never read back before the verify step; the chunks' drafts are then
    `PLACEHOLDER` (the cache's extend needs only their count)."""

    seqs: tuple[_Seq, ...]
    chunks: tuple[list[int], ...]
    probs: torch.Tensor | None
    device: torch.Tensor | None = None

    def rows_for(self, seqs: Sequence[_Seq], rows: torch.Tensor) -> torch.Tensor:
        """``rows`` (one per proposed request, in ``self.seqs`` order) cut to ``seqs``: the
        proposed requests that the extend did not preempt, in their order. ``rows`` itself
        where that is all of them in order (no copy); otherwise a gather on ``rows``' device.
        Raises `KeyError` for a request the proposal does not hold."""
        if len(seqs) == len(self.seqs) and all(a is b for a, b in zip(seqs, self.seqs)):
            return rows
        index = {id(s): i for i, s in enumerate(self.seqs)}
        keep = torch.tensor([index[id(s)] for s in seqs], dtype=torch.long)
        return rows[keep.to(rows.device)]


@dataclass(frozen=True)
class Verdict:
    """What a verify step's output means, per request of its batch: the tokens to emit
    (accepted drafts, then the target's token, cut at max_new_tokens / the stop token), how
    many of its verified tokens to roll back, and the main hidden state at its last kept row
    (``hidden[i]``; ``None``: no MTP state is kept). ``tokens``: the verified chunks' true
    values, where the cache holds placeholders (device drafts; `settle` writes them)."""

    emitted: tuple[list[int], ...]
    rollback: tuple[int, ...]
    hidden: torch.Tensor | None = None
    tokens: tuple[list[int], ...] | None = None


#: the value a device draft holds in the host's chunks and the cache until the step's one host
#: read (`ShadowRadixCache.resolve_draft`); nothing reads it: the verify step's input is the
#: device copy, and draft positions are private until the rollback commits them
PLACEHOLDER = 0


class SpeculativeDecoder:
    """The decode strategy of ``Runner(speculative_tokens=k)``: ``num_tokens`` drafts per
    request from ``draft``, bound to ``context``; ``model_runner`` gives the hidden states."""

    def __init__(
        self,
        model_runner: ModelRunner,
        num_tokens: int,
        draft: DraftSource,
        context: DraftContext,
    ) -> None:
        self.model_runner, self.num_tokens, self.draft = model_runner, num_tokens, draft
        self.stats = SpecStats()
        #: greedy batches keep their drafts on the device where the source and the verifier
        #: can (one host read per step); False: the host path (drafts read back before verify)
        self.device_drafts = True
        self._device_source = device_source(draft)
        self._vocab = context.weights.config.vocab_size
        #: page-table deltas not yet seen by the draft source's device tables
        self._undrafted: list[PageTableDelta] = []
        draft.bind(context)

    @property
    def verifier(self) -> GraphVerifier | None:
        """The model runner's graph verifier (None: verify steps run the paged forward)."""
        return self.model_runner.verifier

    def note(self, deltas: Sequence[PageTableDelta]) -> None:
        """Keeps table changes for the draft source (`DraftBatch.deltas`)."""
        self._undrafted += deltas

    def on_device(self, seqs: Sequence[_Seq]) -> bool:
        """Whether ``seqs``' drafts stay on the device: every request greedy, a source with a
        device path, the graph verifier, and `device_drafts` on."""
        return (
            self.device_drafts
            and self._device_source is not None
            and self.verifier is not None
            and all(s.sampler.greedy for s in seqs)
        )

    def propose(self, seqs: list[_Seq]) -> Proposal:
        """The drafts of ``seqs`` (each with exactly one pending token), checked: `DraftError`
        for a source that breaks its contract, before the cache is touched. On the device path
        (`on_device`) the drafts are queued on the device and not read (argmax ids: in range
        by construction); the chunks hold `PLACEHOLDER`."""
        t0 = time.perf_counter()
        batch = self._batch(seqs)
        if self.on_device(seqs):
            assert self._device_source is not None
            device = self._device_source.propose_device(batch)
            self.stats.draft_s += time.perf_counter() - t0
            fill = [PLACEHOLDER] * self.num_tokens
            chunks = tuple([s.result.output[-1], *fill] for s in seqs)
            return Proposal(tuple(seqs), chunks, None, device)
        proposal = self.draft.propose(batch)
        drafts, probs = proposal, None
        if isinstance(proposal, SampledDraft):
            drafts, probs = proposal.tokens, proposal.probs
            self._check_probs(probs, len(seqs))
        checked = self._check(drafts, len(seqs))
        self.stats.draft_s += time.perf_counter() - t0
        chunks = tuple([s.result.output[-1]] + d for s, d in zip(seqs, checked))
        return Proposal(tuple(seqs), chunks, probs)

    def _batch(self, seqs: list[_Seq]) -> DraftBatch:
        hidden = None
        if self.draft.uses_mtp:
            hidden = torch.stack([self.model_runner.hidden_of(s) for s in seqs])
        k = self.num_tokens
        uniforms = torch.stack(
            [torch.zeros(k, dtype=torch.float64) if s.sampler.greedy else s.sampler.uniforms(k)
             for s in seqs]
        )  # fmt: skip
        batch = DraftBatch(
            tuple(s.req for s in seqs),
            tuple(s.result.prompt for s in seqs),
            tuple(s.result.output for s in seqs),
            hidden,
            k,
            tuple(self._undrafted),
            tuple(float(s.params.temperature) for s in seqs),
            uniforms,
        )
        self._undrafted = []
        return batch

    def device_drafts_of(self, batch: ScheduledBatch, proposal: Proposal) -> torch.Tensor | None:
        """The device drafts of ``batch``'s requests (the proposal's that the extend did not
        preempt), or None on the host path."""
        dev = proposal.device
        return None if dev is None else proposal.rows_for(batch.seqs, dev)

    def _check_probs(self, probs: object, batch: int) -> None:
        shape = (batch, self.num_tokens, self._vocab)
        if not isinstance(probs, torch.Tensor) or tuple(probs.shape) != shape:
            raise DraftError(f"SampledDraft.probs must be a tensor of shape {shape}")

    def _check(self, drafts: object, batch: int) -> list[list[int]]:
        k, vocab = self.num_tokens, self._vocab
        if not isinstance(drafts, list) or len(drafts) != batch:
            raise DraftError(f"the draft source must return {batch} drafts, got {drafts!r:.80}")
        for d in drafts:
            if not isinstance(d, list) or len(d) != k:
                raise DraftError(f"every draft must be a list of {k} token ids, got {d!r:.80}")
            if any(type(t) is not int or not 0 <= t < vocab for t in d):
                raise DraftError(f"draft tokens must be ints in [0, {vocab}), got {d!r:.80}")
        return drafts

    def judge(self, batch: ScheduledBatch, output: ForwardOutput, proposal: Proposal) -> Verdict:
        """Accepts (greedy or by rejection sampling), cuts at max_new_tokens / stop tokens and
        says what to roll back, for the requests of ``batch`` (those of ``proposal`` that the
        extend did not preempt). Counts the step (`SpecStats`); changes nothing else."""
        seqs, t = batch.seqs, self.num_tokens + 1
        rows = output.logits.view(len(seqs), t, -1)
        tokens = None
        if proposal.device is not None:  # the step's one host read: drafts and argmax
            drafts_dev = self.device_drafts_of(batch, proposal)
            assert drafts_dev is not None
            packed = torch.cat((drafts_dev, rows.argmax(dim=-1)), dim=1).tolist()
            drafts = [r[: t - 1] for r in packed]
            emitted, accepted = accept_greedy(drafts, [r[t - 1 :] for r in packed])
            tokens = tuple([c[0], *d] for c, d in zip(batch.chunks, drafts))
            self.stats.device_steps += 1
        else:
            emitted, accepted = self._host_accept(batch, rows, proposal)
        emitted = [
            cut_emission(e, s.params.max_new_tokens - len(s.result.output), s.params.stop_token)
            for s, e in zip(seqs, emitted)
        ]
        kept = None
        if output.hidden is not None:  # copies: graph outputs are reused
            last = [i * t + len(e) - 1 for i, e in enumerate(emitted)]
            kept = output.hidden[torch.tensor(last, device=output.hidden.device)]
        self._count(len(seqs), emitted, accepted)
        return Verdict(tuple(emitted), tuple(t - len(e) for e in emitted), kept, tokens)

    def _host_accept(self, batch: ScheduledBatch, rows: torch.Tensor, proposal: Proposal):
        """The host path's acceptance: the chunks hold the drafts' values."""
        probs = proposal.probs
        if probs is not None:  # the extend may have preempted some of the proposal's requests
            probs = proposal.rows_for(batch.seqs, probs)
        drafts = [c[1:] for c in batch.chunks]
        return self._accept(list(batch.seqs), drafts, rows, probs)

    def settle(
        self, cache: ShadowRadixCache, batch: ScheduledBatch, verdict: Verdict
    ) -> list[PageTableDelta]:
        """Applies ``verdict`` to the cache: the true draft values where it held placeholders,
        then each request's rollback in reverse batch order (a full rejection restores the free
        stacks exactly); keeps the hidden states. Returns the rollbacks' deltas, in order."""
        if verdict.tokens is not None:
            for seq, chunk in zip(batch.seqs, verdict.tokens):
                cache.resolve_draft(seq.req, chunk)
        deltas: list[PageTableDelta] = []
        for seq, n in reversed(list(zip(batch.seqs, verdict.rollback))):
            deltas += cache.rollback(seq.req, n).deltas
        if verdict.hidden is not None:
            for seq, h in zip(batch.seqs, verdict.hidden):
                seq.hidden = (seq.req, h)
        return deltas

    def _accept(self, seqs: list[_Seq], drafts: list[list[int]], logits: torch.Tensor, probs):
        """Greedy requests keep the drafts equal to the target's argmax (`accept_greedy`);
        temperature requests go through rejection sampling (`rejection.accept_sampled`) against
        the draft's distributions ``probs`` (``None``: one-hot)."""
        emitted, accepted = accept_greedy(drafts, logits.argmax(dim=-1).tolist())
        sampled = [i for i, s in enumerate(seqs) if not s.sampler.greedy]
        if sampled:
            rows = logits[torch.tensor(sampled, device=logits.device)]
            q = None if probs is None else probs[torch.tensor(sampled)]
            e, a = accept_sampled(
                [seqs[i].sampler for i in sampled], [drafts[i] for i in sampled], rows, q
            )
            for i, ei, ai in zip(sampled, e, a):
                emitted[i], accepted[i] = ei, ai
        return emitted, accepted

    def _count(self, batch: int, emitted: list[list[int]], accepted: list[int]) -> None:
        st = self.stats
        st.forwards += 1
        st.request_steps += batch
        st.drafted_tokens += self.num_tokens * batch
        st.accepted_tokens += sum(min(a, len(e)) for a, e in zip(accepted, emitted))
        st.emitted_tokens += sum(len(e) for e in emitted)
