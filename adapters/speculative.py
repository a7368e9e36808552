"""Speculative decoding in the runner: draft sources, greedy verification, cache rollback.

One verify step per decoding request (docs/speculative.md)::

    draft  = source.propose(...)                       k tokens after the pending token
    extend_draft_batch(requests, [pending, d1..dk])    T = k + 1 tokens, private pages
    one target forward over all T rows                 logits of every row
    accept the longest prefix with d_i == argmax(row i-1), plus the target's next token
    cut at max_new_tokens / the stop token; rollback(request, T - emitted)

so the cache holds exactly ``prompt + output[:-1]`` afterwards, as without speculation, and the
output is the target's greedy output whatever the draft proposes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from shadowradix import CacheConfig, PageTableDelta, ReadPlan, ShadowRadixCache
from shadowradix.request import Request

from .graph_verify import GraphVerifier
from .model_config import VOCAB_SIZE, ModelConfig
from .mtp import MTPDrafter
from .pools import KVPools
from .rejection import accept_sampled
from .runner_stats import RunnerStats
from .sequence import GenerationResult, _Seq
from .weights import ModelWeights


class DraftError(ValueError):
    """A draft source returned something other than ``k`` token ids per request."""


@dataclass(frozen=True)
class DraftContext:
    """What a draft source may use, given once by the runner (`DraftSource.bind`)."""

    weights: ModelWeights
    pools: KVPools
    cache_config: CacheConfig
    max_batch: int
    num_tokens: int  # k
    use_graphs: bool


@dataclass(frozen=True)
class DraftBatch:
    """The requests to draft for. Request ``i`` has committed ``requests[i].length`` tokens
    (``prompts[i] + outputs[i][:-1]``); ``outputs[i][-1]`` is its pending token. ``hidden``:
    the main model's hidden state at each request's last committed position ``(B, D)``, when
    the source `uses_mtp`. ``deltas``: the page-table deltas since the last draft (for a source
    keeping device tables)."""

    requests: tuple[Request, ...]
    prompts: tuple[list[int], ...]
    outputs: tuple[list[int], ...]
    hidden: torch.Tensor | None
    num_tokens: int
    deltas: tuple[PageTableDelta, ...] = ()


class DraftSource(Protocol):
    """Proposes ``k`` tokens per request. ``uses_mtp``: the runner must keep the MTP layer's
    state (its SWA KV, the page hidden states) in every forward, and pass ``hidden``."""

    uses_mtp: bool

    def bind(self, context: DraftContext) -> None:
        """Called once by the runner before any `propose`."""
        ...

    def propose(self, batch: DraftBatch) -> list[list[int]]:
        """Exactly ``batch.num_tokens`` token ids per request (else the runner raises
        `DraftError`)."""
        ...


class OracleDraft:
    """The target's own greedy continuation with errors injected: a controllable acceptance.

    ``continuations[prompt]`` is the target's greedy output for ``prompt`` (from a reference or
    a non-speculative run). Each drafted token is the true next token with probability
    ``accept_rate`` and a wrong one otherwise (seeded); past the end of the table, or for an
    unknown prompt, drafts are wrong. ``accept_rate=1`` accepts every draft of a greedy run."""

    uses_mtp = False

    def __init__(
        self,
        continuations: Mapping[tuple[int, ...], Sequence[int]],
        accept_rate: float,
        seed: int = 0,
    ) -> None:
        if not 0.0 <= accept_rate <= 1.0:
            raise ValueError(f"accept_rate must be in [0, 1], got {accept_rate}")
        self.accept_rate = accept_rate
        self._table = {tuple(p): list(c) for p, c in continuations.items()}
        self._rng = np.random.default_rng(seed)
        self._vocab = VOCAB_SIZE  # the bound model's, once bound

    def bind(self, context: DraftContext) -> None:
        self._vocab = context.weights.config.vocab_size

    def propose(self, batch: DraftBatch) -> list[list[int]]:
        k, out = batch.num_tokens, []
        for prompt, output in zip(batch.prompts, batch.outputs):
            cont = self._table.get(tuple(prompt), [])
            true = np.full(k, -1, dtype=np.int64)
            known = cont[len(output) : len(output) + k]
            true[: len(known)] = known
            keep = (self._rng.random(k) < self.accept_rate) & (true >= 0)
            wrong = (np.maximum(true, 0) + self._rng.integers(1, self._vocab, k)) % self._vocab
            out.append(np.where(keep, true, wrong).tolist())
        return out


class MTPDraft:
    """Drafts with the model's MTP layer: k chained MTP steps per request (`MTPDrafter`)."""

    uses_mtp = True

    def __init__(self) -> None:
        self.drafter: MTPDrafter | None = None

    def bind(self, context: DraftContext) -> None:
        self.drafter = MTPDrafter(
            context.weights,
            context.pools,
            context.cache_config,
            context.max_batch,
            context.cache_config.full_capacity,
            context.num_tokens,
            use_graphs=context.use_graphs,
        )

    def propose(self, batch: DraftBatch) -> list[list[int]]:
        if self.drafter is None or batch.hidden is None:
            raise RuntimeError("MTPDraft is not bound to a runner")
        pending = [o[-1] for o in batch.outputs]
        tokens = self.drafter.draft(list(batch.requests), pending, batch.hidden, batch.deltas)
        return tokens.tolist()  # type: ignore[no-any-return]


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

    def _propose(self, runner: VerifyHost, seqs: list[_Seq]) -> list[list[int]]:
        t0 = time.perf_counter()
        hidden = None
        if self.draft.uses_mtp:
            hidden = torch.stack([runner._hidden_of(s) for s in seqs])
        batch = DraftBatch(
            tuple(s.req for s in seqs),
            tuple(s.result.prompt for s in seqs),
            tuple(s.result.output for s in seqs),
            hidden,
            self.num_tokens,
            tuple(self._undrafted),
        )
        self._undrafted = []
        drafts = self.draft.propose(batch)
        self._check(drafts, len(seqs), runner.model.vocab_size)
        self.stats.draft_s += time.perf_counter() - t0
        return drafts

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
        drafts = self._propose(runner, seqs)
        chunks = [[s.result.output[-1]] + d for s, d in zip(seqs, drafts)]
        seqs, chunks, alloc = runner._extend(seqs, chunks, draft=True)
        if alloc is None:
            return []
        self._note(alloc.deltas)
        logits, hidden = self._verify(runner, seqs, chunks, alloc)
        emitted = self._settle(runner, seqs, chunks, logits, hidden)
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

    def _settle(self, runner: VerifyHost, seqs, chunks, logits, hidden) -> list[list[int]]:
        """Accepts, cuts at max_new_tokens / stop tokens, rolls back the rest (in reverse batch
        order: a full rejection restores the free stacks exactly) and keeps the hidden state
        of each request's last kept row. Returns the tokens to emit per request."""
        t = self.num_tokens + 1
        emitted, accepted = self._accept(
            seqs, [c[1:] for c in chunks], logits.view(len(seqs), t, -1)
        )
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

    def _accept(self, seqs: list[_Seq], drafts: list[list[int]], logits: torch.Tensor):
        """Greedy requests keep the drafts equal to the target's argmax (`accept_greedy`);
        temperature requests go through rejection sampling (`rejection.accept_sampled`)."""
        emitted, accepted = accept_greedy(drafts, logits.argmax(dim=-1).tolist())
        sampled = [i for i, s in enumerate(seqs) if not s.sampler.greedy]
        if sampled:
            rows = logits[torch.tensor(sampled, device=logits.device)]
            e, a = accept_sampled(
                [seqs[i].sampler for i in sampled], [drafts[i] for i in sampled], rows
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
