"""The PyTorch reference of the fused indexer (`adapters.kernels.index_logits`).

Lightning-indexer logits of queries over pool rows read through a `PoolRows`::

    logits[n, g] = sum_h w[n, h] * relu(q[n, h] . key(slot(n, g)))   for g < lengths[n]
                 = -inf                                               otherwise

fp64 inputs compute in fp64, everything else in fp32 (16-bit and quantised keys are upcast:
the Triton kernel accumulates in fp32 too). FP8 keys (``torch.float8_e4m3fn``) come with one
fp32 scale per pool row, ``key = fp8 * scale``; FP4 keys (V4.1: e2m1 codes packed two per
byte, ``(S, d / 2)`` uint8) with one fp32 scale per 32 channels, ``(S, d / 32)``
(`adapters.memory.formats`). The reference gathers the keys of a tile of queries at a time
(``tile_bytes`` of gathered keys), so its memory is bounded by the tile, never ``N x G x d``;
the per-query arithmetic is the model's `ops.index_scores` (bit for bit in fp64).
"""

from __future__ import annotations

import torch

from adapters.memory.formats import CacheFormat, QuantizedRows, dequantize

from .rows import PoolRows

FP8_DTYPES = (torch.float8_e4m3fn,)
#: FP4 (e2m1) keys are packed two per byte, with one fp32 scale per 32 channels
FP4_DTYPE = torch.uint8


def dequantize_keys(keys: torch.Tensor, key_scale: torch.Tensor | None, dt: torch.dtype):
    """Pool rows in ``dt``: FP8 rows times their scale, FP4 rows unpacked (`formats`) times
    their block scales, anything else cast."""
    if keys.dtype in FP8_DTYPES:
        if key_scale is None:
            raise ValueError("FP8 keys need key_scale (one fp32 scale per pool row)")
        return keys.to(dt) * key_scale.to(dt)[..., None]
    if keys.dtype == FP4_DTYPE:
        if key_scale is None or key_scale.dim() != keys.dim():
            raise ValueError("FP4 keys need key_scale with one fp32 scale per 32 channels")
        return dequantize(QuantizedRows(CacheFormat.FP4, keys, key_scale), dt)
    return keys.to(dt)


def round_q_e4m3(q: torch.Tensor) -> torch.Tensor:
    """``q`` ``(..., d)`` as V4's FP8 indexer queries, in fp32 (fp64 for fp64 ``q``): each
    head's vector scaled by the power of two ``2**a`` that puts its largest magnitude in
    ``[2**7, 2**8)``, rounded to the nearest e4m3 value (ties to even; below 2**-6 the
    format's subnormal steps of 2**-9) and scaled back. The kernel's ``Fp8Mode.FP8_Q`` rounds
    alike (it keeps the scale in the head weights instead: the same products)."""
    x = q.float()
    _, e = torch.frexp(x.abs().amax(-1, keepdim=True))  # max = m 2**e, m in [0.5, 1)
    a = (8 - e).clamp(-100, 100)  # 7 - floor(log2 max)
    r = torch.ldexp(torch.ldexp(x, a).to(torch.float8_e4m3fn).float(), -a)
    return r.double() if q.dtype == torch.float64 else r


def index_logits_reference(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: torch.Tensor,
    rows: PoolRows,
    *,
    key_scale: torch.Tensor | None = None,
    fp8_q: bool = False,
    tile_bytes: int = 1 << 28,
) -> torch.Tensor:
    """``(N, G)`` logits (fp32, fp64 for fp64 ``q``) of ``q`` ``(N, H, d)`` with head weights
    ``w`` ``(N, H)`` over ``keys`` ``(S, d)`` read through ``rows``; -inf past each length.
    ``fp8_q``: q rounded to e4m3 first (`round_q_e4m3`)."""
    if fp8_q:
        q = round_q_e4m3(q)
    n, _, d = q.shape
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    g = rows.num_rows
    out = torch.full((n, g), float("-inf"), dtype=dt, device=q.device)
    step = max(1, tile_bytes // max(1, g * d * torch.finfo(dt).bits // 8))
    for a in range(0, n, step):
        part = rows.select(slice(a, a + step))
        slots = part.slots()
        scale = None if key_scale is None else key_scale[slots]
        k = dequantize_keys(keys[slots], scale, dt)  # (t, G, d)
        dots = torch.einsum("nhd,ned->nhe", q[a : a + step].to(dt), k)
        logits = torch.einsum("nh,nhe->ne", w[a : a + step].to(dt), torch.relu(dots))
        out[a : a + step] = logits.masked_fill(~part.mask(), float("-inf"))
    return out
