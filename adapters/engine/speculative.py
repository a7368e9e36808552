"""Speculative decoding in the runner: verification (greedy, or rejection sampling at
temperature > 0) and cache rollback. The draft sources live in `drafts` (re-exported here).

One verify step per decoding request (docs/speculative.md)::

    draft  = source.propose(...)                       k tokens after the pending token
    extend_draft_batch(requests, [pending, d1..dk])    T = k + 1 tokens, private pages
    one target forward over all T rows                 logits of every row
    greedy: the longest prefix with d_i == argmax(row i-1), plus the target's next token
    T > 0:  rejection sampling (`rejection`): d_i kept with probability min(1, p/q), then a
            residual or bonus sample
    cut at max_new_tokens / the stop token; rollback(request, T - emitted)

so the cache holds exactly ``prompt + output[:-1]`` afterwards, as without speculation, and the
output is the target's greedy output (or a sample of the target's distribution) whatever the
draft proposes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from adapters.engine.drafts import (
    DraftBatch,
    DraftContext,
    DraftError,
    DraftSource,
    MTPDraft,
    OracleDraft,
    SampledDraft,
)
from adapters.engine.rejection import accept_sampled
from adapters.engine.runner_stats import RunnerStats
from adapters.engine.sequence import GenerationResult, _Seq
from adapters.forward.graph_verify import GraphVerifier
from adapters.memory.pools import KVPools
from adapters.model.model_config import ModelConfig
from adapters.model.weights import ModelWeights
from shadowradix import PageTableDelta, ReadPlan, ShadowRadixCache

__all__ = [
    "DraftBatch",
    "DraftContext",
    "DraftError",
    "DraftSource",
    "MTPDraft",
    "OracleDraft",
    "SampledDraft",
    "SpecStats",
    "SpeculativeDecoder",
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


class VerifyHost(Protocol):
    """What `SpeculativeDecoder` reads and calls on the runner that holds it (`Runner` is one):
    its model, cache, pools and counters, and its verbs to extend (preempting others until the
    draft fits), run one forward, emit a token and read a request's MTP hidden state."""

    model: ModelConfig
    cache: ShadowRadixCache
    weights: ModelWeights
    pools: KVPools
    device: torch.device
    max_running: int
    stats: RunnerStats
    #: every row's main hidden state of the last paged forward (MTP drafts only)
    _step_hidden: torch.Tensor | None

    def _hidden_of(self, seq: _Seq, start: int | None = None) -> torch.Tensor: ...

    def _extend(self, seqs: list[_Seq], chunks: list[list[int]], draft: bool = False): ...

    def _forward(
        self,
        seqs: list[_Seq],
        chunks: list[list[int]],
        alloc,
        rows: list[int],
        plans: list[ReadPlan] | None = None,
    ): ...

    def _emit(self, seq: _Seq, token: int) -> list[GenerationResult]: ...


class SpeculativeDecoder:
    """The runner's decode phase under speculation (``Runner(speculative_tokens=k)``)."""

    def __init__(
        self, runner: VerifyHost, num_tokens: int, draft: DraftSource, graph: bool
    ) -> None:
        self.num_tokens, self.draft = num_tokens, draft
        self.stats = SpecStats()
        self.verifier = None
        # page-table deltas not yet seen by the verifier's / the draft's device tables
        self._unverified: list[PageTableDelta] = []
        self._undrafted: list[PageTableDelta] = []
        cc = runner.cache.config
        if graph:
            self.verifier = GraphVerifier(
                runner.weights,
                runner.pools,
                cc,
                runner.max_running,
                cc.full_capacity,
                num_tokens + 1,
                mtp=draft.uses_mtp,
            )
        use_graphs = graph and runner.device.type == "cuda"
        draft.bind(
            DraftContext(
                runner.weights, runner.pools, cc, runner.max_running, num_tokens, use_graphs
            )
        )

    def _propose(self, runner: VerifyHost, seqs: list[_Seq]):
        """The drafts ``list[list[int]]`` and their distributions ``(B, k, V)`` (``None``: a
        deterministic source)."""
        t0 = time.perf_counter()
        hidden = None
        if self.draft.uses_mtp:
            hidden = torch.stack([runner._hidden_of(s) for s in seqs])
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
        proposal = self.draft.propose(batch)
        drafts, probs = proposal, None
        if isinstance(proposal, SampledDraft):
            drafts, probs = proposal.tokens, proposal.probs
            self._check_probs(probs, len(seqs), runner.model.vocab_size)
        self._check(drafts, len(seqs), runner.model.vocab_size)
        self.stats.draft_s += time.perf_counter() - t0
        return drafts, probs

    def _check_probs(self, probs: object, batch: int, vocab: int) -> None:
        shape = (batch, self.num_tokens, vocab)
        if not isinstance(probs, torch.Tensor) or tuple(probs.shape) != shape:
            raise DraftError(f"SampledDraft.probs must be a tensor of shape {shape}")

    def _check(self, drafts: object, batch: int, vocab: int) -> None:
        k = self.num_tokens
        if not isinstance(drafts, list) or len(drafts) != batch:
            raise DraftError(f"the draft source must return {batch} drafts, got {drafts!r:.80}")
        for d in drafts:
            if not isinstance(d, list) or len(d) != k:
                raise DraftError(f"every draft must be a list of {k} token ids, got {d!r:.80}")
            if any(type(t) is not int or not 0 <= t < vocab for t in d):
                raise DraftError(f"draft tokens must be ints in [0, {vocab}), got {d!r:.80}")

    def decode(self, runner: VerifyHost, seqs: list[_Seq]) -> list[GenerationResult]:
        """One verify step for ``seqs`` (each with exactly one pending token)."""
        drafts, probs = self._propose(runner, seqs)
        chunks = [[s.result.output[-1]] + d for s, d in zip(seqs, drafts)]
        row = {id(s): i for i, s in enumerate(seqs)}  # the extend may preempt some of seqs
        seqs, chunks, alloc = runner._extend(seqs, chunks, draft=True)
        if alloc is None:
            return []
        self._note(alloc.deltas)
        if probs is not None:
            probs = probs[torch.tensor([row[id(s)] for s in seqs], dtype=torch.long)]
        logits, hidden = self._verify(runner, seqs, chunks, alloc)
        emitted = self._settle(runner, seqs, chunks, logits, hidden, probs)
        runner.stats.decode_tokens += sum(len(e) for e in emitted)
        done: list[GenerationResult] = []
        for s, e in zip(seqs, emitted):
            for tok in e:
                done += runner._emit(s, tok)
            # the cache holds prompt + output[:-1]: exactly one token pending
            assert s.request is None or s.request.length == len(s.tokens) - 1
        return done

    def _note(self, deltas: tuple[PageTableDelta, ...]) -> None:
        """Keeps ``deltas`` for the device tables of the verifier and the draft source."""
        if self.verifier is not None:
            self._unverified += deltas
        self._undrafted += deltas

    def _settle(self, runner: VerifyHost, seqs, chunks, logits, hidden, probs) -> list[list[int]]:
        """Accepts, cuts at max_new_tokens / stop tokens, rolls back the rest (in reverse batch
        order: a full rejection restores the free stacks exactly) and keeps the hidden state
        of each request's last kept row. Returns the tokens to emit per request."""
        t = self.num_tokens + 1
        rows = logits.view(len(seqs), t, -1)
        emitted, accepted = self._accept(seqs, [c[1:] for c in chunks], rows, probs)
        emitted = [
            cut_emission(e, s.params.max_new_tokens - len(s.result.output), s.params.stop_token)
            for s, e in zip(seqs, emitted)
        ]
        for i in reversed(range(len(seqs))):
            self._note(runner.cache.rollback(seqs[i].req, t - len(emitted[i])).deltas)
        if hidden is not None:  # copies: graph outputs are reused
            rows = [i * t + len(e) - 1 for i, e in enumerate(emitted)]
            kept = hidden[torch.tensor(rows, device=hidden.device)]
            for s, h in zip(seqs, kept):
                s.hidden = (s.req, h)
        self._count(seqs, emitted, accepted)
        return emitted

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

    def _verify(self, runner: VerifyHost, seqs: list[_Seq], chunks: list[list[int]], alloc):
        """Logits ``(B*T, V)`` of every row, and the rows' hidden states when MTP is kept."""
        if self.verifier is None:
            rows = list(range(sum(len(c) for c in chunks)))  # every row: all verified
            logits = runner._forward(seqs, chunks, alloc, rows)
            return logits, runner._step_hidden
        t0 = time.perf_counter()
        prev = None
        if self.draft.uses_mtp:
            prev = torch.stack([runner._hidden_of(s) for s in seqs])
        deltas, self._unverified = self._unverified, []
        logits, hidden = self.verifier.verify([s.req for s in seqs], chunks, prev, deltas=deltas)
        if runner.device.type == "cuda":  # pragma: no cover - needs a GPU
            torch.cuda.synchronize(runner.device)
        runner.stats.forward_s += time.perf_counter() - t0
        return logits, hidden if self.draft.uses_mtp else None

    def _count(self, seqs: list[_Seq], emitted: list[list[int]], accepted: list[int]) -> None:
        st = self.stats
        st.forwards += 1
        st.request_steps += len(seqs)
        st.drafted_tokens += self.num_tokens * len(seqs)
        st.accepted_tokens += sum(min(a, len(e)) for a, e in zip(accepted, emitted))
        st.emitted_tokens += sum(len(e) for e in emitted)
