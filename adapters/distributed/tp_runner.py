"""Tensor-parallel serving with the unchanged engine: every rank runs a `Runner` over the same
prompts with its `tp_weights` (its heads' shards plus `TPHooks`), its own replicated pools and
cache. The hooks make every forward the Runner runs (paged prefill and decode, graph decode,
verify, tail-only) attend through `PaddedHeads` and all-reduce after ``W_o``; the streams are
then the same bits on every rank, so every rank samples the same greedy tokens, schedules the
same steps and calls the same collectives in the same order (docs/distributed.md)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from adapters.distributed.cp_comm import Comm
from adapters.distributed.tp import TPHooks, TPLayout, tp_weights
from adapters.engine.runner import Runner
from adapters.engine.sampling import SamplingParams
from adapters.model import model as model_mod
from adapters.model.model_config import ModelConfig
from adapters.model.weights import ModelWeights
from shadowradix import CacheConfig


def tp_runner(
    weights: ModelWeights,
    cache_config: CacheConfig,
    layout: TPLayout,
    comm: Comm,
    **runner_kwargs: Any,
) -> Runner:
    """This rank's `Runner` over ``weights`` sharded by `tp_weights` (every rank passes the
    full weights, the same cache config and the same ``runner_kwargs``). Raises `TPError`
    for a layout the model or the group cannot run."""
    shard = tp_weights(weights, layout, comm)
    return Runner(weights.config, cache_config, weights.device, weights.dtype, weights=shard,
                  **runner_kwargs)  # fmt: skip


def head_counts(runner: Runner) -> dict[int, int]:
    """Attention calls per head count on a `tp_runner` (every one is the padded count)."""
    hooks = runner.weights.parallel
    if not isinstance(hooks, TPHooks):
        raise TypeError("not a tensor-parallel runner")
    return dict(hooks.head_counts)


@contextmanager
def recorded_logits() -> Iterator[list[torch.Tensor]]:
    """Every logits tensor the model's forwards produce meanwhile (copies, in call order):
    tests and benchmarks compare a TP run's with a single rank's step by step."""
    seen: list[torch.Tensor] = []
    original = model_mod.head_logits

    def record(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = original(*args, **kwargs)
        seen.append(out.detach().cpu().clone())
        return out

    model_mod.head_logits = record  # type: ignore[assignment]
    try:
        yield seen
    finally:
        model_mod.head_logits = original  # type: ignore[assignment]


def greedy_run(
    runner: Runner, prompts: Sequence[Sequence[int]], new_tokens: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy outputs of ``prompts`` and the logits of every forward of the run."""
    with recorded_logits() as seen:
        results = runner.generate([list(p) for p in prompts],
                                  SamplingParams(max_new_tokens=new_tokens))  # fmt: skip
    return [r.output for r in results], seen


def model_cache_config(model: ModelConfig, page_size: int, full: int, swa: int) -> CacheConfig:
    """A cache config matching ``model`` (tests and benchmarks)."""
    return model.cache_config(page_size=page_size, full_capacity=full, swa_capacity=swa)
