"""The Flash Compressor's pooling (the design: `compressor`): an entry's virtual rows loaded
chunk by chunk, tiles ``(BLOCK_G, RW, RT, BLOCK_D)`` in the load's own layout, an online
softmax in base 2 over them (fp32 state), and the ``RW`` partial states merged once."""

from __future__ import annotations

import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _load_chunk(
    c0,
    kv_ptr,
    sc_ptr,
    ape_ptr,
    rows_ptr,
    pad_ptr,
    g,
    g_ok,
    cols,
    col_ok,
    stride_kv,
    stride_sc,
    stride_ape,
    stride_r,
    DIM: tl.constexpr,
    RATIO: tl.constexpr,
    NV: tl.constexpr,
    RT: tl.constexpr,
    RW: tl.constexpr,
    OVERLAP: tl.constexpr,
    GATHER: tl.constexpr,
    HAS_APE: tl.constexpr,
    HAS_PAD: tl.constexpr,
):
    """Virtual rows ``c0 .. c0 + RW*RT`` of the entries ``g``, as loaded (input dtype):
    ``kv``, ``score`` (-inf on padding) and the bias (0 without one).

    Tiles are ``(BLOCK_G, RW, RT, BLOCK_D)``: ``g``/``g_ok`` ``(BG, 1, 1, 1)``, ``cols``/``col_ok``
    ``(1, 1, 1, BD)``. The axis order matters: Triton gives the channel axis the lanes, then the
    entry axis, then ``RW`` the remaining warps, and leaves ``RT`` (last among equals) inside
    each thread, so the reductions over it need no communication."""
    v = (
        c0 + tl.arange(0, RW)[None, :, None, None] * RT + tl.arange(0, RT)[None, None, :, None]
    )  # (1, RW, RT, 1) virtual rows
    v_ok = v < NV
    if OVERLAP:
        second = v >= RATIO
        ch = cols + tl.where(second, DIM, 0)  # (1, RW, RT, BD) input channels
        ape_r = v - tl.where(second, RATIO, 0)
    else:
        ch = cols
        ape_r = v
    if GATHER:
        off = g.to(tl.int64) * stride_r + v  # (BG, RW, RT, 1)
        ok = g_ok & v_ok
        row = tl.load(rows_ptr + off, mask=ok, other=0).to(tl.int64)
        if HAS_PAD:
            ok = ok & (tl.load(pad_ptr + off, mask=ok, other=1) == 0)
    else:
        row = g.to(tl.int64) * RATIO + v
        if OVERLAP:
            row = row - RATIO  # group -1 is padding
        ok = g_ok & v_ok & (row >= 0)
    msk = ok & col_ok
    kv = tl.load(kv_ptr + row * stride_kv + ch, mask=msk, other=0.0)
    s = tl.load(sc_ptr + row * stride_sc + ch, mask=msk, other=float("-inf"))
    if HAS_APE:
        a = tl.load(ape_ptr + ape_r * stride_ape + ch + g * 0, mask=msk, other=0.0)
    else:
        a = tl.zeros_like(s)
    return kv, s, a


@triton.jit
def _update(m, lsum, acc, kv, s, a, HAS_APE: tl.constexpr):
    """One online-softmax step over a loaded chunk; the state is ``(BG, RW, 1, BD)``."""
    kv = kv.to(tl.float32)
    s = s.to(tl.float32)
    if HAS_APE:
        s = s + a.to(tl.float32)
    s = s * 1.4426950408889634  # log2(e): softmax in base 2
    m_new = tl.maximum(m, tl.max(s, axis=2, keep_dims=True))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing real yet: no NaN
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s - m_use)
    lsum = lsum * alpha + tl.sum(p, axis=2, keep_dims=True)
    acc = acc * alpha + tl.sum(p * kv, axis=2, keep_dims=True)
    return m_new, lsum, acc


@triton.jit
def _pool(
    kv_ptr,
    sc_ptr,
    ape_ptr,
    rows_ptr,
    pad_ptr,
    g,
    g_ok,
    cols,
    col_ok,
    stride_kv,
    stride_sc,
    stride_ape,
    stride_r,
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
    UNROLL: tl.constexpr,
):
    """Pooled entries ``(BLOCK_G, 1, 1, BLOCK_D)``, fp32, on channels ``cols`` (NaN where
    masked)."""
    NV: tl.constexpr = RATIO * 2 if OVERLAP else RATIO
    CH: tl.constexpr = RT * RW
    m = tl.full((BLOCK_G, RW, 1, BLOCK_D), float("-inf"), tl.float32)
    lsum = tl.zeros((BLOCK_G, RW, 1, BLOCK_D), tl.float32)
    acc = tl.zeros((BLOCK_G, RW, 1, BLOCK_D), tl.float32)
    if UNROLL:  # straight-line code: the compiler issues the chunks' loads early by itself
        for c0 in tl.static_range(0, NV, CH):
            kv, s, a = _load_chunk(
                c0, kv_ptr, sc_ptr, ape_ptr, rows_ptr, pad_ptr, g, g_ok, cols, col_ok,
                stride_kv, stride_sc, stride_ape, stride_r, DIM, RATIO, NV, RT, RW, OVERLAP,
                GATHER, HAS_APE, HAS_PAD,
            )  # fmt: skip
            m, lsum, acc = _update(m, lsum, acc, kv, s, a, HAS_APE)
    else:  # a loop, software-pipelined by hand: the next chunk's loads fly during this update
        kv, s, a = _load_chunk(
            0, kv_ptr, sc_ptr, ape_ptr, rows_ptr, pad_ptr, g, g_ok, cols, col_ok, stride_kv,
            stride_sc, stride_ape, stride_r, DIM, RATIO, NV, RT, RW, OVERLAP, GATHER, HAS_APE,
            HAS_PAD,
        )  # fmt: skip
        for c0 in range(0, NV, CH):
            # (past the last chunk every lane is masked: no traffic)
            kv_n, s_n, a_n = _load_chunk(
                c0 + CH, kv_ptr, sc_ptr, ape_ptr, rows_ptr, pad_ptr, g, g_ok, cols, col_ok,
                stride_kv, stride_sc, stride_ape, stride_r, DIM, RATIO, NV, RT, RW, OVERLAP,
                GATHER, HAS_APE, HAS_PAD,
            )  # fmt: skip
            m, lsum, acc = _update(m, lsum, acc, kv, s, a, HAS_APE)
            kv, s, a = kv_n, s_n, a_n
    if RW == 1:
        return acc / lsum
    # merge the RW partial states (once per program)
    mt = tl.max(m, axis=1, keep_dims=True)
    mt = tl.where(mt == float("-inf"), 0.0, mt)
    w = tl.exp2(m - mt)
    return tl.sum(acc * w, axis=1, keep_dims=True) / tl.sum(lsum * w, axis=1, keep_dims=True)
