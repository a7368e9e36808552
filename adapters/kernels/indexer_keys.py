"""The key side of the fused indexer's tiles (`indexer`): pool slots through the table
(`_slots`) and key tiles with their scales (`_keys`): 16-bit, fp32 and FP8 rows as loaded,
FP4 rows (V4.1, `adapters.memory.formats`) unpacked from their e2m1 nibbles and multiplied by their
block scales (`_fp4_tile`). Triton device functions only.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _slots(tab_row, e0, stop, SPP: tl.constexpr, BLOCK_E: tl.constexpr):
    """Pool slots ``(BLOCK_E,)`` of rows ``e0 ..`` (slot 0 from ``stop`` on)."""
    g = e0 + tl.arange(0, BLOCK_E)
    page = tl.load(tab_row + g // SPP, mask=g < stop, other=0).to(tl.int64)
    return page * SPP + g % SPP


@triton.jit
def _keys(k_ptr, sc_ptr, slot, e0, stop, stride_k, dd, D: tl.constexpr, BLOCK_E: tl.constexpr,
          HAS_SCALE: tl.constexpr, FP4: tl.constexpr):  # fmt: skip
    """Keys ``(BLOCK_E, DP)`` and row scales of rows ``e0 ..`` at ``slot`` (zeros from
    ``stop``). FP4 (``FP4``): fp32 values, block scales applied (`_fp4_tile`); its row scales
    are ones (``HAS_SCALE`` is for FP8's one scale per row, applied after the dot)."""
    g_ok = e0 + tl.arange(0, BLOCK_E) < stop
    if FP4:
        k = _fp4_tile(k_ptr, sc_ptr, slot, g_ok, stride_k, D, dd.shape[0])
    else:
        k_msk = g_ok[:, None] & (dd[None, :] < D)
        k = tl.load(k_ptr + slot[:, None] * stride_k + dd[None, :], mask=k_msk, other=0.0)
    if HAS_SCALE:
        sc = tl.load(sc_ptr + slot, mask=g_ok, other=0.0).to(tl.float32)
    else:
        sc = tl.full((BLOCK_E,), 1.0, tl.float32)
    return k, sc


@triton.jit
def _e2m1(c):
    """fp32 values of the e2m1 codes ``c`` (int32, 0-15): exponent field ``e = (c >> 1) & 3``,
    mantissa bit ``m = c & 1``, bit 3 the sign. Built as fp32 bits, no table: ``e == 0`` is
    ``m / 2`` (0 or 0.5), else ``(1 + m / 2) * 2**(e - 1)`` (1, 1.5, 2, 3, 4, 6)."""
    e = (c >> 1) & 3
    m = c & 1
    bits = tl.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22))
    v = bits.to(tl.float32, bitcast=True)
    return tl.where((c & 8) != 0, -v, v)


@triton.jit
def _fp4_tile(k_ptr, sc_ptr, slot, g_ok, stride_k, D: tl.constexpr, DP: tl.constexpr):
    """FP4 keys ``(BLOCK_E, DP)`` in fp32, in channel order: byte ``j`` of a row holds channel
    ``2j`` (low nibble) and ``2j + 1``, both in block ``j // 16`` of its ``D // 32`` fp32
    scales (``key_scale`` contiguous). Grid values times power-of-two scales: exact in fp32
    and in bf16 (2 significant bits; a product below bf16's subnormals excepted)."""
    j = tl.arange(0, DP // 2)
    msk = g_ok[:, None] & (j[None, :] < D // 2)
    b = tl.load(k_ptr + slot[:, None] * stride_k + j[None, :], mask=msk, other=0).to(tl.int32)
    sc = tl.load(sc_ptr + slot[:, None] * (D // 32) + j[None, :] // 16, mask=msk, other=0.0)
    sc = sc.to(tl.float32)
    return tl.interleave(_e2m1(b & 15) * sc, _e2m1(b >> 4) * sc)
