"""The Engram memory layer (DeepSeek-V4.1): a hashed n-gram lookup gated into the residual.

At an Engram layer every token ``t`` reads, for each n-gram order ``o = 2..n`` and each of
``heads`` hash functions, one row of that layer's table: the row of the hash of the tokens
``[t - o + 1, t]`` (positions before 0 read as `pad_token`). The ``K = (n - 1) * heads`` rows
(``engram_dim`` channels each, stored fp8 with a per-row scale: `adapters.memory.engram_table`)
are concatenated into ``e``; then, in fp32 (the seeds: Engram gating is fp32)::

    k = e @ w_key        v = e @ w_value                                   (D each)
    gate[s] = sigmoid(<rms(stream_s) * hidden_norm, rms(k) * key_norm> / sqrt(D))
    stream_s += gate[s] * v                    for each of the S residual streams

The lookup depends on the token ids only, so the cache keeps no state for it; what a step
needs is each new token's n-gram (`chunk_ngrams`: the previous ``n - 1`` tokens of its
request, also across a chunk or prefix-hit boundary). Where the table lives is the caller's
(`EngramRows`): this module hashes and gates, never places.

Simplified against the Engram paper: no tokenizer compression before hashing, one key
projection for all streams, and no short causal convolution after the gate (it would make the
output depend on earlier hidden states, i.e. state the cache would have to keep).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

import numpy as np
import torch

from adapters.model.model_config import ModelConfig

#: seed offset of the hash multipliers (independent of the weights' generators)
HASH_SEED_OFFSET = 0x454E47


class EngramInputError(ValueError):
    """An Engram layer ran without its step's memory rows (a forward that does not wire
    Engram: tensor / context parallel, training, the MTP or EAGLE paths)."""


class EngramRows(Protocol):
    """A placement of the Engram tables (`adapters.memory.engram_table`)."""

    def lookup(self, row_ids: torch.Tensor) -> torch.Tensor:
        """Dequantised rows ``(L, N, K * dim)`` on the compute device, in its dtype, of
        ``row_ids`` ``(L, N, K)`` (table ``l`` for Engram layer ``l``; ids on any device)."""
        ...


@dataclass(frozen=True)
class EngramStep:
    """One forward's Engram memory: ``memory[l]`` the rows ``(N, K * dim)`` of the step's
    tokens for the ``l``-th layer of ``layers``."""

    layers: tuple[int, ...]
    memory: torch.Tensor  # (L, N, K * dim)

    def of(self, layer: int) -> torch.Tensor | None:
        """Layer ``layer``'s rows, or None when it is no Engram layer."""
        if layer not in self.layers:
            return None
        return self.memory[self.layers.index(layer)]

    def restrict(self, rows: torch.Tensor) -> EngramStep:
        """The step for the token rows ``rows`` only (tail-only prefill's late layers)."""
        return EngramStep(self.layers, self.memory[:, rows])


def pad_token(vocab_size: int) -> int:
    """The id a position before 0 reads as in an n-gram (no real token has it)."""
    return vocab_size


def sequence_ngrams(tokens: torch.Tensor, n: int, pad: int) -> torch.Tensor:
    """``(T, n)``: row ``t`` the tokens ``[t - n + 1, t]`` of a sequence from position 0."""
    padded = torch.cat((tokens.new_full((n - 1,), pad), tokens))
    return padded.unfold(0, n, 1)


def chunk_ngrams(contexts: Sequence[np.ndarray], chunk_lens: Sequence[int], n: int, pad: int):
    """``(N, n)`` int64 n-grams of a step's chunks, in flat row order. ``contexts[i]``: the
    tokens of request ``i`` from ``n - 1`` before its chunk (fewer at the request's start) to
    the chunk's end; the chunk is its last ``chunk_lens[i]`` tokens. Raises `ValueError` when a
    context is shorter than its chunk."""
    parts = []
    for ctx, m in zip(contexts, chunk_lens):
        if len(ctx) < m:
            raise ValueError(f"an n-gram context of {len(ctx)} tokens for a chunk of {m}")
        ctx = np.asarray(ctx, dtype=np.int64)[-(m + n - 1) :]
        padded = np.concatenate((np.full(m + n - 1 - len(ctx), pad, np.int64), ctx))
        parts.append(np.lib.stride_tricks.sliding_window_view(padded, n))
    return np.concatenate(parts) if parts else np.zeros((0, n), np.int64)


def decode_ngrams(
    histories: Sequence[np.ndarray], tokens: list[int] | torch.Tensor, n: int, pad: int
) -> torch.Tensor:
    """``(B, n)`` n-grams of a decode step: request ``i``'s ``n - 1`` tokens before its new
    token (``histories[i]``, fewer at its start: padded), then ``tokens[i]``; on the tokens'
    device (a device tensor under overlap scheduling: nothing waits for it)."""
    hist = np.full((len(histories), n - 1), pad, np.int64)
    for i, h in enumerate(histories):
        if len(h):
            hist[i, n - 1 - len(h) :] = h
    if isinstance(tokens, torch.Tensor):
        head = torch.from_numpy(hist).to(tokens.device)
        return torch.cat((head, tokens.view(-1, 1).long()), dim=1)
    return torch.from_numpy(np.concatenate((hist, np.asarray(tokens, np.int64)[:, None]), 1))


def hash_multipliers(seed: int, num_layers: int, n: int, heads: int) -> torch.Tensor:
    """``(L, K, n + 1)`` int64: per layer and lookup, odd multipliers < 2**31 for the n-gram's
    last ``o`` tokens (0 for the others: lookup ``k`` hashes order ``2 + k // heads``) and a
    salt in the last column."""
    rng = np.random.default_rng(seed + HASH_SEED_OFFSET)
    m = rng.integers(1, 2**30, size=(num_layers, (n - 1) * heads, n + 1), dtype=np.int64) * 2 + 1
    for k in range((n - 1) * heads):
        order = 2 + k // heads
        m[:, k, : n - order] = 0
    return torch.from_numpy(m)


def row_ids(ngrams: torch.Tensor, multipliers: torch.Tensor, rows: int) -> torch.Tensor:
    """Table rows ``(L, N, K)`` of ``ngrams`` ``(N, n)`` (ids below 2**20): a multiply-add
    hash (no int64 overflow: 9 * 2**20 * 2**31 < 2**63), xor-folded, modulo ``rows``."""
    m = multipliers.to(ngrams.device)
    x = (ngrams[None, :, None, :] * m[:, None, :, :-1]).sum(-1) + m[:, None, :, -1]
    x = x ^ (x >> 17)
    return torch.remainder(x, rows)


@lru_cache(maxsize=16)
def multipliers(cfg: ModelConfig) -> torch.Tensor:
    """The hash multipliers of ``cfg``'s Engram layers (`hash_multipliers`), on the CPU."""
    return hash_multipliers(cfg.seed, len(cfg.engram_layers), cfg.engram_ngram, cfg.engram_heads)


def step_of(cfg: ModelConfig, ngrams: torch.Tensor, rows: EngramRows | None) -> EngramStep | None:
    """The Engram memory of a step whose tokens have ``ngrams`` ``(N, n)``, looked up in
    ``rows``; None for a model without Engram layers. Raises `EngramInputError` for an Engram
    model without ``rows``."""
    if not cfg.engram_layers:
        return None
    if rows is None:
        raise EngramInputError(f"{cfg.name} has Engram layers: its forward needs a placement "
                               "of the tables (adapters.memory.engram_table)")  # fmt: skip
    ids = row_ids(ngrams, multipliers(cfg), cfg.engram_rows)
    return EngramStep(cfg.engram_layers, rows.lookup(ids))


def sequence_step(
    cfg: ModelConfig, tokens: torch.Tensor, rows: EngramRows | None
) -> EngramStep | None:
    """`step_of` for a whole sequence from position 0 (the reference forward)."""
    if not cfg.engram_layers:
        return None
    return step_of(cfg, sequence_ngrams(tokens, cfg.engram_ngram, pad_token(cfg.vocab_size)), rows)


def inject(
    streams: torch.Tensor,
    memory: torch.Tensor,
    w_key: torch.Tensor,
    w_value: torch.Tensor,
    hidden_norm: torch.Tensor,
    key_norm: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """``streams`` ``(N, S, D)`` with the gated memory ``(N, K * dim)`` added (see the module
    docstring), computed in fp32 (fp64 for fp64 streams), returned in the streams' dtype."""
    acc = torch.float64 if streams.dtype == torch.float64 else torch.float32
    e, s = memory.to(acc), streams.to(acc)
    k, v = e @ w_key.to(acc), e @ w_value.to(acc)
    h = _rms(s, eps) * hidden_norm.to(acc)
    kn = _rms(k, eps) * key_norm.to(acc)
    gate = torch.sigmoid((h * kn[:, None, :]).sum(-1) / s.shape[-1] ** 0.5)  # (N, S)
    return (s + gate[..., None] * v[:, None, :]).to(streams.dtype)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
