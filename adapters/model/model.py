"""The layer skeleton of the embedded DeepSeek-V4-style model.

Both forwards run this skeleton; they differ only in the `KeySource`, which decides what each
query attends to: the reference recomputes every key and compressed entry from the whole token
sequence, the paged forward writes and reads the pools the cache planned. Everything the cache
can get wrong lives behind that seam.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from adapters.model import engram as engram_ops
from adapters.model import ops
from adapters.model.engram import EngramInputError, EngramStep
from adapters.model.model_config import ModelConfig
from adapters.model.weights import LayerWeights, ModelWeights


@dataclass(frozen=True)
class LayerInput:
    """What one layer's attention has computed for the step's new tokens (N of them)."""

    index: int
    weights: LayerWeights
    x: torch.Tensor  # (N, D) normed sub-block input: the compressor and indexer read it
    q: torch.Tensor  # (N, H, d) roped queries
    kv: torch.Tensor  # (N, d) roped shared latent (K and V)
    positions: torch.Tensor  # (N,)


@dataclass(frozen=True)
class LayerPrep:
    """What one layer's attention prep reads before its q / kv projections exist: the
    compressor and indexer read only the normed input and the positions."""

    index: int
    weights: LayerWeights
    x: torch.Tensor  # (N, D) normed sub-block input
    positions: torch.Tensor  # (N,)


K = TypeVar("K")


class KeySource(Protocol):
    def attend(self, layer: LayerInput) -> torch.Tensor:
        """Attention output ``(N, H, d)`` of ``layer.q`` over its window, its compressed
        entries and the sink; stores whatever later steps need."""
        ...


class PreparedKeys(KeySource, Protocol):
    def prepare(self, layer: LayerPrep) -> None:
        """Starts the layer's q/kv-independent work (compressor writes, indexer selection)
        before its q / kv projections run, e.g. on a side stream; `attend` of the same layer
        waits for it. Optional: `layer_forward` calls it only where a key source has it."""
        ...


class TailKeys(KeySource, Protocol):
    def restrict(self, rows: torch.Tensor) -> KeySource:
        """The same step's keys for the queries ``rows`` only, carrying what earlier layers
        published (selections to reuse): tail-only prefill runs the layers after the last KV
        source over fewer tokens."""
        ...


def embed(weights: ModelWeights, tokens: torch.Tensor) -> torch.Tensor:
    """Residual streams ``(N, S, D)``: the token embedding on every stream."""
    x = weights.embed[tokens]
    return x[:, None, :].expand(-1, weights.config.hc_streams, -1).contiguous()


def layer_forward(
    cfg: ModelConfig,
    index: int,
    lw: LayerWeights,
    streams: torch.Tensor,
    positions: torch.Tensor,
    keys: KeySource,
    reduce_out: Callable[[torch.Tensor], torch.Tensor] | None = None,
    memory: torch.Tensor | None = None,
) -> torch.Tensor:
    """One layer over the residual ``streams``. ``reduce_out``: applied to the attention's
    output projection before the residual merge (tensor parallelism sums the ranks' partial
    products there, `adapters.distributed.tp`); the head count follows ``lw.w_q``. An Engram
    layer (``lw.engram``) first adds its gated ``memory`` rows (`engram.inject`); without them
    it raises `EngramInputError`."""
    n = streams.shape[0]
    if lw.engram is not None:
        streams = _engram(cfg, index, lw, streams, memory)
    x, post, res = ops.hc_mix(streams, lw.hc_attn, cfg.sinkhorn_iters, cfg.norm_eps)
    xn = ops.rms_norm(x, lw.attn_norm, cfg.norm_eps)
    prepare = getattr(keys, "prepare", None)  # `PreparedKeys`: before the q / kv projections
    if prepare is not None:
        prepare(LayerPrep(index, lw, xn, positions))
    q = (xn @ lw.w_q).view(n, -1, cfg.head_dim)
    # q, kv and attn are fresh tensors: each is rotated in place
    q = ops.rope(q, positions, cfg.rope_dim, cfg.rope_theta, inplace=True)
    kv = ops.rms_norm(xn @ lw.w_kv, lw.kv_norm, cfg.norm_eps)
    kv = ops.rope(kv, positions, cfg.rope_dim, cfg.rope_theta, inplace=True)
    attn = keys.attend(LayerInput(index, lw, xn, q, kv, positions))
    # K = V carries RoPE in its last channels: rotate the output back to position-free values.
    attn = ops.rope(attn, positions, cfg.rope_dim, cfg.rope_theta, inverse=True, inplace=True)
    out = attn.reshape(n, -1) @ lw.w_o
    streams = ops.hc_merge(streams, out if reduce_out is None else reduce_out(out), post, res)
    x, post, res = ops.hc_mix(streams, lw.hc_ffn, cfg.sinkhorn_iters, cfg.norm_eps)
    y = ops.swiglu(ops.rms_norm(x, lw.ffn_norm, cfg.norm_eps), lw.w_gate, lw.w_up, lw.w_down)
    return ops.hc_merge(streams, y, post, res)


def _engram(
    cfg: ModelConfig, index: int, lw: LayerWeights, streams: torch.Tensor, memory
) -> torch.Tensor:
    ew = lw.engram
    assert ew is not None
    if memory is None:
        raise EngramInputError(f"Engram layer {index} ran without its memory rows: this "
                               "forward does not wire Engram (docs/engram.md)")  # fmt: skip
    return engram_ops.inject(
        streams, memory, ew.w_key, ew.w_value, ew.hidden_norm, ew.key_norm, cfg.norm_eps
    )


def _memory(engram: EngramStep | None, index: int) -> torch.Tensor | None:
    return None if engram is None else engram.of(index)


def forward(
    weights: ModelWeights,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    keys: KeySource,
    logit_rows: torch.Tensor | None = None,
    engram: EngramStep | None = None,
) -> torch.Tensor:
    """Logits ``(len(logit_rows), V)`` (all rows when ``None``) for the new tokens;
    ``engram``: the step's Engram memory (required by a model with Engram layers)."""
    hidden = final_hidden(weights, tokens, positions, keys, engram)
    return head_logits(weights, hidden if logit_rows is None else hidden[logit_rows])


def final_hidden(
    weights: ModelWeights,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    keys: KeySource,
    engram: EngramStep | None = None,
) -> torch.Tensor:
    """The last layer's hidden state ``(N, D)`` (mean of the residual streams), before the
    final norm and the head: what the MTP layer reads for the next position."""
    cfg, (keys, reduce) = weights.config, _parallel(weights, keys)
    streams = embed(weights, tokens)
    for i, lw in enumerate(weights.layers):
        streams = layer_forward(cfg, i, lw, streams, positions, keys, reduce, _memory(engram, i))
    return streams.mean(dim=1)


def _parallel(
    weights: ModelWeights, keys: K
) -> tuple[K, Callable[[torch.Tensor], torch.Tensor] | None]:
    """``keys`` and the output reduction under ``weights.parallel`` (tensor parallelism's
    hooks: head padding around ``keys``, the all-reduce after ``W_o``); unchanged without."""
    par = weights.parallel
    return (keys, None) if par is None else (par.keys(keys), par.reduce)


def head_logits(
    weights: ModelWeights, hidden: torch.Tensor, norm: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 logits of hidden states: ``norm`` (the final norm by default), then the head."""
    w = weights.final_norm if norm is None else norm
    return (ops.rms_norm(hidden, w, weights.config.norm_eps) @ weights.head).float()


def compress_rows(
    cfg: ModelConfig,
    rows: torch.Tensor,
    ratio: int,
    groups: torch.Tensor,
    norm: torch.Tensor,
    rope_dim: int,
) -> torch.Tensor:
    """Entries ``(E, dim)`` from gathered in-flight rows ``(E, R, 2*width)`` of groups."""
    pooled = ops.pool_groups(rows, cfg.is_overlap(ratio), ratio)
    return ops.finish_entries(pooled, norm, groups, ratio, rope_dim, cfg.rope_theta, cfg.norm_eps)


def forward_tail_only(
    weights: ModelWeights,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    keys: TailKeys,
    tail_rows: torch.Tensor,
    logit_rows: torch.Tensor | None = None,
    engram: EngramStep | None = None,
) -> torch.Tensor:
    """Decoder-side tail-only forward (V4.1 bounded replay, an approximation): the layers up to
    the last KV-source layer run over every new token, the later layers over ``tail_rows``
    only (the other tokens stop there). Logits ``(len(logit_rows), V)``, ``logit_rows``
    indexing into ``tail_rows`` (all of them when ``None``). Raises `ValueError` for a model
    without KV sources."""
    cfg = weights.config
    if cfg.last_kv_source is None:
        raise ValueError("tail-only needs cross-layer sharing: the model has no kv_sources")
    cut, (keys, red) = cfg.last_kv_source + 1, _parallel(weights, keys)
    streams = embed(weights, tokens)
    for i in range(cut):
        memory = _memory(engram, i)
        streams = layer_forward(cfg, i, weights.layers[i], streams, positions, keys, red, memory)
    streams, positions = streams[tail_rows], positions[tail_rows]
    late = keys.restrict(tail_rows)
    late_engram = None if engram is None else engram.restrict(tail_rows)
    for i in range(cut, cfg.num_layers):
        memory = _memory(late_engram, i)
        streams = layer_forward(cfg, i, weights.layers[i], streams, positions, late, red, memory)
    if logit_rows is not None:
        streams = streams[logit_rows]
    final = ops.rms_norm(streams.mean(dim=1), weights.final_norm, cfg.norm_eps)
    return (final @ weights.head).float()
