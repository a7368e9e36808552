"""Speculative (rejection) sampling: verify ``k`` drafted tokens so that the emitted tokens are
distributed exactly as the target's samples (Leviathan et al. 2023, Chen et al. 2023).

For one request, with the target's distributions ``p_0..p_k`` (row ``j``: the token after row
``j``'s token) and the draft's ``q_0..q_{k-1}`` (``x_j ~ q_j``; a deterministic draft source has
one-hot ``q_j`` at ``x_j``)::

    for j in 0..k-1:   accept x_j with probability min(1, p_j(x_j) / q_j(x_j))
    first rejection j: emit x_0..x_{j-1}, then a sample of norm(max(0, p_j - q_j))
    all k accepted:    emit x_0..x_{k-1}, then a bonus sample of p_k

Every position's emitted token is then a sample of ``p_j`` given the tokens before it. The
randomness is explicit: ``k + 1`` uniforms per request (``uniforms[:, j]`` decides draft ``j``,
``uniforms[:, k]`` draws the last token by inverse CDF), so a caller that draws them from a
seeded generator gets reproducible runs, and the whole batch is a handful of tensor ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adapters.engine.sampling import Sampler
from adapters.model.tempered import inverse_cdf, sample_tempered

__all__ = ["RejectionResult", "accept_sampled", "rejection_sample", "sample_tempered"]


@dataclass(frozen=True)
class RejectionResult:
    """Per request: ``accepted[i]`` drafts kept (0..k) and ``next_token[i]``, the token drawn
    after them (a residual sample on a rejection, the bonus sample when all were kept)."""

    accepted: torch.Tensor  # (B,) long
    next_token: torch.Tensor  # (B,) long

    def emitted(self, drafts: torch.Tensor) -> list[list[int]]:
        """The tokens to emit per request: its accepted drafts, then ``next_token``."""
        return [
            d[:a] + [t]
            for d, a, t in zip(drafts.tolist(), self.accepted.tolist(), self.next_token.tolist())
        ]


def rejection_sample(
    drafts: torch.Tensor,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> RejectionResult:
    """Verifies ``drafts`` ``(B, k)`` against ``target_probs`` ``(B, k + 1, V)`` (rows summing
    to 1) with ``uniforms`` ``(B, k + 1)`` in ``[0, 1)``. ``draft_probs`` ``(B, k, V)``: the
    distributions the drafts were sampled from; ``None`` for a deterministic draft (one-hot).
    Pure: reads its inputs, mutates nothing. Raises ``ValueError`` on mismatched shapes."""
    b, k = drafts.shape
    _check_shapes(drafts, target_probs, uniforms, draft_probs)
    p = target_probs
    q = _draft_probs(drafts, draft_probs, p)  # (B, k + 1, V), row k all zero
    x = drafts.long()[..., None]
    px = p[:, :k].gather(-1, x)[..., 0]
    qx = q[:, :k].gather(-1, x)[..., 0]
    keep = uniforms[:, :k] * qx < px  # u < min(1, p/q) without dividing
    accepted = keep.long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(b, device=p.device)
    residual = (p[rows, accepted] - q[rows, accepted]).clamp(min=0)
    # a rejection happens only where p < q somewhere, so the residual has mass; guard rounding
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p[rows, accepted], residual)
    return RejectionResult(accepted, inverse_cdf(residual, uniforms[:, k]))


def _draft_probs(drafts: torch.Tensor, draft_probs: torch.Tensor | None, p: torch.Tensor):
    b, k = drafts.shape
    if draft_probs is None:
        q = p.new_zeros(b, k + 1, p.shape[-1])
        q[:, :k].scatter_(-1, drafts.long()[..., None], 1.0)
        return q
    return torch.cat((draft_probs.to(p.dtype), p.new_zeros(b, 1, p.shape[-1])), dim=1)


def _check_shapes(drafts, target_probs, uniforms, draft_probs) -> None:
    b, k = drafts.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (b, k + 1):
        raise ValueError(f"target_probs must be ({b}, {k + 1}, V), got {tuple(target_probs.shape)}")
    if tuple(uniforms.shape) != (b, k + 1):
        raise ValueError(f"uniforms must be ({b}, {k + 1}), got {tuple(uniforms.shape)}")
    if draft_probs is not None and draft_probs.shape != (b, k, target_probs.shape[2]):
        raise ValueError(f"draft_probs must be ({b}, {k}, V), got {tuple(draft_probs.shape)}")


def accept_sampled(
    samplers: list[Sampler],
    drafts: list[list[int]],
    logits: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> tuple[list[list[int]], list[int]]:
    """`rejection_sample` for temperature requests of a verify step: ``logits`` ``(n, k + 1,
    V)``, each request's target distribution its `Sampler.probs`, its ``k + 1`` uniforms from
    its own seeded generator (so a run is reproducible); ``draft_probs`` ``(n, k, V)`` the
    distributions the drafts were sampled from, ``None`` for a deterministic source (one-hot).
    Returns ``(emitted, accepted)`` lists, like `speculative.accept_greedy`."""
    k = len(drafts[0])
    probs = torch.stack([s.probs(row) for s, row in zip(samplers, logits)])
    uniforms = torch.stack([s.uniforms(k + 1) for s in samplers])
    x = torch.tensor(drafts, dtype=torch.long)
    result = rejection_sample(x, probs, uniforms, draft_probs)
    return result.emitted(x), result.accepted.tolist()
