"""Tensor-parallel attention with per-call head padding.

The ``H`` query heads are split evenly over ``tp`` ranks (`TPLayout`); each rank projects its own
heads' queries, attends, and multiplies by its rows of ``W_o``; one all-reduce sums the partial
outputs, after which every rank holds the same residual streams. What is *not* split:

* the shared KV latent (one 512-d K = V head that every query head reads: MLA/MQA-shaped), the
  compressors and the **indexer**: its heads are replicated, because sharding an MQA-shaped
  scorer does not reduce the key bytes each rank reads, and it would add an all-reduce of the
  ``(tokens, entries)`` scores that grows with the context (the seeds' reasoning). Each rank
  therefore runs its own full `KeySource` (its own replicated pools when paged);
* the FFN, the mHC mixing, the embedding and the head (replicated: this module is attention TP).

Attention kernels want a head count that is a multiple of a fixed number (FlashMLA: 64 on
Hopper, 128 on Blackwell); ``H / tp`` often is not (64 heads at tp = 8 leave 8). `PaddedHeads`
pads each call's queries with zero heads (and zero sink logits) up to ``head_multiple``, runs
the unchanged attention, and crops the output back to the rank's heads: heads are independent
in attention, so the real heads' outputs are untouched by the padding.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import torch

from adapters.distributed.cp_comm import Comm
from adapters.model.model import KeySource, LayerInput, embed, head_logits, layer_forward
from adapters.model.model_config import ModelConfig
from adapters.model.weights import LayerWeights, ModelWeights


class TPError(ValueError):
    """A tensor-parallel layout that cannot be executed."""


class HeadPaddingError(TPError):
    """An attention call with a head count its kernel does not accept."""


@dataclass(frozen=True)
class TPLayout:
    """``tp`` ranks, each with ``H / tp`` heads padded per call to a multiple of
    ``head_multiple`` (the attention kernel's requirement). Raises `TPError` for sizes < 1."""

    tp: int
    head_multiple: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.head_multiple < 1:
            raise TPError(f"tp and head_multiple must be positive, got {self}")

    def local_heads(self, cfg: ModelConfig) -> int:
        """Heads per rank; raises `TPError` unless ``tp`` divides the head count."""
        if cfg.num_heads % self.tp:
            raise TPError(f"{cfg.num_heads} heads do not split over tp = {self.tp}")
        return cfg.num_heads // self.tp

    def padded_heads(self, cfg: ModelConfig) -> int:
        """The head count each rank's attention call runs with."""
        return padded(self.local_heads(cfg), self.head_multiple)

    def heads(self, cfg: ModelConfig, rank: int) -> slice:
        """The query heads of ``rank``."""
        if not 0 <= rank < self.tp:
            raise TPError(f"rank {rank} is not in a tensor-parallel group of {self.tp}")
        h = self.local_heads(cfg)
        return slice(rank * h, (rank + 1) * h)


def padded(heads: int, multiple: int) -> int:
    return -(-heads // multiple) * multiple


def shard_weights(weights: ModelWeights, layout: TPLayout, rank: int) -> ModelWeights:
    """``rank``'s weights: its heads' columns of ``W_q``, sink logits and rows of ``W_o``;
    everything else (KV latent, compressors, indexer, FFN, embedding, head) replicated."""
    cfg = weights.config
    h, d = layout.heads(cfg, rank), cfg.head_dim
    cols = slice(h.start * d, h.stop * d)

    def shard(lw: LayerWeights) -> LayerWeights:
        return replace(
            lw,
            w_q=lw.w_q[:, cols].contiguous(),
            sink=lw.sink[h].contiguous(),
            w_o=lw.w_o[cols].contiguous(),
        )

    return replace(weights, layers=tuple(shard(lw) for lw in weights.layers))


class PaddedHeads:
    """`KeySource` that runs ``inner`` with the queries padded by zero heads (zero sink
    logits) to a multiple of ``multiple`` and returns the real heads' outputs only."""

    def __init__(self, inner: KeySource, multiple: int) -> None:
        self.inner, self.multiple = inner, multiple

    def attend(self, layer: LayerInput) -> torch.Tensor:
        n, h, d = layer.q.shape
        hp = padded(h, self.multiple)
        if hp == h:
            return self.inner.attend(layer)
        q = layer.q.new_zeros((n, hp, d))
        q[:, :h] = layer.q
        sink = torch.cat((layer.weights.sink, layer.weights.sink.new_zeros(hp - h)))
        out = self.inner.attend(replace(layer, q=q, weights=replace(layer.weights, sink=sink)))
        return out[:, :h].contiguous()


    def restrict(self, rows: torch.Tensor) -> PaddedHeads:
        """Tail-only prefill's later layers (`model.TailKeys`): the restricted keys, padded."""
        return PaddedHeads(self.inner.restrict(rows), self.multiple)  # type: ignore[attr-defined]


class HeadMultiple:
    """`KeySource` that enforces an attention kernel's head contract before calling
    ``inner``: raises `HeadPaddingError` for a head count that is not a multiple of
    ``multiple`` (on CPU nothing else would; FlashMLA refuses such calls). ``head_counts``:
    how many calls ran with each head count (shared with ``counts`` when given)."""

    def __init__(self, inner: KeySource, multiple: int, counts: Counter[int] | None = None):
        self.inner, self.multiple = inner, multiple
        self.head_counts: Counter[int] = Counter() if counts is None else counts

    def attend(self, layer: LayerInput) -> torch.Tensor:
        heads = layer.q.shape[1]
        if heads % self.multiple:
            raise HeadPaddingError(f"{heads} heads: the kernel needs a multiple of {self.multiple}")
        self.head_counts[heads] += 1
        return self.inner.attend(layer)

    def restrict(self, rows: torch.Tensor) -> HeadMultiple:
        inner = self.inner.restrict(rows)  # type: ignore[attr-defined]
        return HeadMultiple(inner, self.multiple, self.head_counts)


def tp_layer_forward(
    cfg: ModelConfig,
    index: int,
    lw: LayerWeights,
    streams: torch.Tensor,
    positions: torch.Tensor,
    keys: KeySource,
    comm: Comm,
) -> torch.Tensor:
    """`adapters.model.model.layer_forward` with ``lw`` sharded by heads: the same maths,
    plus the all-reduce of the output projection's partial sums before the residual merge."""
    return layer_forward(cfg, index, lw, streams, positions, keys, comm.all_reduce_sum)


@torch.no_grad()
def tp_forward(
    shard: ModelWeights,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    keys: KeySource,
    comm: Comm,
    logit_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits of the new tokens (rows ``logit_rows``, all when ``None``) on every rank, from
    this rank's `shard_weights`; ``keys`` is this rank's own (replicated) key source, wrapped
    in `PaddedHeads` by the caller when the kernel needs it."""
    cfg = shard.config
    streams = embed(shard, tokens)
    for i, lw in enumerate(shard.layers):
        streams = tp_layer_forward(cfg, i, lw, streams, positions, keys, comm)
    hidden = streams.mean(dim=1)
    return head_logits(shard, hidden if logit_rows is None else hidden[logit_rows])


def tp_keys(inner: KeySource, layout: TPLayout) -> tuple[PaddedHeads, HeadMultiple]:
    """``inner`` behind the kernel's head contract, with the padding that meets it: the key
    source to pass to `tp_forward`, and the guard (whose ``head_counts`` tests read)."""
    guard = HeadMultiple(inner, layout.head_multiple)
    return PaddedHeads(guard, layout.head_multiple), guard


class TPHooks:
    """`ModelWeights.parallel` of one tensor-parallel rank (`tp_weights`): every forward over
    the weights (the Runner's paged prefill and decode, graph decode, verify, tail-only)
    attends through `PaddedHeads` around the kernel's head contract and all-reduces the
    output projection's partial sums. ``head_counts``: attention calls per head count."""

    def __init__(self, comm: Comm, head_multiple: int) -> None:
        self.comm, self.head_multiple = comm, head_multiple
        self.head_counts: Counter[int] = Counter()

    def reduce(self, out: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce_sum(out)

    def keys(self, keys: Any) -> PaddedHeads:
        guard = HeadMultiple(keys, self.head_multiple, self.head_counts)
        return PaddedHeads(guard, self.head_multiple)


def tp_weights(weights: ModelWeights, layout: TPLayout, comm: Comm) -> ModelWeights:
    """``comm.rank``'s `shard_weights` carrying its `TPHooks`: pass them as
    ``Runner(..., weights=)`` and the unchanged engine runs tensor-parallel (every rank a
    Runner over the same prompts, pools replicated). Raises `TPError` if ``comm`` is not a
    group of ``layout.tp`` ranks or ``weights`` are already sharded."""
    if comm.size != layout.tp:
        raise TPError(f"a group of {comm.size} ranks for tp = {layout.tp}")
    if weights.parallel is not None:
        raise TPError("these weights are already sharded")
    hooks = TPHooks(comm, layout.head_multiple)
    return replace(shard_weights(weights, layout, comm.rank), parallel=hooks)
