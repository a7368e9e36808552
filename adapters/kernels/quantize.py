"""Fused FP8 (e4m3) quantise-and-store of pool rows: one launch where `formats.write_rows`
takes about twenty torch ops (amax, frexp, where, clamp, the grid rounding, the casts, two
scatters). A decode step writes a few rows per layer, so those launches, not bytes, are the
FP8 formats' cost; one program per row does it here.

Bit for bit `formats.quantize` (its rounding defines the result):

* the row's scale is the smallest power of two ``2**k`` with ``amax <= 448 * 2**k``, ``k`` in
  ``[-126, 127]``, 1 for an all-zero row, NaN for a row with a non-finite value;
* each value ``v = x / scale`` (exact: a product with ``2**-k``; Triton's fp32 division is
  approximate, so the kernel never divides) rounds to nearest, ties to even, onto the e4m3 grid:
  step ``2**(max(floor(log2 |v|), -6) - 3)``; the integer rounding is the fp32 ``1.5 * 2**23``
  trick (exact for the ``|v / step| < 16`` here);
* the e4m3 byte is built from the rounded value's fp32 bits (exponent + 7, top three mantissa
  bits; below ``2**-6`` the subnormal ``|r| * 512``) and ``v``'s sign (a negative value that
  rounds to zero is -0, as in torch), stored through a uint8 view of the pool, so no float8
  cast is involved (the interpreter has none to trust).

Importing this module imports Triton; `adapters.kernels` imports it only for a CUDA tensor (or
a test under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: 1.5 * 2**23: fp32 addition rounds |t| < 2**22 to an integer, ties to even
_RINT = tl.constexpr(12582912.0)


@triton.jit
def _fp8_store_kernel(x_ptr, slot_ptr, val_ptr, scale_ptr, D, stride_x, stride_v,
                      BLOCK_D: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + d, mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    bits = amax.to(tl.int32, bitcast=True)
    # frexp: amax = m * 2**e, m in [0.5, 1); k = e - 9 + (m > 0.875), 448 = 0.875 * 2**9
    k = ((bits >> 23) & 0xFF) - 126 - 9 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    k = tl.where(amax == 0, 0, tl.maximum(k, -126))
    # tl.max may drop NaNs (the GPU's max does): look for them explicitly
    finite = (amax < float("inf")) & (tl.sum((x != x).to(tl.int32), axis=0) == 0)
    k = tl.minimum(k, 127)
    scale = tl.where(finite, ((k + 127) << 23).to(tl.float32, bitcast=True), float("nan"))
    # products with exact powers of two, never a division (Triton's fp32 division is approximate)
    inv_scale = ((127 - k) << 23).to(tl.float32, bitcast=True)
    v = tl.where(finite, x * inv_scale, 0.0)  # a non-finite row: codes 0, the NaN in its scale
    vbits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((vbits >> 23) & 0xFF) - 127, -6) - 3  # the grid step is 2**e
    step = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - e) << 23).to(tl.float32, bitcast=True)
    r = ((v * inv_step + _RINT) - _RINT) * step
    rbits = r.to(tl.int32, bitcast=True)
    mag = tl.abs(r)
    normal = (((rbits >> 23) & 0xFF) - 127 + 7) * 8 + ((rbits >> 20) & 7)
    code = tl.where(mag >= 0.015625, normal, (mag * 512.0).to(tl.int32))
    code = code | tl.where(vbits < 0, 0x80, 0)  # v's sign: a negative v rounding to 0 is -0
    slot = tl.load(slot_ptr + row).to(tl.int64)
    tl.store(val_ptr + slot * stride_v + d, code.to(tl.uint8), mask=ok)
    tl.store(scale_ptr + slot, scale)


def fp8_store(
    values: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, x: torch.Tensor
) -> None:
    """Quantises ``x`` ``(N, d)`` (fp32 / bf16) to e4m3 and stores row ``i`` at ``slots[i]``
    of the pool (``values`` ``(S, d)`` float8_e4m3fn, ``scales`` ``(S,)`` fp32), in place, as
    `formats.write_rows` does (same bytes, same scales; repeated slots: one of the rows lands).
    Raises `ValueError` for other dtypes or shapes."""
    if values.dtype != torch.float8_e4m3fn or scales.dtype != torch.float32:
        raise ValueError("values must be float8_e4m3fn and scales fp32")
    if x.dim() != 2 or slots.shape != x.shape[:1] or values.shape[1:] != x.shape[1:]:
        shapes = f"x {tuple(x.shape)}, slots {tuple(slots.shape)}, pool {tuple(values.shape)}"
        raise ValueError(f"{shapes}: x must be (N, d) for N slots of an (S, d) pool")
    if x.dtype not in (torch.float32, torch.bfloat16) or values.stride(1) != 1:
        raise ValueError("x must be fp32 or bf16 and the pool contiguous along d")
    if x.shape[0] == 0:
        return
    x = x if x.stride(1) == 1 else x.contiguous()
    d = x.shape[1]
    _fp8_store_kernel[(x.shape[0],)](
        x, slots.contiguous(), values.view(torch.uint8), scales, d, x.stride(0),
        values.stride(0), BLOCK_D=max(16, triton.next_power_of_2(d)),
    )  # fmt: skip
