"""Tempered sampling by inverse CDF, as tensor ops: the maths shared by the MTP draft
(`adapters.forward.mtp`, which samples its draft tokens) and speculative rejection sampling
(`adapters.engine.rejection`, which draws its residual and bonus tokens). Pure functions: they
read their inputs and mutate nothing; no host synchronisation."""

from __future__ import annotations

import torch

#: Below this, logits / T overflows fp64 for ordinary logit ranges: use 0 (greedy) instead.
MIN_TEMPERATURE = 1e-3


def sample_tempered(
    logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` ``(B, V)``: drawn by inverse CDF at ``uniforms`` ``(B,)``
    from softmax(logits / T) where ``temperatures[i] > 0``, the argmax where it is 0. Returns
    the tokens and the float64 distributions they were drawn from (tensor ops only)."""
    t = temperatures.to(torch.float64).clamp(min=MIN_TEMPERATURE)[:, None]
    probs = torch.softmax(logits.double() / t, dim=-1)
    sampled = inverse_cdf(probs, uniforms)
    return torch.where(temperatures > 0, sampled, logits.argmax(dim=-1)), probs


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One index per row of the non-negative ``weights`` ``(B, V)``: the first whose cumulative
    weight exceeds ``u * total`` (a zero-weight index is never drawn)."""
    cdf = weights.cumsum(dim=-1)
    t = (u.to(cdf.dtype) * cdf[:, -1])[:, None]
    idx = torch.searchsorted(cdf, t, right=True)[:, 0]
    return idx.clamp(max=weights.shape[-1] - 1)
