"""RoPE and RMSNorm in one launch each: the position-local maths a decode step calls most.

Maths: `adapters.model.ops.rope_reference` and `adapters.model.ops.rms_norm_reference`, which
define the results (fp64, CPU tensors and anything autograd differentiates always run them).

A decode step of the tiny model is launch-bound: 1,129 kernels of 1.4 µs on average on the H200
(docs/benchmarks.md, `bench/spec_profile.py`), and the torch chain of one RoPE call is about
twenty of them (the frequencies, the angles, cos and sin, the halves, the products, two
concatenations, the casts), of one RMSNorm six; RoPE runs on every query, latent, attention
output and compressed entry.

* `flash_rope`: rotates the last ``rope_dim`` channels of every row of ``x`` ``(N, ..., dim)``
  by the angle of its token's position; the reference's fp32 frequencies ``theta ** (-j /
  half)`` (the same bits), the angles in fp32, one rounding to ``x``'s dtype. In place, or
  into a new tensor (the other channels copied by the same launch).
* `flash_rms_norm`: ``x * rsqrt(mean(x^2) + eps) * weight`` per row of the last dimension, in
  fp32, one rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(
    x_ptr, pos_ptr, freq_ptr, out_ptr, R, H, stride_x, stride_o, rot0, sign,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
    COPY: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok_r = r < R
    r64 = r.to(tl.int64)
    pos = tl.load(pos_ptr + r // H, mask=ok_r, other=0).to(tl.float32)
    j = tl.arange(0, BLOCK_H)
    ok_j = j < HALF
    freq = tl.load(freq_ptr + j, mask=ok_j, other=0.0)
    ang = pos[:, None] * freq[None, :]
    cos, sin = tl.cos(ang), sign * tl.sin(ang)
    ok = ok_r[:, None] & ok_j[None, :]
    xa = x_ptr + r64[:, None] * stride_x + rot0 + j[None, :]
    a = tl.load(xa, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(xa + HALF, mask=ok, other=0.0).to(tl.float32)
    oa = out_ptr + r64[:, None] * stride_o + rot0 + j[None, :]
    dt = out_ptr.dtype.element_ty
    tl.store(oa, (a * cos - b * sin).to(dt), mask=ok)
    tl.store(oa + HALF, (a * sin + b * cos).to(dt), mask=ok)
    if COPY:  # the channels before the rotated ones, into the new tensor
        for c0 in range(0, rot0, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            okc = ok_r[:, None] & (c < rot0)[None, :]
            v = tl.load(x_ptr + r64[:, None] * stride_x + c[None, :], mask=okc, other=0.0)
            tl.store(out_ptr + r64[:, None] * stride_o + c[None, :], v, mask=okc)


@triton.jit
def _rms_kernel(x_ptr, w_ptr, out_ptr, D, stride_x, stride_o, eps, BLOCK_D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    x = tl.load(x_ptr + r * stride_x + d, mask=ok, other=0.0).to(tl.float32)
    ms = tl.sum(x * x, axis=0) / D
    w = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
    y = x * (1.0 / tl.sqrt(ms + eps)) * w
    tl.store(out_ptr + r * stride_o + d, y.to(out_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as ``(rows, dim)`` without a copy, or None where its strides do not allow it."""
    if x.stride(-1) != 1:
        return None
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:  # a view across non-mergeable strides
        return None


_FREQS: dict[tuple[int, float, torch.device], torch.Tensor] = {}


def _freqs(half: int, theta: float, device: torch.device) -> torch.Tensor:
    """``theta ** (-j / half)`` in fp32, computed as `ops.rope_reference` computes it (the same
    bits, so the angles are too); cached per device, except while a CUDA graph is captured
    (a tensor made then holds its values only inside the graph's replays)."""
    key = (half, theta, device)
    if key in _FREQS:
        return _FREQS[key]
    freqs = theta ** (-torch.arange(half, device=device, dtype=torch.float32) / half)
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        _FREQS[key] = freqs
    return freqs


def flash_rope(
    x: torch.Tensor, positions: torch.Tensor, rope_dim: int, theta: float, inverse: bool,
    inplace: bool, *, block_r: int = 16,
) -> torch.Tensor | None:  # fmt: skip
    """`ops.rope_reference`'s result in one launch; None when ``x``'s layout does not fit (a
    strided last dimension, rows that cannot be viewed flat): the caller runs the reference."""
    rows = _rows(x)
    if rows is None or rope_dim % 2 or rope_dim > x.shape[-1]:
        return None
    n, dim = x.shape[0], x.shape[-1]
    r = rows.shape[0]
    heads = r // max(1, n)
    out = x if inplace else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    orows = rows if inplace else out.view(-1, dim)
    half = rope_dim // 2
    if r:
        grid = (triton.cdiv(r, block_r),)
        _rope_kernel[grid](
            rows, positions.contiguous(), _freqs(half, theta, x.device), orows, r, heads,
            rows.stride(0), orows.stride(0), dim - rope_dim, -1.0 if inverse else 1.0,
            HALF=half, BLOCK_H=triton.next_power_of_2(half),
            BLOCK_R=block_r, COPY=not inplace,
            BLOCK_C=min(128, triton.next_power_of_2(max(1, dim - rope_dim))), num_warps=4,
        )  # fmt: skip
    return out


def flash_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """`ops.rms_norm_reference`'s result in one launch; None when ``x``'s layout does not fit."""
    rows = _rows(x)
    if rows is None or weight.shape != (x.shape[-1],):
        return None
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    orows = out.view(-1, x.shape[-1])
    if rows.shape[0]:
        d = x.shape[-1]
        _rms_kernel[(rows.shape[0],)](rows, weight.contiguous(), orows, d, rows.stride(0),
                                      orows.stride(0), eps, BLOCK_D=triton.next_power_of_2(d),
                                      num_warps=4 if d <= 2048 else 8)  # fmt: skip
    return out
