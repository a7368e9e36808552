"""Draft sources for speculative decoding: what they are given (`DraftBatch`), what they return
(token ids, or a `SampledDraft` with the distributions the tokens were sampled from), the
model's MTP layer (`MTPDraft`) and a controllable oracle (`OracleDraft`). docs/speculative.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from adapters.forward.mtp import MTPDrafter
from adapters.memory.pools import KVPools
from adapters.model.model_config import VOCAB_SIZE
from adapters.model.weights import ModelWeights
from shadowradix import CacheConfig, PageTableDelta
from shadowradix.request import Request


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
    #: per request: its sampling temperature (0: greedy) and ``k`` uniforms in [0, 1) from its
    #: seeded generator ``(B, k)`` float64 (zeros for greedy requests): a source that samples
    #: its drafts draws them with these, so runs stay reproducible
    temperatures: tuple[float, ...] = ()
    uniforms: torch.Tensor | None = None


@dataclass(frozen=True)
class SampledDraft:
    """A proposal sampled from distributions: ``tokens[i][j] ~ probs[i, j]`` ``(B, k, V)``.
    Rejection sampling needs them (``q``) for the requests with temperature > 0; a source
    returning plain token lists is deterministic given the context (``q`` one-hot)."""

    tokens: list[list[int]]
    probs: torch.Tensor


class DraftSource(Protocol):
    """Proposes ``k`` tokens per request. ``uses_mtp``: the runner must keep the MTP layer's
    state (its SWA KV, the page hidden states) in every forward, and pass ``hidden``."""

    uses_mtp: bool

    def bind(self, context: DraftContext) -> None:
        """Called once by the runner before any `propose`."""
        ...

    def propose(self, batch: DraftBatch) -> list[list[int]] | SampledDraft:
        """Exactly ``batch.num_tokens`` token ids per request (else the runner raises
        `DraftError`), or a `SampledDraft` of them with their distributions."""
        ...


class DeviceDraftSource(DraftSource, Protocol):
    """A source whose greedy drafts can stay on the device: `propose_device` returns them as a
    ``(B, k)`` long tensor on the weights' device, queued and never read back, for a batch
    whose requests are all greedy. The verify step copies it into its input on the device
    (`GraphVerifier.verify(drafts=...)`) and the judge reads it back with the target's argmax
    in one transfer (docs/speculative.md, "One host read per step")."""

    def propose_device(self, batch: DraftBatch) -> torch.Tensor:
        """The greedy drafts of ``batch`` (every temperature 0), on the device."""
        ...


def device_source(source: DraftSource) -> DeviceDraftSource | None:
    """``source`` as a `DeviceDraftSource`, or None where it has no device path."""
    return source if callable(getattr(source, "propose_device", None)) else None  # type: ignore[return-value]


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
    """Drafts with the model's MTP layer: k chained MTP steps per request (`MTPDrafter`):
    greedy, or, when a request samples, each draft token drawn from the MTP's distribution at
    the request's temperature (a `SampledDraft`)."""

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

    def propose_device(self, batch: DraftBatch) -> torch.Tensor:
        if self.drafter is None or batch.hidden is None:
            raise RuntimeError("MTPDraft is not bound to a runner")
        pending = [o[-1] for o in batch.outputs]
        return self.drafter.draft(list(batch.requests), pending, batch.hidden, batch.deltas)

    def propose(self, batch: DraftBatch) -> list[list[int]] | SampledDraft:
        if self.drafter is None or batch.hidden is None:
            raise RuntimeError("MTPDraft is not bound to a runner")
        pending = [o[-1] for o in batch.outputs]
        reqs, sampled = list(batch.requests), any(t > 0 for t in batch.temperatures)
        if not sampled or batch.uniforms is None:
            return self.drafter.draft(reqs, pending, batch.hidden, batch.deltas).tolist()  # type: ignore[no-any-return]
        temps = torch.tensor(batch.temperatures, dtype=torch.float64)
        tokens, probs = self.drafter.draft_sampled(
            reqs, pending, batch.hidden, batch.deltas, temps, batch.uniforms
        )
        return SampledDraft(tokens.tolist(), probs)
