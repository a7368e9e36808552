"""A request's life in the runner: what the caller gets back (`GenerationResult`) and the
runner's in-flight record of it (`_Seq`: the result so far, its sampler, its live cache
request). Shared by the scheduler, the model runner, emission and speculative decoding;
imports none of them, nor torch (types only)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np

from shadowradix import MatchResult
from shadowradix.request import Request

if TYPE_CHECKING:  # torch-free at run time: the scheduler imports this module
    import torch

    from adapters.engine.sampling import Sampler, SamplingParams
    from adapters.forward.topk_capture import TopkCapture, TopkRecorder


class FailureStage(Enum):
    """Where a request failed."""

    #: refused by `Runner.submit`'s checks (`generate` turns the refusal into a result)
    SUBMIT = "submit"
    #: a prefill forward (or a bounded-replay window rebuild) raised
    PREFILL = "prefill"
    #: a decode or speculative verify step raised
    DECODE = "decode"


@dataclass(frozen=True)
class RequestFailure:
    """Why a request finished with ``finish_reason="error"``: the stage and the exception raised
    there, unchanged, so a caller can tell its kind (``isinstance(f.exception, CapacityError)``,
    ``torch.OutOfMemoryError``, `InvalidRequestError`, ...)."""

    stage: FailureStage
    exception: Exception

    @property
    def message(self) -> str:
        """One line: the stage, the exception's type and its first line."""
        head = f"{self.stage.value} failed: {type(self.exception).__name__}"
        lines = str(self.exception).splitlines()
        return f"{head}: {lines[0]}" if lines else head


@dataclass
class GenerationResult:
    """One request's outcome. ``finish_reason``: ``"length"``, ``"stop"`` or ``"error"``; an
    error carries ``failure`` (its typed record) and ``error`` (its message); ``output`` then
    keeps the tokens emitted before it failed.

    ``approximate``: the request's output may differ from an exact run, because tail-only
    prefill skipped some of its prompt tokens past the last KV-source layer, or it reused a
    cached prefix after the runner had skipped tokens. ``prompt_logprobs``: with
    ``SamplingParams(prompt_logprobs=True)``, ``None`` for the first prompt token, then the
    log-probability of each prompt token given the tokens before it. ``topk``: with
    ``SamplingParams(capture_topk=True)``, the selections of every position this request
    computed (``first_position`` > 0 after a prefix-cache hit: the cached positions were not
    computed, so not captured); None if it computed none."""

    request_id: int
    prompt: list[int]
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    cached_tokens: int = 0
    preemptions: int = 0
    #: some output token was computed from approximate state: a bounded replay (this
    #: request's replayed hit, or cached state derived from one: the core's replay lineage) or
    #: a tail-only prefill (this request's, or a reused prefix that may hold its holes)
    approximate: bool = False
    prompt_logprobs: list[float | None] | None = None
    failure: RequestFailure | None = None
    topk: TopkCapture | None = None


@dataclass(eq=False)  # compared by identity: the runner's lists remove the record itself
class _Seq:
    result: GenerationResult
    params: SamplingParams
    sampler: Sampler
    request: Request | None = None
    #: higher is admitted first and preempted last (`Runner.submit`'s ``priority``)
    priority: int = 0
    admitted_at: int = 0
    #: while waiting: the kept prefix match (`WaitingQueue.match`), and how many requests of its
    #: priority the longest-prefix-first order admitted while it was the queue's head
    match: MatchResult | None = None
    overtaken: int = 0
    #: next position of the admission's pending window rebuild (``None``: nothing to replay)
    replay_at: int | None = None
    #: (cache request, main hidden state at its last computed position): MTP drafts only
    hidden: tuple[Request, torch.Tensor] | None = None
    #: the selections recorded so far (``capture_topk`` only; made by the model runner)
    topk: TopkRecorder | None = None
    _prompt_array: np.ndarray | None = field(default=None, repr=False)

    def prompt_array(self) -> np.ndarray:
        """The prompt as an int64 array (built once: prompts never change)."""
        if self._prompt_array is None:
            self._prompt_array = np.asarray(self.result.prompt, dtype=np.int64)
        return self._prompt_array

    @property
    def tokens(self) -> list[int]:
        """Prompt and output so far: a new list (O(length)); `num_tokens` counts them."""
        return self.result.prompt + self.result.output

    @property
    def num_tokens(self) -> int:
        return len(self.result.prompt) + len(self.result.output)

    def token_slice(self, lo: int, hi: int) -> list[int]:
        """``tokens[lo:hi]`` without building the whole list."""
        prompt, n = self.result.prompt, len(self.result.prompt)
        if hi <= n:
            return prompt[lo:hi]
        return prompt[lo:n] + self.result.output[max(lo - n, 0) : hi - n]

    @property
    def req(self) -> Request:
        """The live cache request (only while running)."""
        assert self.request is not None, "request is not running"
        return self.request

    @property
    def decoding(self) -> bool:
        return self.request is not None and len(self.request.prompt_remaining) == 0
