"""A request's checks at submission (`Runner.submit`): its tokens, its sampling parameters and
its priority, against what the runner could ever run. Nothing is queued when one fails
(`InvalidRequestError`)."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from adapters.engine.sampling import SamplingParams
from adapters.engine.sequence import FailureStage, GenerationResult, RequestFailure
from adapters.forward.memory_plan import PrefillBudget
from adapters.model.model_config import ModelConfig
from shadowradix import InvalidRequestError, ShadowRadixCache


class UnsupportedRequestError(InvalidRequestError):
    """The request asks for something the runner's mode cannot give: prompt logprobs under
    tail-only prefill (the later layers never see most prompt positions)."""


def _token(t: object) -> int:
    """An int token id; floats, strings and bools are refused, not coerced."""
    if isinstance(t, (bool, np.bool_)):
        raise TypeError(f"{t!r} is a bool")
    return operator.index(t)  # type: ignore[arg-type]


def check_priority(priority: object) -> int:
    """A request's priority: an int (higher runs first); `InvalidRequestError` otherwise."""
    if isinstance(priority, (bool, np.bool_)):
        raise InvalidRequestError(f"priority must be an int, got {priority!r}")
    try:
        return operator.index(priority)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidRequestError(f"priority must be an int, got {priority!r}") from None


@dataclass(frozen=True)
class SubmissionRules:
    """What a request must satisfy: tokens in ``[0, vocab_size)``, prompt + output (+ the
    draft tokens of a verify step) within the ``cache``'s full pool as it is now (a re-balance
    may resize it), a one-token step within the memory budget, no prompt logprobs under
    ``tail_only``, no top-k capture / replay under ``tail_only`` or speculation, a replayed
    capture that fits ``model`` and the prompt (`TopkCapture.check`)."""

    vocab_size: int
    cache: ShadowRadixCache
    spec_tokens: int
    tail_only: bool
    memory: PrefillBudget
    model: ModelConfig | None = None

    def tokens(self, prompt: Sequence[int], params: SamplingParams) -> list[int]:
        """``prompt`` as a list of token ids; `InvalidRequestError` (`UnsupportedRequestError`,
        `MemoryBudgetError`) for a request the runner cannot run."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be SamplingParams")
        if params.prompt_logprobs and self.tail_only:
            raise UnsupportedRequestError(
                "prompt_logprobs is not supported with tail-only prefill: the layers after the "
                "last KV source compute only the last window of each chunk"
            )
        if isinstance(prompt, (str, bytes)):
            raise InvalidRequestError("prompt must be a sequence of token ids (encode text first)")
        try:
            tokens = [_token(t) for t in prompt]
        except TypeError as exc:
            raise InvalidRequestError(f"prompt must be a sequence of ints: {exc}") from None
        if not tokens:
            raise InvalidRequestError("empty prompt")
        if min(tokens) < 0 or max(tokens) >= self.vocab_size:
            raise InvalidRequestError(f"prompt tokens must be in [0, {self.vocab_size})")
        total = len(tokens) + params.max_new_tokens + self.spec_tokens
        full_capacity = self.cache.config.full_capacity
        if total > full_capacity:
            raise InvalidRequestError(
                f"prompt + max_new_tokens (+ {self.spec_tokens} draft tokens) = {total} tokens "
                f"exceeds the full pool ({full_capacity} tokens): it could never run"
            )
        self.memory.check(total, 1 + self.spec_tokens)
        self._check_topk(tokens, params)
        return tokens

    def _check_topk(self, tokens: list[int], params: SamplingParams) -> None:
        if params.uses_topk and (self.tail_only or self.spec_tokens):
            raise UnsupportedRequestError(
                "top-k capture / replay is not supported with tail-only prefill (later layers "
                "skip positions) or speculative decoding (verify rows are rolled back)"
            )
        if params.replay_topk is not None and self.model is not None:
            params.replay_topk.check(self.model, tokens, params.max_new_tokens)


def per_prompt(
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] | None,
    priorities: Sequence[int] | None,
) -> list[tuple[Sequence[int], SamplingParams, int]]:
    """`Runner.generate`'s arguments, one (prompt, params, priority) per prompt: ``params`` one
    for all (default `SamplingParams()`) or one each, ``priorities`` one each (default 0);
    `InvalidRequestError` if a count differs."""
    if params is None or isinstance(params, SamplingParams):
        params = [params or SamplingParams()] * len(prompts)
    priorities = [0] * len(prompts) if priorities is None else priorities
    if not len(params) == len(priorities) == len(prompts):
        raise InvalidRequestError(
            f"{len(prompts)} prompts but {len(params)} SamplingParams and "
            f"{len(priorities)} priorities"
        )
    return list(zip(prompts, params, priorities))


def refused(prompt: object, exc: InvalidRequestError) -> GenerationResult:
    """The result `Runner.generate` gives a prompt `submit` refused with ``exc``."""
    bad = list(prompt) if isinstance(prompt, (list, tuple)) else []
    failure = RequestFailure(FailureStage.SUBMIT, exc)
    return GenerationResult(-1, bad, finish_reason="error", error=str(exc), failure=failure)
