"""Flash Compressor: the compressor's read -> add bias -> softmax over the group -> weighted sum
(-> RMSNorm -> RoPE) chain fused into one Triton pass.

Maths and conventions: `adapters.kernels.reference` (``compress_reference`` for the prefill path,
``compress_gathered_reference`` for the decode path). Design, for bandwidth:

* one program per (block of ``BLOCK_G`` groups, block of ``BLOCK_D`` channels); every input byte
  is read once: with the C4 overlap a token row's first half feeds entry ``g+1`` and its second
  half entry ``g``, so the program of entry ``g`` reads group ``g``'s second halves and group
  ``g-1``'s first halves;
* tiles ``(BLOCK_G, RC, BLOCK_D)`` (``RC`` rows of each group at a time), contiguous along the
  channels (vector loads), cast to fp32 right after loading;
* an online softmax over the group axis in registers (running max, sum, weighted sum), base 2;
  nothing intermediate goes to HBM;
* optional epilogue (``norm`` given): the program holds whole entries (no channel split) and
  applies RMSNorm and RoPE before the single store.

Importing this module imports Triton and defines the kernels; `adapters.kernels` imports it only
when a CUDA tensor (or a test under ``TRITON_INTERPRET=1``) needs it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["flash_compress", "flash_compress_gathered"]


@triton.jit
def _cos_sin(x):
    # cos/sin of fp32 angles up to ~1e6 rad: Cody-Waite reduction by 2*pi split in two fp32
    # parts (fp32(2*pi) = 2*pi + 1.7484555e-7), then cos/sin on [-pi, pi].
    n = tl.floor(x * 0.15915494309189535 + 0.5)
    r = tl.fma(n, -6.2831854820251465, x)
    r = tl.fma(n, 1.7484555314695172e-07, r)
    return tl.cos(r), tl.sin(r)


@triton.jit
def _rows(
    g,
    g_ok,
    c,
    rows_ptr,
    pad_ptr,
    stride_r,
    BASE: tl.constexpr,
    PREV: tl.constexpr,
    RATIO: tl.constexpr,
    RC: tl.constexpr,
    GATHER: tl.constexpr,
    HAS_PAD: tl.constexpr,
):
    """Row indices (BLOCK_G, RC) of rows ``c .. c+RC`` of each group, and which are real."""
    i = c + tl.arange(0, RC)
    if GATHER:
        off = g.to(tl.int64)[:, None] * stride_r + BASE + i[None, :]
        ok = g_ok[:, None] & (i[None, :] < RATIO)
        row = tl.load(rows_ptr + off, mask=ok, other=0).to(tl.int64)
        if HAS_PAD:
            p = tl.load(pad_ptr + off, mask=ok, other=1)
            ok = ok & (p == 0)
    else:
        row = g.to(tl.int64)[:, None] * RATIO + i[None, :]
        if PREV:
            row = row - RATIO
        ok = g_ok[:, None] & (row >= 0)
    return row, ok


@triton.jit
def _accumulate(
    m,
    lsum,
    acc,
    kv_ptr,
    sc_ptr,
    ape_ptr,
    row,
    ok,
    ape_row,
    cols,
    col_ok,
    stride_kv,
    stride_sc,
    stride_ape,
    HAS_APE: tl.constexpr,
):
    """One online-softmax step over the rows ``row`` (BLOCK_G, RC) on channels ``cols``."""
    msk = ok[:, :, None] & col_ok[None, None, :]
    kv = tl.load(kv_ptr + row[:, :, None] * stride_kv + cols[None, None, :], mask=msk, other=0.0)
    s = tl.load(
        sc_ptr + row[:, :, None] * stride_sc + cols[None, None, :], mask=msk, other=float("-inf")
    )
    kv = kv.to(tl.float32)
    s = s.to(tl.float32)
    if HAS_APE:
        a = tl.load(
            ape_ptr + ape_row[:, None] * stride_ape + cols[None, :], mask=col_ok[None, :], other=0.0
        )
        s = s + a.to(tl.float32)[None, :, :]
    s = s * 1.4426950408889634  # log2(e): softmax in base 2
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-padding so far: no NaN
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s - m_use[:, None, :])
    lsum = lsum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha + tl.sum(p * kv, axis=1)
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
    RC: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BC: tl.constexpr,
    OVERLAP: tl.constexpr,
    GATHER: tl.constexpr,
    HAS_APE: tl.constexpr,
    HAS_PAD: tl.constexpr,
):
    """Pooled entries (BLOCK_G, BC) in fp32 on entry channels ``cols``."""
    m = tl.full((BLOCK_G, BC), float("-inf"), tl.float32)
    lsum = tl.zeros((BLOCK_G, BC), tl.float32)
    acc = tl.zeros((BLOCK_G, BC), tl.float32)
    for c in tl.static_range(0, RATIO, RC):
        ape_row = c + tl.arange(0, RC)
        if OVERLAP:
            # this group's rows on the second-half channels ...
            row, ok = _rows(
                g, g_ok, c, rows_ptr, pad_ptr, stride_r, RATIO, False, RATIO, RC, GATHER, HAS_PAD
            )
            m, lsum, acc = _accumulate(
                m,
                lsum,
                acc,
                kv_ptr,
                sc_ptr,
                ape_ptr,
                row,
                ok,
                ape_row,
                cols + DIM,
                col_ok,
                stride_kv,
                stride_sc,
                stride_ape,
                HAS_APE,
            )
            # ... and the previous group's rows on the first-half channels
            row, ok = _rows(
                g, g_ok, c, rows_ptr, pad_ptr, stride_r, 0, True, RATIO, RC, GATHER, HAS_PAD
            )
            m, lsum, acc = _accumulate(
                m,
                lsum,
                acc,
                kv_ptr,
                sc_ptr,
                ape_ptr,
                row,
                ok,
                ape_row,
                cols,
                col_ok,
                stride_kv,
                stride_sc,
                stride_ape,
                HAS_APE,
            )
        else:
            row, ok = _rows(
                g, g_ok, c, rows_ptr, pad_ptr, stride_r, 0, False, RATIO, RC, GATHER, HAS_PAD
            )
            m, lsum, acc = _accumulate(
                m,
                lsum,
                acc,
                kv_ptr,
                sc_ptr,
                ape_ptr,
                row,
                ok,
                ape_row,
                cols,
                col_ok,
                stride_kv,
                stride_sc,
                stride_ape,
                HAS_APE,
            )
    return acc / lsum


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
    RC: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    OVERLAP: tl.constexpr,
    GATHER: tl.constexpr,
    HAS_APE: tl.constexpr,
    HAS_PAD: tl.constexpr,
    EPILOGUE: tl.constexpr,
    NOPE_BLOCK: tl.constexpr,
    HALF: tl.constexpr,
):
    g = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    g_ok = g < G
    out_row = out_ptr + g.to(tl.int64)[:, None] * stride_out
    if EPILOGUE:
        # whole entries: the no-RoPE channels, then the two halves of the RoPE tail
        cn = tl.arange(0, NOPE_BLOCK)
        cn_ok = cn < DIM - 2 * HALF
        xn = _pool(
            kv_ptr,
            sc_ptr,
            ape_ptr,
            rows_ptr,
            pad_ptr,
            g,
            g_ok,
            cn,
            cn_ok,
            stride_kv,
            stride_sc,
            stride_ape,
            stride_r,
            DIM,
            RATIO,
            RC,
            BLOCK_G,
            NOPE_BLOCK,
            OVERLAP,
            GATHER,
            HAS_APE,
            HAS_PAD,
        )
        xn = tl.where(cn_ok[None, :], xn, 0.0)
        ss = tl.sum(xn * xn, axis=1)
        if HALF > 0:
            ca = DIM - 2 * HALF + tl.arange(0, HALF)
            cb = ca + HALF
            c_ok = ca < DIM
            xa = _pool(
                kv_ptr,
                sc_ptr,
                ape_ptr,
                rows_ptr,
                pad_ptr,
                g,
                g_ok,
                ca,
                c_ok,
                stride_kv,
                stride_sc,
                stride_ape,
                stride_r,
                DIM,
                RATIO,
                RC,
                BLOCK_G,
                HALF,
                OVERLAP,
                GATHER,
                HAS_APE,
                HAS_PAD,
            )
            xb = _pool(
                kv_ptr,
                sc_ptr,
                ape_ptr,
                rows_ptr,
                pad_ptr,
                g,
                g_ok,
                cb,
                c_ok,
                stride_kv,
                stride_sc,
                stride_ape,
                stride_r,
                DIM,
                RATIO,
                RC,
                BLOCK_G,
                HALF,
                OVERLAP,
                GATHER,
                HAS_APE,
                HAS_PAD,
            )
            ss += tl.sum(xa * xa, axis=1) + tl.sum(xb * xb, axis=1)
        rstd = tl.rsqrt(ss / DIM + eps)[:, None]
        wn = tl.load(norm_ptr + cn, mask=cn_ok, other=0.0).to(tl.float32)
        yn = xn * rstd * wn[None, :]
        st_ok = g_ok[:, None] & cn_ok[None, :]
        tl.store(out_row + cn[None, :], yn.to(out_ptr.dtype.element_ty), mask=st_ok)
        if HALF > 0:
            ya = xa * rstd * tl.load(norm_ptr + ca).to(tl.float32)[None, :]
            yb = xb * rstd * tl.load(norm_ptr + cb).to(tl.float32)[None, :]
            if GATHER:
                grp = tl.load(grp_ptr + g, mask=g_ok, other=0)
            else:
                grp = g + group_offset
            pos = (grp * RATIO).to(tl.float32)
            freq = tl.load(freq_ptr + tl.arange(0, HALF))
            cos, sin = _cos_sin(pos[:, None] * freq[None, :])
            st_ok = g_ok[:, None] & c_ok[None, :]
            ra = ya * cos - yb * sin
            rb = ya * sin + yb * cos
            tl.store(out_row + ca[None, :], ra.to(out_ptr.dtype.element_ty), mask=st_ok)
            tl.store(out_row + cb[None, :], rb.to(out_ptr.dtype.element_ty), mask=st_ok)
    else:
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        col_ok = cols < DIM
        x = _pool(
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
            DIM,
            RATIO,
            RC,
            BLOCK_G,
            BLOCK_D,
            OVERLAP,
            GATHER,
            HAS_APE,
            HAS_PAD,
        )
        tl.store(
            out_row + cols[None, :],
            x.to(out_ptr.dtype.element_ty),
            mask=g_ok[:, None] & col_ok[None, :],
        )


def _pow2_divisor(n: int, cap: int) -> int:
    r = 1
    while r * 2 <= cap and n % (r * 2) == 0:
        r *= 2
    return r


@functools.lru_cache(maxsize=32)
def _freqs(theta: float, half: int, device: str) -> torch.Tensor:
    # bit-identical to `adapters.ops.rope`'s frequencies on the same device
    return theta ** (-torch.arange(half, device=device, dtype=torch.float32) / half)


def _config(
    ratio: int,
    overlap: bool,
    dim: int,
    epilogue: bool,
    n_groups: int,
    block_g,
    block_d,
    rows_chunk,
    num_warps,
):
    """Launch shape: rows per chunk, groups and channels per program, warps (overridable)."""
    rc = rows_chunk or _pow2_divisor(ratio, 4 if ratio <= 8 else 16)
    if ratio % rc or rc & (rc - 1):
        raise ValueError(f"rows_chunk {rc} must be a power of two dividing ratio {ratio}")
    if epilogue:
        bd = 0
        bg = block_g or 1
        warps = num_warps or (4 if ratio <= 8 else 8)
    else:
        bd = block_d or min(128, triton.next_power_of_2(dim))
        bg = block_g or (1 if ratio > 8 else 4 if overlap else 8)  # ~2K elements per tile
        warps = num_warps or 4
    bg = max(1, min(bg, triton.next_power_of_2(max(n_groups, 1))))
    return rc, bg, bd, warps


def _launch(
    kv,
    sc,
    ape,
    rows,
    pad,
    groups,
    norm,
    out,
    n_groups,
    stride_kv,
    stride_sc,
    stride_r,
    dim,
    ratio,
    overlap,
    gather,
    rope_dim,
    theta,
    eps,
    group_offset,
    block_g,
    block_d,
    rows_chunk,
    num_warps,
):
    epilogue = norm is not None
    rc, bg, bd, warps = _config(
        ratio, overlap, dim, epilogue, n_groups, block_g, block_d, rows_chunk, num_warps
    )
    if n_groups == 0:
        return out
    half = rope_dim // 2 if epilogue else 0
    if epilogue:
        if rope_dim % 2 or rope_dim > dim or (half & (half - 1)):
            raise ValueError(f"rope_dim {rope_dim} must be twice a power of two, at most {dim}")
        if norm.shape != (dim,):
            raise ValueError(f"norm must be ({dim},)")
        nope_block = max(16, triton.next_power_of_2(dim - rope_dim))
        grid = (triton.cdiv(n_groups, bg),)
    else:
        nope_block = 16
        grid = (triton.cdiv(n_groups, bg), triton.cdiv(dim, bd))
    freq = _freqs(float(theta), half, str(kv.device)) if half else out
    dummy = out
    _compress_kernel[grid](
        kv,
        sc,
        dummy if ape is None else ape,
        dummy if rows is None else rows,
        dummy if pad is None else pad,
        dummy if groups is None else groups,
        dummy if norm is None else norm,
        freq,
        out,
        n_groups,
        stride_kv,
        stride_sc,
        0 if ape is None else ape.stride(0),
        stride_r,
        out.stride(0),
        group_offset,
        eps,
        DIM=dim,
        RATIO=ratio,
        RC=rc,
        BLOCK_G=bg,
        BLOCK_D=max(bd, 16),
        OVERLAP=overlap,
        GATHER=gather,
        HAS_APE=ape is not None,
        HAS_PAD=pad is not None,
        EPILOGUE=epilogue,
        NOPE_BLOCK=nope_block,
        HALF=half,
        num_warps=warps,
    )
    return out


def _rowmajor(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def flash_compress(
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
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    block_g: int | None = None,
    block_d: int | None = None,
    rows_chunk: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Entries ``(T // ratio, d)`` of contiguous token rows ``kv``/``score`` ``(T, c*d)`` (the
    prefill path), ``ape`` ``(ratio, c*d)`` added to the score in the kernel (None: already
    added). With ``norm`` the RMSNorm + RoPE epilogue runs too (RoPE on the last ``rope_dim``
    channels at position ``(group_offset + g) * ratio``). Same maths as
    `reference.compress_reference`; fp32 accumulation; output in ``out_dtype`` (default
    ``kv.dtype``) or written into ``out`` ``(G, d)``. The ``block_*``/``rows_chunk``/
    ``num_warps`` knobs override the launch heuristics (benchmark sweeps)."""
    if kv.dim() != 2 or score.shape != kv.shape:
        raise ValueError(f"kv {tuple(kv.shape)} and score {tuple(score.shape)} must be (T, c*d)")
    c = 2 if overlap else 1
    t, width = kv.shape
    if width % c:
        raise ValueError(f"width {width} is not a multiple of {c}")
    dim = width // c
    if ape is not None and ape.shape != (ratio, width):
        raise ValueError(f"ape must be ({ratio}, {width}), got {tuple(ape.shape)}")
    kv, score = _rowmajor(kv), _rowmajor(score)
    ape = None if ape is None else _rowmajor(ape)
    n_groups = t // ratio
    if out is None:
        out = torch.empty((n_groups, dim), dtype=out_dtype or kv.dtype, device=kv.device)
    return _launch(
        kv,
        score,
        ape,
        None,
        None,
        None,
        norm,
        out,
        n_groups,
        kv.stride(0),
        score.stride(0),
        0,
        dim,
        ratio,
        overlap,
        False,
        rope_dim,
        theta,
        eps,
        group_offset,
        block_g,
        block_d,
        rows_chunk,
        num_warps,
    )


def flash_compress_gathered(
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
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    block_g: int | None = None,
    block_d: int | None = None,
    rows_chunk: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Entries ``(B, d)``, one group per request, rows gathered from ``ring`` ``(N, 2*c*d)``
    (``[kv | score]`` per row, the layout of the in-flight ring) through ``rows`` ``(B, R)``
    (``R = 2*ratio`` with overlap, the previous group's rows first, else ``ratio``); ``pad``
    ``(B, R)`` bool marks padding rows. Epilogue RoPE position: ``groups * ratio``. Same maths as
    `reference.compress_gathered_reference`."""
    if rows.dim() != 2 or rows.shape[1] != (2 * ratio if overlap else ratio):
        raise ValueError(f"rows {tuple(rows.shape)} do not fit ratio {ratio}, overlap {overlap}")
    c = 2 if overlap else 1
    if ring.dim() != 2 or ring.shape[1] % (2 * c):
        raise ValueError(f"ring {tuple(ring.shape)} must be (N, 2*{c}*d)")
    width = ring.shape[1] // 2
    dim = width // c
    if norm is not None and groups is None:
        raise ValueError("the epilogue needs groups (the RoPE position is groups * ratio)")
    ring = _rowmajor(ring)
    rows = rows.contiguous()
    if pad is not None:
        pad = pad.contiguous()
        pad = pad.view(torch.uint8) if pad.dtype == torch.bool else pad
        if pad.shape != rows.shape:
            raise ValueError("pad must have the shape of rows")
    groups = None if groups is None else groups.contiguous()
    ape = None if ape is None else _rowmajor(ape)
    b = rows.shape[0]
    if out is None:
        out = torch.empty((b, dim), dtype=out_dtype or ring.dtype, device=ring.device)
    return _launch(
        ring,
        ring[:, width:],
        ape,
        rows,
        pad,
        groups,
        norm,
        out,
        b,
        ring.stride(0),
        ring.stride(0),
        rows.stride(0),
        dim,
        ratio,
        overlap,
        True,
        rope_dim,
        theta,
        eps,
        0,
        block_g,
        block_d,
        rows_chunk,
        num_warps,
    )
