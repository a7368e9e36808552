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

Modules: `compressor_pool` (the chunked online-softmax pooling), `compressor_kernel` (the
kernel: pooling, epilogue, store); this one picks the launch shape (`launch_config`) and holds
the entry points. Importing this module imports Triton and defines the kernels;
`adapters.kernels` imports it only when a CUDA tensor (or a test under ``TRITON_INTERPRET=1``)
needs it.
"""

from __future__ import annotations

import functools

import torch
import triton

from .compressor_kernel import _compress_kernel

__all__ = ["flash_compress", "flash_compress_gathered", "launch_config"]


def _pow2_divisor(n: int, cap: int) -> int:
    r = 1
    while r * 2 <= cap and n % (r * 2) == 0:
        r *= 2
    return r


@functools.lru_cache(maxsize=32)
def _freqs(theta: float, half: int, device: str) -> torch.Tensor:
    # bit-identical to `adapters.model.ops.rope`'s frequencies on the same device
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
