"""Flash Compressor: the compressor's read -> add bias -> softmax over the group -> weighted sum
(-> RMSNorm -> RoPE) chain fused into one Triton pass.

Maths and conventions: `adapters.kernels.reference` (``compress_reference`` for the prefill path,
``compress_gathered_reference`` for the decode path). Design, for bandwidth:

* An entry pools ``NV`` "virtual rows": the group's ``ratio`` token rows, or with the C4 overlap
  ``2*ratio`` rows (group ``g-1``'s rows on their first ``d`` channels, then group ``g``'s rows on
  their last ``d`` channels). Virtual row ``v`` of entry ``g`` is token row ``g*ratio + v``
  (``- ratio`` with overlap) at channel offset ``d`` when ``v >= ratio``: one affine formula, so
  every input byte is read exactly once, with coalesced, vectorised loads.
* One program per (block of ``BLOCK_G`` entries, block of ``BLOCK_D`` channels); by default
  ``BLOCK_D`` covers the whole entry (contiguous 1 KB row runs for 512 bf16 channels) and the
  threads of the program cover the ``(BLOCK_G, BLOCK_D)`` plane exactly, 16 bytes each.
* Rows are streamed in chunks, a tile ``(BLOCK_G, RW, RT, BLOCK_D)``: the ``RT`` axis is held by
  every thread (the chunk's max and sums over it are in-register reductions), the ``RW`` axis
  spreads rows over extra warps (the decode layout, few entries with many rows each). Inside the
  loop everything is elementwise, in the load's own layout: no shared memory, no barriers, no
  shuffles (the old 3-D tiles paid ~70 barriers and ~300 shared-memory transfers per program in
  layout conversions; that, not bandwidth, made C4-overlap and C128 slow). An online softmax in
  base 2 (running max, sum and weighted sum, rescaled once per chunk) keeps nothing
  intermediate in HBM; fp32 accumulation whatever the input dtype.
* ``RW`` partial states are merged once at the end (a cross-warp reduction per program).
* Optional epilogue (``norm`` given): the program then holds whole entries; RMSNorm is a row
  reduction, RoPE takes each tail channel's partner with ``tl.gather``; one store.

Importing this module imports Triton and defines the kernels; `adapters.kernels` imports it only
when a CUDA tensor (or a test under ``TRITON_INTERPRET=1``) needs it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - older Triton
    from triton.language.extra.cuda import libdevice

__all__ = ["flash_compress", "flash_compress_gathered", "launch_config"]

_LOG2E = 1.4426950408889634


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


def _pow2_divisor(n: int, cap: int) -> int:
    r = 1
    while r * 2 <= cap and n % (r * 2) == 0:
        r *= 2
    return r


@functools.lru_cache(maxsize=32)
def _freqs(theta: float, half: int, device: str) -> torch.Tensor:
    # bit-identical to `adapters.ops.rope`'s frequencies on the same device
    return theta ** (-torch.arange(half, device=device, dtype=torch.float32) / half)


def launch_config(
    ratio: int,
    overlap: bool,
    dim: int,
    elem_bytes: int,
    epilogue: bool,
    n_entries: int,
    gather: bool,
    *,
    block_g: int | None = None,
    block_d: int | None = None,
    rows_chunk: int | None = None,
    row_warps: int | None = None,
    num_warps: int | None = None,
) -> dict:
    """Launch shape (every knob overridable): ``RT`` rows per thread per chunk, ``RW`` warps'
    worth of extra rows per chunk, ``BLOCK_G`` entries and ``BLOCK_D`` channels per program,
    warps. By default the program's ``BLOCK_G*BLOCK_D`` plane is covered exactly by its threads,
    16 bytes each, so the ``RT`` axis stays in registers."""
    nv = 2 * ratio if overlap else ratio
    vec = max(1, 16 // elem_bytes)
    if epilogue:
        bd = triton.next_power_of_2(dim)
        if block_d is not None and block_d != bd:
            raise ValueError(f"the epilogue needs whole entries: block_d must be {bd}")
    else:
        bd = block_d or min(triton.next_power_of_2(dim), max(512, 64 * vec))
    if bd & (bd - 1):
        raise ValueError(f"block_d {bd} must be a power of two")
    n_pow = triton.next_power_of_2(max(n_entries, 1))
    # entries per program: enough to give 4 warps 16 bytes each, at most the entries there are
    bg = block_g or max(1, min(128 * vec // bd, 64))
    bg = max(1, min(bg, n_pow))
    rt = rows_chunk or _pow2_divisor(ratio, 4)
    if ratio % rt or rt & (rt - 1):
        raise ValueError(f"rows_chunk {rt} must be a power of two dividing ratio {ratio}")
    plane_warps = max(1, bg * bd // (32 * vec))
    if row_warps is None:
        # few programs (decode): spread each entry's rows over more warps, up to 16 warps
        programs = triton.cdiv(n_entries, bg) * triton.cdiv(dim, bd)
        rw = 1
        while programs * rw < 1024 and rt * rw * 2 <= nv and plane_warps * rw * 2 <= 16:
            rw *= 2
    else:
        rw = row_warps
    if rw & (rw - 1) or nv % (rt * rw):
        raise ValueError(f"row_warps {rw} x rows_chunk {rt} must divide the {nv} rows per entry")
    warps = num_warps or min(32, plane_warps * rw)
    unroll = nv // (rt * rw) <= 2  # C4: straight-line code; C128: a loop
    return dict(RT=rt, RW=rw, BLOCK_G=bg, BLOCK_D=bd, UNROLL=unroll, num_warps=warps)


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
    knobs,
):
    epilogue = norm is not None
    cfg = launch_config(ratio, overlap, dim, kv.element_size(), epilogue, n_groups, gather, **knobs)
    half = rope_dim // 2 if epilogue else 0
    if epilogue:
        if rope_dim % 2 or rope_dim > dim or (half & (half - 1)):
            raise ValueError(f"rope_dim {rope_dim} must be twice a power of two, at most {dim}")
        if norm.shape != (dim,):
            raise ValueError(f"norm must be ({dim},)")
    if n_groups == 0:
        return out
    grid = (triton.cdiv(n_groups, cfg["BLOCK_G"]), triton.cdiv(dim, cfg["BLOCK_D"]))
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
        OVERLAP=overlap,
        GATHER=gather,
        HAS_APE=ape is not None,
        HAS_PAD=pad is not None,
        EPILOGUE=epilogue,
        HALF=half,
        FAST_TRIG=kv.device.type == "cuda",
        **cfg,
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
    row_warps: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Entries ``(T // ratio, d)`` of contiguous token rows ``kv``/``score`` ``(T, c*d)`` (the
    prefill path), ``ape`` ``(ratio, c*d)`` added to the score in the kernel (None: already
    added). With ``norm`` the RMSNorm + RoPE epilogue runs too (RoPE on the last ``rope_dim``
    channels at position ``(group_offset + g) * ratio``). Same maths as
    `reference.compress_reference`; fp32 accumulation; output in ``out_dtype`` (default
    ``kv.dtype``) or written into ``out`` ``(G, d)``. The ``block_*``/``rows_chunk``/
    ``row_warps``/``num_warps`` knobs override `launch_config` (benchmark sweeps)."""
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
    knobs = dict(
        block_g=block_g,
        block_d=block_d,
        rows_chunk=rows_chunk,
        row_warps=row_warps,
        num_warps=num_warps,
    )
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
        knobs,
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
    row_warps: int | None = None,
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
    knobs = dict(
        block_g=block_g,
        block_d=block_d,
        rows_chunk=rows_chunk,
        row_warps=row_warps,
        num_warps=num_warps,
    )
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
        knobs,
    )
