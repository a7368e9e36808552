"""The Flash Compressor's kernel (the design: `compressor`): one program per block of
``BLOCK_G`` entries and ``BLOCK_D`` channels pools them (`compressor_pool`), then, with the
epilogue, RMSNorm over the whole entry and RoPE on its tail channels (each partner channel
taken with ``tl.gather``), and stores once."""

from __future__ import annotations

import triton
import triton.language as tl

from .compressor_pool import _pool

try:
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - older Triton
    from triton.language.extra.cuda import libdevice


@triton.jit
def _cos_sin(x, FAST: tl.constexpr):
    # cos/sin of fp32 angles up to ~1e6 rad: Cody-Waite reduction by 2*pi split in two fp32
    # parts (fp32(2*pi) = 2*pi + 1.7484555e-7), then cos/sin on [-pi, pi]: on the GPU with the
    # hardware approximations (abs error ~1e-6 there; every channel of the tile pays for them),
    # under the interpreter (no libdevice) with tl.cos/tl.sin.
    n = tl.floor(x * 0.15915494309189535 + 0.5)
    r = tl.fma(n, -6.2831854820251465, x)
    r = tl.fma(n, 1.7484555314695172e-07, r)
    if FAST:
        return libdevice.fast_cosf(r), libdevice.fast_sinf(r)
    return tl.cos(r), tl.sin(r)


@triton.jit
def _compress_kernel(
    kv_ptr,
    sc_ptr,
    ape_ptr,
    rows_ptr,
    pad_ptr,
    grp_ptr,
    norm_ptr,
    freq_ptr,
    out_ptr,
    G,
    stride_kv,
    stride_sc,
    stride_ape,
    stride_r,
    stride_out,
    group_offset,
    eps,
    DIM: tl.constexpr,
    RATIO: tl.constexpr,
    RT: tl.constexpr,
    RW: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    OVERLAP: tl.constexpr,
    GATHER: tl.constexpr,
    HAS_APE: tl.constexpr,
    HAS_PAD: tl.constexpr,
    EPILOGUE: tl.constexpr,
    HALF: tl.constexpr,
    UNROLL: tl.constexpr,
    FAST_TRIG: tl.constexpr,
):
    # every tensor is 4-D (entry, row warp, row, channel), size 1 where unused: one layout
    g = (tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G))[:, None, None, None]
    cols = (tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D))[None, None, None, :]
    g_ok = g < G
    c_ok = cols < DIM
    x = _pool(
        kv_ptr,
        sc_ptr,
        ape_ptr,
        rows_ptr,
        pad_ptr,
        g,
        g_ok,
        cols,
        c_ok,
        stride_kv,
        stride_sc,
        stride_ape,
        stride_r,
        DIM,
        RATIO,
        RT,
        RW,
        BLOCK_G,
        BLOCK_D,
        OVERLAP,
        GATHER,
        HAS_APE,
        HAS_PAD,
        UNROLL,
    )
    if EPILOGUE:  # BLOCK_D covers the entry: RMSNorm, then RoPE on the last 2*HALF channels
        x = tl.where(c_ok, x, 0.0)
        rstd = tl.rsqrt(tl.sum(x * x, axis=3, keep_dims=True) / DIM + eps)
        w = tl.load(norm_ptr + cols + g * 0, mask=c_ok, other=0.0).to(tl.float32)
        x = x * rstd * w
        if HALF > 0:
            cc = cols + g * 0  # (BG, 1, 1, BD)
            j = cc - (DIM - 2 * HALF)  # position in the RoPE tail
            in_a = (j >= 0) & (j < HALF)
            in_b = (j >= HALF) & (cc < DIM)
            partner = tl.where(in_a, cc + HALF, tl.where(in_b, cc - HALF, cc))
            xp = tl.gather(x, partner, axis=3)
            jj = tl.where(in_b, j - HALF, j)
            freq = tl.load(freq_ptr + jj, mask=in_a | in_b, other=0.0)
            if GATHER:
                grp = tl.load(grp_ptr + g, mask=g_ok, other=0)
            else:
                grp = g + group_offset
            cos, sin = _cos_sin((grp * RATIO).to(tl.float32) * freq, FAST_TRIG)
            x = tl.where(in_a, x * cos - xp * sin, tl.where(in_b, xp * sin + x * cos, x))
    out = out_ptr + g.to(tl.int64) * stride_out + cols
    tl.store(out, x.to(out_ptr.dtype.element_ty), mask=g_ok & c_ok)
