"""Plain PyTorch references for the two kernels of `adapters.kernels`.

Written independently of the Triton code, and in the most literal form: they define what the
kernels must compute, they are the CPU fallback of `adapters.kernels.compress` / `topk`, and
`naive_torch_chain` is the unfused baseline the benchmark compares against.

Compressor conventions (the model's, see ``adapters.model.ops.pool_groups``):

* ``kv`` and ``score`` are per-token rows ``(T, c*d)``; ``c = 2`` with the C4 overlap, else 1.
* ``ape`` ``(ratio, c*d)`` is the position bias: token ``t`` adds ``ape[t % ratio]`` (token 0 starts
  group 0). The Triton kernel adds it itself; pass ``None`` when ``score`` already includes it.
* Group ``g`` holds tokens ``[g*ratio, (g+1)*ratio)``; only ``G = T // ratio`` complete groups make
  entries. With overlap, entry ``g`` pools 2*ratio rows: group ``g-1``'s tokens on their first
  ``d`` channels and group ``g``'s tokens on their last ``d`` channels; group ``-1`` is padding
  (kv 0, score -inf). To continue a sequence chunk by chunk, prepend the previous group's rows
  and drop the first entry.
* Softmax over the token axis, separately for each channel, then the weighted sum of ``kv``.
* Optional epilogue (``norm`` given): RMSNorm with weight ``norm`` then RoPE on the last
  ``rope_dim`` channels at position ``(group_offset + g) * ratio``, as
  ``adapters.model.ops.finish_entries``.

TopK conventions: see `topk_reference`.
"""

from __future__ import annotations

import torch

__all__ = [
    "compress_reference",
    "compress_gathered_reference",
    "naive_torch_chain",
    "topk_reference",
    "ordered_keys",
]


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _epilogue(
    pooled: torch.Tensor,
    positions: torch.Tensor,
    norm: torch.Tensor,
    rope_dim: int,
    theta: float,
    eps: float,
) -> torch.Tensor:
    """RMSNorm (weight ``norm``) then RoPE of the last ``rope_dim`` channels at ``positions``:
    channel pairs ``(j, j + h)`` of that tail (``h = rope_dim/2``) rotate by
    ``pos * theta**(-j/h)``."""
    dt = pooled.dtype
    y = pooled * torch.rsqrt(pooled.pow(2).mean(-1, keepdim=True) + eps) * norm.to(dt)
    if rope_dim == 0:
        return y
    half = rope_dim // 2
    freqs = theta ** (-torch.arange(half, device=y.device, dtype=dt) / half)
    ang = positions.to(dt)[:, None] * freqs[None, :]
    cos, sin = ang.cos(), ang.sin()
    a, b = y[:, -rope_dim:-half], y[:, -half:]
    return torch.cat((y[:, :-rope_dim], a * cos - b * sin, a * sin + b * cos), dim=-1)


def _pool(kv: torch.Tensor, score: torch.Tensor, overlap: bool) -> torch.Tensor:
    """``kv``/``score`` ``(E, R, c*d)`` in the accumulation dtype -> ``(E, d)``."""
    if overlap:
        ratio, d = kv.shape[1] // 2, kv.shape[2] // 2
        kv = torch.cat((kv[:, :ratio, :d], kv[:, ratio:, d:]), dim=1)
        score = torch.cat((score[:, :ratio, :d], score[:, ratio:, d:]), dim=1)
    m = score.amax(dim=1, keepdim=True)
    p = torch.exp(score - m)
    return (p * kv).sum(dim=1) / p.sum(dim=1)


def compress_reference(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor | None,
    ratio: int,
    overlap: bool,
    *,
    norm: torch.Tensor | None = None,
    rope_dim: int = 0,
    theta: float = 10000.0,
    eps: float = 1e-6,
    group_offset: int = 0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Entries ``(T // ratio, d)`` from contiguous token rows (the prefill path)."""
    t, width = kv.shape
    c = 2 if overlap else 1
    if width % c or score.shape != kv.shape:
        raise ValueError(f"kv {tuple(kv.shape)} / score {tuple(score.shape)} do not match")
    d = width // c
    g = t // ratio
    dt = _acc(kv)
    if g == 0:
        return torch.zeros((0, d), dtype=out_dtype or kv.dtype, device=kv.device)
    kvf = kv[: g * ratio].to(dt).view(g, ratio, width)
    sf = score[: g * ratio].to(dt).view(g, ratio, width)
    if ape is not None:
        sf = sf + ape.to(dt)[None, :, :]
    if overlap:
        pad_kv = torch.zeros((1, ratio, width), dtype=dt, device=kv.device)
        pad_s = torch.full((1, ratio, width), float("-inf"), dtype=dt, device=kv.device)
        kvf = torch.cat((torch.cat((pad_kv, kvf[:-1]), 0), kvf), dim=1)  # (G, 2r, W)
        sf = torch.cat((torch.cat((pad_s, sf[:-1]), 0), sf), dim=1)
    pooled = _pool(kvf, sf, overlap)
    if norm is not None:
        pos = (torch.arange(g, device=kv.device) + group_offset) * ratio
        pooled = _epilogue(pooled, pos, norm, rope_dim, theta, eps)
    return pooled.to(out_dtype or kv.dtype)


def compress_gathered_reference(
    ring: torch.Tensor,
    rows: torch.Tensor,
    ratio: int,
    overlap: bool,
    *,
    pad: torch.Tensor | None = None,
    ape: torch.Tensor | None = None,
    groups: torch.Tensor | None = None,
    norm: torch.Tensor | None = None,
    rope_dim: int = 0,
    theta: float = 10000.0,
    eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Entries ``(B, d)`` of one group per request, its rows gathered from a ring (the decode
    path, as `adapters.forward.graph_decode.GraphKeys._compress` lays it out).

    ``ring`` ``(N, 2*c*d)`` holds rows ``[kv | score]`` (score normally already includes ``ape``:
    leave ``ape`` None); ``rows`` ``(B, R)`` are ring row indices, ``R = 2*ratio`` with overlap
    (previous group's rows first) else ``ratio``; ``pad`` ``(B, R)`` marks padding rows (kv 0,
    score -inf; their index is not read). ``groups`` ``(B,)`` gives the RoPE position
    ``groups * ratio`` of the epilogue."""
    b, r = rows.shape
    if r != (2 * ratio if overlap else ratio):
        raise ValueError(f"rows has {r} columns for ratio {ratio}, overlap {overlap}")
    width = ring.shape[1] // 2
    dt = _acc(ring)
    g = ring[rows.reshape(-1).long()].to(dt).view(b, r, 2 * width)
    kv, sc = g[..., :width], g[..., width:]
    if ape is not None:
        sc = sc + ape.to(dt).repeat(r // ratio, 1)[None]
    if pad is not None:
        kv = kv.masked_fill(pad[..., None], 0.0)
        sc = sc.masked_fill(pad[..., None], float("-inf"))
    pooled = _pool(kv, sc, overlap)
    if norm is not None:
        if groups is None:
            raise ValueError("the epilogue needs groups (the RoPE position is groups * ratio)")
        pooled = _epilogue(pooled, groups * ratio, norm, rope_dim, theta, eps)
    return pooled.to(out_dtype or ring.dtype)


def naive_torch_chain(
    kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int, overlap: bool
) -> torch.Tensor:
    """The unfused chain the model runs (``compressor_rows`` + ``pool_groups``): add the bias,
    concatenate, regroup, softmax over the group, weighted sum; every step a full HBM pass."""
    t, width = kv.shape
    g = t // ratio
    pos = torch.arange(g * ratio, device=kv.device)
    rows = torch.cat((kv[: g * ratio], score[: g * ratio] + ape[pos % ratio]), dim=-1)
    rows = rows.to(_acc(kv))
    rows = rows.view(g, ratio, 2 * width)
    if overlap:
        pad = torch.zeros_like(rows[:1])
        pad[..., width:] = float("-inf")
        rows = torch.cat((torch.cat((pad, rows[:-1]), 0), rows), dim=1)
    kvr, sr = rows[..., :width], rows[..., width:]
    if overlap:
        d = width // 2
        kvr = torch.cat((kvr[:, :ratio, :d], kvr[:, ratio:, d:]), dim=1)
        sr = torch.cat((sr[:, :ratio, :d], sr[:, ratio:, d:]), dim=1)
    return (torch.softmax(sr, dim=1) * kvr).sum(dim=1).to(kv.dtype)


def ordered_keys(scores: torch.Tensor) -> torch.Tensor:
    """Order-preserving unsigned keys of fp32 scores, as int64 in ``[0, 2**32)``: ``-0.0`` maps
    like ``+0.0``; ``-inf`` to ``0x007FFFFF``; every non-NaN value above ``0``."""
    bits = (scores.float() + 0.0).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits | 0x80000000)


def topk_reference(
    scores: torch.Tensor,
    k: int,
    lengths: torch.Tensor | None = None,
    *,
    sorted: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-``k`` of each row's valid prefix ``scores[b, :lengths[b]]`` (fp32 order; ``-0.0`` equals
    ``+0.0``; no NaN), ties broken by the LOWEST index.

    Returns ``(values (B, k) fp32, indices (B, k) int64, counts (B,) int32)``: ``counts[b] =
    min(k, lengths[b])`` entries are real; the rest are padding, index 0 and value -inf.
    Order of the real entries: by index ascending (``sorted=False``; the kernels may return the
    same set in another deterministic order), or by value descending with ties by index
    ascending (``sorted=True``, which the kernels match exactly).
    Each row is a stable descending sort of its valid prefix, cut at ``k``."""
    if scores.dim() != 2:
        raise ValueError("scores must be (B, N)")
    b, n = scores.shape
    dev = scores.device
    values = torch.full((b, k), float("-inf"), dtype=torch.float32, device=dev)
    indices = torch.zeros((b, k), dtype=torch.int64, device=dev)
    counts = torch.zeros((b,), dtype=torch.int32, device=dev)
    lens = [n] * b if lengths is None else [max(0, min(n, int(x))) for x in lengths.tolist()]
    for row, length in enumerate(lens):
        valid = scores[row, :length].float()
        # canonical -0.0 -> +0.0 so a GPU radix sort (bit patterns) agrees with comparisons
        order = torch.sort(valid + 0.0, descending=True, stable=True).indices[:k]
        if not sorted:
            order = torch.sort(order).values
        c = order.numel()
        indices[row, :c] = order
        values[row, :c] = valid[order]
        counts[row] = c
    return values, indices, counts
