"""Attention with a learned sink over an explicit key set: the model's attention maths.

A leaf module (torch only): the model's ops re-export it, and the sparse attention kernel's
reference runs it on the keys it gathers, so both compute the same thing the same way (bit for
bit in fp64).
"""

from __future__ import annotations

import torch


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Accumulation type: fp64 stays fp64 (exact tests), everything else computes in fp32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def sink_attention(
    q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of ``q (N, H, d)`` over ``keys (N, K, d)`` (also the values) where ``mask``
    ``(N, K)`` is true, plus one learned sink logit per head in the denominator only."""
    dt = acc_dtype(q)
    logits = torch.einsum("nhd,nkd->nhk", q.to(dt), keys.to(dt)) * scale
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    sink_l = sink.to(dt)[None, :, None].expand(logits.shape[0], -1, 1)
    m = torch.maximum(logits.amax(-1, keepdim=True), sink_l)
    p = torch.exp(logits - m)
    denom = p.sum(-1, keepdim=True) + torch.exp(sink_l - m)
    return (torch.einsum("nhk,nkd->nhd", p, keys.to(dt)) / denom).to(q.dtype)
