"""Sampling parameters and per-request samplers (greedy or temperature, seeded)."""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from adapters.forward.topk_capture import TopkCapture
from adapters.model.tempered import MIN_TEMPERATURE
from shadowradix import InvalidRequestError

MAX_TEMPERATURE = 1e3


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` is greedy. ``seed`` makes temperature sampling reproducible, also
    across preemption (one draw per generated token). ``stop_token`` ends generation early.
    ``prompt_logprobs``: return the log-probability of every prompt token given the tokens
    before it (`GenerationResult.prompt_logprobs`); the whole prompt is then computed, never
    read from the prefix cache.

    ``capture_topk``: record every indexer layer's top-k of every position the request
    computes (`GenerationResult.topk`, a `TopkCapture`). ``replay_topk``: force the indexer
    layers to that capture's selections (a forced replay; the capture must fit the model and
    the prompt, checked at submit). A forced run's cache state is not the model's own, so it
    lives in a prefix-cache namespace of its capture (`cache_namespace`). Both: docs/runner.md,
    "Top-k capture and forced replay"."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    seed: int = 0
    stop_token: int | None = None
    prompt_logprobs: bool = False
    capture_topk: bool = False
    replay_topk: TopkCapture | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise InvalidRequestError("max_new_tokens must be an int")
        if self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t):
            raise InvalidRequestError(f"temperature must be a finite number, got {t!r}")
        if t != 0 and not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE:
            raise InvalidRequestError(
                f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
                f"got {t!r}"
            )
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise InvalidRequestError("seed must be an int")
        if not isinstance(self.prompt_logprobs, bool):
            raise InvalidRequestError("prompt_logprobs must be a bool")
        if not isinstance(self.capture_topk, bool):
            raise InvalidRequestError("capture_topk must be a bool")
        if self.replay_topk is not None and not isinstance(self.replay_topk, TopkCapture):
            raise InvalidRequestError("replay_topk must be a TopkCapture")

    @property
    def uses_topk(self) -> bool:
        """The request captures or forces indexer selections (its forwards run paged)."""
        return self.capture_topk or self.replay_topk is not None

    @property
    def cache_namespace(self) -> Hashable:
        """The prefix-cache namespace of the request: a forced replay's own (its capture's
        digest: forced runs of one capture share exact state), else the default (None)."""
        return None if self.replay_topk is None else ("replay_topk", self.replay_topk.digest)


def sample_batch(samplers: list[Sampler], logits: torch.Tensor) -> list[int]:
    """One token per row of ``logits``: every greedy row from one batched argmax (one device
    sync for the whole batch), the others through their own generator."""
    greedy = logits.argmax(dim=-1).tolist()
    return [
        g if s.greedy else s.sample(logits[i]) for i, (s, g) in enumerate(zip(samplers, greedy))
    ]


class Sampler:
    """Draws tokens for one request; its generator lives on the CPU so results do not depend on
    the device."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator().manual_seed(params.seed)

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0

    def sample(self, logits: torch.Tensor) -> int:
        if self.greedy:
            return int(torch.argmax(logits))
        return int(torch.multinomial(self.probs(logits), 1, generator=self.generator))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution a temperature sample draws from: softmax(logits / T) over the last
        dimension, float64 on the CPU (also what speculative sampling verifies against)."""
        return torch.softmax(logits.double().cpu() / self.params.temperature, dim=-1)

    def uniforms(self, n: int) -> torch.Tensor:
        """``n`` float64 uniforms in [0, 1) from this request's generator (speculative
        sampling's accept / reject decisions and its last draw)."""
        return torch.rand(n, generator=self.generator, dtype=torch.float64)
