"""Numeric building blocks shared by the reference forward and the paged forward.

Only position-local maths lives here (norms, RoPE, mHC, group pooling, attention over an
explicit key set). Which keys a query sees, and where they come from, is each forward's own
business: the reference derives it from the whole sequence, the paged path from the pools.
"""

from __future__ import annotations

import torch

from adapters.model.sink import acc_dtype, sink_attention  # noqa: F401 - re-exported: the attention maths
from adapters.model.weights import Compressor, HyperConnection


def _fused(*tensors: torch.Tensor) -> bool:
    """Whether RoPE / RMSNorm on ``tensors`` go to `adapters.kernels.rope` (CUDA, not fp64,
    nothing for autograd to differentiate: the kernels have no backward)."""
    from adapters import kernels

    t = tensors[0]
    if not (kernels.ROPE_KERNELS and kernels.use_triton(t) and t.dtype != torch.float64):
        return False
    return not (torch.is_grad_enabled() and any(u.requires_grad for u in tensors))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the last dimension: one launch on CUDA (`kernels.rope.flash_rms_norm`), else
    `rms_norm_reference`."""
    if _fused(x, weight):  # pragma: no cover - needs a GPU
        from adapters.kernels.rope import flash_rms_norm

        out = flash_rms_norm(x, weight, eps)
        if out is not None:
            return out
    return rms_norm_reference(x, weight, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.to(acc_dtype(x))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(y.dtype)).to(x.dtype)


def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    rope_dim: int,
    theta: float,
    inverse: bool = False,
    *,
    inplace: bool = False,
) -> torch.Tensor:
    """Rotates the last ``rope_dim`` channels of ``x`` (shape ``(N, ..., dim)``) by the angle of
    ``positions`` (shape ``(N,)``); ``inverse`` undoes it. ``inplace`` writes them into ``x``
    and returns it (the same values; for a fresh ``x`` nothing else reads: it saves copying
    the other channels, which are most of a query). One launch on CUDA
    (`kernels.rope.flash_rope`), else `rope_reference`."""
    if _fused(x):  # pragma: no cover - needs a GPU
        from adapters.kernels.rope import flash_rope

        out = flash_rope(x, positions, rope_dim, theta, inverse, inplace)
        if out is not None:
            return out
    return rope_reference(x, positions, rope_dim, theta, inverse, inplace=inplace)


def rope_reference(
    x: torch.Tensor,
    positions: torch.Tensor,
    rope_dim: int,
    theta: float,
    inverse: bool = False,
    *,
    inplace: bool = False,
) -> torch.Tensor:
    half = rope_dim // 2
    dt = acc_dtype(x)
    freqs = theta ** (-torch.arange(half, device=x.device, dtype=dt) / half)
    ang = positions.to(dt)[:, None] * freqs[None, :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = ang.cos().view(shape), ang.sin().view(shape)
    if inverse:
        sin = -sin
    rot = x[..., -rope_dim:].to(dt)
    a, b = rot[..., :half], rot[..., half:]
    out = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1).to(x.dtype)
    if inplace:
        x[..., -rope_dim:] = out
        return x
    return torch.cat((x[..., :-rope_dim], out), dim=-1)


def _hc_kernels(t: torch.Tensor) -> bool:
    """Whether the mHC work on ``t`` goes to `adapters.kernels.hc` (CUDA, not fp64)."""
    from adapters import kernels

    return kernels.HC_KERNELS and kernels.use_triton(t) and t.dtype != torch.float64


def sinkhorn(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """Doubly-stochastic matrices from ``(N, S, S)`` logits (Sinkhorn-Knopp in the exp domain):
    one fused launch on CUDA (`kernels.hc.flash_sinkhorn`), else `sinkhorn_reference`."""
    if _hc_kernels(logits):  # pragma: no cover - needs a GPU
        from adapters.kernels.hc import flash_sinkhorn

        return flash_sinkhorn(logits, iters)
    return sinkhorn_reference(logits, iters)


def sinkhorn_reference(logits: torch.Tensor, iters: int) -> torch.Tensor:
    m = torch.exp(logits - logits.amax(dim=(-1, -2), keepdim=True))
    for _ in range(iters):
        m = m / m.sum(-1, keepdim=True)
        m = m / m.sum(-2, keepdim=True)
    return m


def hc_mix(
    streams: torch.Tensor, hc: HyperConnection, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC coefficients for ``streams`` of shape ``(N, S, D)``: the sub-block input (N, D), the
    output gains (N, S) and the Sinkhorn-normalised residual mixing (N, S, S)."""
    n, s, d = streams.shape
    flat = streams.reshape(n, s * d)
    acc = acc_dtype(flat)
    # rms_norm(flat) @ W == rstd * (flat @ diag(norm) W): no normalised copy of the wide rows
    # (square() not square_(): training differentiates this, and autograd keeps the norm)
    ms = torch.linalg.vector_norm(flat, dim=-1, dtype=acc).square() / (s * d)
    z = (flat @ hc.w_folded).to(acc) * torch.rsqrt(ms + eps)[:, None]
    pre = torch.sigmoid(z[:, :s] + hc.b_pre.to(acc)).to(streams.dtype)
    post = (2.0 * torch.sigmoid(z[:, s : 2 * s] + hc.b_post.to(acc))).to(streams.dtype)
    res = sinkhorn((z[:, 2 * s :] + hc.b_res.to(acc)).view(n, s, s), iters)
    x = torch.einsum("ns,nsd->nd", pre, streams)
    return x, post, res.to(streams.dtype)


def hc_merge(
    streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, res: torch.Tensor
) -> torch.Tensor:
    """New residual streams: mixed old streams plus the sub-block output on each stream; one
    fused launch on CUDA (`kernels.hc.flash_hc_merge`), else `hc_merge_reference`."""
    if _hc_kernels(streams):  # pragma: no cover - needs a GPU
        from adapters.kernels.hc import flash_hc_merge

        return flash_hc_merge(streams, out, post, res)
    return hc_merge_reference(streams, out, post, res)


def hc_merge_reference(
    streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, res: torch.Tensor
) -> torch.Tensor:
    return torch.einsum("nst,ntd->nsd", res, streams) + post[:, :, None] * out[:, None, :]


def compressor_rows(x: torch.Tensor, comp: Compressor, positions: torch.Tensor) -> torch.Tensor:
    """In-flight rows of new tokens, kept in fp32 (fp64 in exact mode): ``[kv | score + ape]``."""
    ratio = comp.ape.shape[0]
    kv = x @ comp.w_kv
    score = x @ comp.w_gate + comp.ape[positions % ratio]
    return torch.cat((kv, score), dim=-1).to(acc_dtype(x))


def pool_groups(rows: torch.Tensor, overlap: bool, ratio: int) -> torch.Tensor:
    """Compresses ``(E, R, 2*width)`` gathered rows into ``(E, dim)`` entries.

    Without overlap ``R = ratio`` and every channel pools its group. With overlap ``R =
    2*ratio``: the first ``ratio`` rows are the previous group's (first-half channels), the last
    ``ratio`` this group's (second-half channels); padding rows carry score ``-inf``, kv 0.
    The softmax runs over the token axis separately for each channel."""
    width = rows.shape[-1] // 2
    kv, score = rows[..., :width], rows[..., width:]
    if overlap:
        dim = width // 2
        kv = torch.cat((kv[:, :ratio, :dim], kv[:, ratio:, dim:]), dim=1)
        score = torch.cat((score[:, :ratio, :dim], score[:, ratio:, dim:]), dim=1)
    weights = torch.softmax(score, dim=1)
    return (weights * kv).sum(dim=1)


def finish_entries(
    pooled: torch.Tensor,
    norm: torch.Tensor,
    groups: torch.Tensor,
    ratio: int,
    rope_dim: int,
    theta: float,
    eps: float,
) -> torch.Tensor:
    """Compressed entries from pooled groups: RMSNorm, then RoPE at the group's first position
    ``g * ratio``."""
    return rope(rms_norm(pooled, norm, eps), groups * ratio, rope_dim, theta)


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Lightning-indexer score ``sum_h w_h * relu(q_h . k)``: q ``(N, Hi, di)``, w ``(N, Hi)``,
    keys ``(N, E, di)`` -> ``(N, E)``, computed in fp32 (fp64 for fp64 inputs), as the fused
    indexer kernel accumulates (`adapters.kernels.index_logits`)."""
    dt = acc_dtype(q)
    dots = torch.einsum("nhd,ned->nhe", q.to(dt), keys.to(dt))
    return torch.einsum("nh,nhe->ne", w.to(dt), torch.relu(dots))


def topk_lowest_index(
    scores: torch.Tensor, k: int, lengths: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` per row, ties broken by the lowest index; returns (values, indices), values
    descending. Every implementation must select the same set: ReLU scores are often equal.
    ``lengths`` (optional, ``(B,)``): entries past a row's length are -inf already; Lightning
    TopK then reads only the valid prefix (the selected set and the -inf tail's validity are
    the same either way; the indices of -inf picks may differ and are never read).

    fp64 rows use a stable sort. Other dtypes compare as fp32 through one int64 key per entry,
    ``(order-preserving score bits) << 32 | (2**32 - 1 - index)``, so a single radix-select
    ``topk`` (no sort, no data-dependent branch: CUDA-graph safe) resolves ties exactly."""
    if scores.dtype == torch.float64:
        values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
        return values[..., :k], indices[..., :k]
    if scores.is_cuda and scores.dim() == 2 and 0 < k:  # pragma: no cover - needs a GPU
        from adapters import kernels

        if kernels.TRITON_AVAILABLE:  # Lightning TopK: same set, same order, one radix select
            values, indices, _ = kernels.topk(scores.float().contiguous(), k, lengths, sorted=True)
            return values, indices
    canonical = scores.float() + 0.0  # -0.0 becomes +0.0: equal scores, equal keys
    bits = canonical.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    ordered = torch.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    index = torch.arange(scores.shape[-1], device=scores.device, dtype=torch.int64)
    keys = (ordered - 0x80000000) * (1 << 32) + (0xFFFFFFFF - index)
    indices = torch.topk(keys, k, dim=-1).indices
    return torch.gather(scores, -1, indices), indices


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor):
    return (torch.nn.functional.silu(x @ w_gate) * (x @ w_up)) @ w_down
