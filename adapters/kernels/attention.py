"""Flash sparse attention: a query's window rows, its extra rows (`PoolRows`) and the sink in one
Triton pass, keys read in place from their pools (FlashMLA's ``k_cache`` + ``extra_k_cache``
with their own indices).

Maths: `attention_reference.sparse_attention_reference` (the latent row is key and value; one
sink logit per head in the denominator only; a query with nothing visible gives 0). Design:

* One program per (query, block of ``BLOCK_H`` heads, split): the heads are the M dimension of
  both ``tl.dot`` s (``S = q k^T``, ``acc += P k``), the keys are gathered ``BLOCK_K`` rows at a
  time straight from the pools (window: ``window_slots``, masked rows not loaded; extra: the
  slot or page table, rows past the query's length not loaded) and each tile serves as K and V.
  By default ``BLOCK_H = 64`` (every DeepSeek-V4-Flash head: a row is read once per query),
  ``BLOCK_K = 32``, 8 warps, 3 pipeline stages: the ``64 x 512`` fp32 accumulator is 128
  registers a thread, the query tile stays in shared memory (ptxas still spills a little at 255
  registers). Triton gives ``S`` to both warpgroups whole (the QK product runs twice), ``P k``
  splits the value dimension between them.
* Online softmax in base 2, fp32 state. The running max starts at the sink logit (and the sum at
  its own term, ``exp2(0) = 1``), so it is finite from the start: masked keys (``-inf``) add
  exactly 0, no NaN guard is needed, and a query with nothing visible ends with ``acc = 0``,
  ``l = 1``: output 0, as the reference gives.
* The window's blocks come first, then the extra rows', as one sequence of
  ``cdiv(W, BLOCK_K) + cdiv(length, BLOCK_K)`` blocks (two loops with their own addressing, so
  each loop body is branch-free and pipelines).
* Split-K (flash-decoding) when there are too few programs to fill the GPU (decode: ``B x 1``
  programs): each of ``splits`` programs of a (query, head block) takes a contiguous share of
  its blocks and stores its unnormalised fp32 ``acc``, max and sum; `_combine_kernel` (a second
  launch) merges them. Default: ``splits = SMs // programs``, at most one split per
  `SPLIT_MIN_ROWS` rows (a share's partial state is ``BLOCK_H x d`` fp32, as many bytes as 128
  bf16 rows). Prefill (N >= SMs): 1.
* 16-bit inputs (all of one dtype) go to the tensor cores as they are, ``P`` rounded to that
  dtype for the second product (as flash attention does); anything else is upcast to fp32 after
  the loads and multiplied exactly (``input_precision="ieee"``). Offsets are int64.
* An FP8 window pool (``float8_e4m3fn`` + ``window_scale``, one fp32 scale per row): a tile's
  bytes and its visible rows' scales are loaded, dequantised in fp32 (``fp8 * scale``) and then
  rounded to the compute dtype; the tile is key and value as any other. A dequantised row (a
  4-bit significand times a power of two) is exact in bf16 (fp32's exponents) but not in fp16,
  so the window counts as bf16 in the dtype rule above: bf16 q and extra rows stay on the tensor
  cores, fp16 q goes the exact fp32 way.
* Defaults from one H200 sweep (`bench/attention.py`, ``bench/results/attention_h200.json``,
  CUDA-graph timings): 3 stages beat 2 by 1.08x (decode B=32, C4), 1.43x (prefill 4096 x 512
  C4 rows) and 1.36x (prefill, shared C128) and beat ``BLOCK_K`` 16 / 64 and ``BLOCK_H`` 32;
  ``SPLIT_MIN_ROWS = 64`` is the best measured share at B=1 (ten 64-row shares: 17.9 us, five
  128-row ones: 24.0 us); at B=32 four splits were best (C4 and C128).
* Not done: several queries of one request sharing a C128 table row in one program (M = queries
  x heads); the rows are then re-read per query, from L2. Warp specialisation (FlashMLA's
  producer/consumer warpgroups) is beyond core Triton: decode stays far from the bandwidth
  ceiling (B=32 C4: 0.8 TB/s).

Importing this module imports Triton and defines the kernels; `adapters.kernels` imports it only
when a CUDA tensor (or a test under ``TRITON_INTERPRET=1``) needs it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .attention_reference import FP8_WINDOW_DTYPES, check_window_scale
from .rows import PoolRows

__all__ = ["SPLIT_MIN_ROWS", "flash_sparse_attention", "launch_config"]

_LOG2E = 1.4426950408889634
#: the fewest rows (upper bound: window + extra width) a split-K share gets by default
SPLIT_MIN_ROWS = 64
_HALF = (torch.float16, torch.bfloat16)


@triton.jit
def _update(q, k, ok, m, lsum, acc, qk_scale, PREC: tl.constexpr):
    # one key tile: logits in base 2, rescale the state to the new max, add the tile's mass
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    lsum = lsum * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(k.dtype), k, acc * alpha[:, None], input_precision=PREC)
    return m_new, lsum, acc


@triton.jit
def _tile_mask(row_ok, cols, D: tl.constexpr, BLOCK_D: tl.constexpr):
    # (rows, BLOCK_D) load mask; without padding columns the row mask alone (broadcast by the
    # load) keeps the mask visibly constant along each vector
    mask = row_ok[:, None]
    if BLOCK_D != D:
        mask = mask & (cols[None, :] < D)
    return mask


@triton.jit
def _attention_kernel(
    q_ptr,
    wkv_ptr,
    wslot_ptr,
    wmask_ptr,
    wscale_ptr,
    sink_ptr,
    xkv_ptr,
    table_ptr,
    len_ptr,
    qrow_ptr,
    out_ptr,
    part_ptr,
    pm_ptr,
    pl_ptr,
    H,
    W,
    G,
    spp,
    splits,
    qk_scale,
    stride_qn,
    stride_qh,
    stride_wkv,
    stride_ws,
    stride_wm,
    stride_xkv,
    stride_t,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    HAS_QROW: tl.constexpr,
    HAS_WSCALE: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    cols = tl.arange(0, BLOCK_D)
    c_ok = cols < D
    rk = tl.arange(0, BLOCK_K)
    q = tl.load(
        q_ptr + n * stride_qn + heads[:, None] * stride_qh + cols[None, :],
        mask=_tile_mask(h_ok, cols, D, BLOCK_D),
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    m = tl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    lsum = tl.where(split == 0, 1.0, 0.0) + tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)

    length = 0
    if HAS_EXTRA:
        length = tl.minimum(tl.maximum(tl.load(len_ptr + n).to(tl.int64), 0), G)
    nwb = tl.cdiv(W, BLOCK_K)
    total = nwb + tl.cdiv(length, BLOCK_K)
    share = tl.cdiv(total, splits)
    b0 = split * share
    b1 = tl.minimum(b0 + share, total)

    for b in range(b0, tl.minimum(b1, nwb)):
        j = b * BLOCK_K + rk
        ok = tl.load(wmask_ptr + n * stride_wm + j, mask=j < W, other=0) != 0
        slot = tl.load(wslot_ptr + n * stride_ws + j, mask=ok, other=0).to(tl.int64)
        k = tl.load(
            wkv_ptr + slot[:, None] * stride_wkv + cols[None, :],
            mask=_tile_mask(ok, cols, D, BLOCK_D),
            other=0.0,
        )
        if HAS_WSCALE:  # FP8 rows: dequantised in fp32, then in q's compute dtype
            row_scale = tl.load(wscale_ptr + slot, mask=ok, other=0.0)
            k = (k.to(tl.float32) * row_scale[:, None]).to(q.dtype)
        if UPCAST:
            k = k.to(tl.float32)
        m, lsum, acc = _update(q, k, ok, m, lsum, acc, qk_scale, PREC)

    if HAS_EXTRA:
        r = n
        if HAS_QROW:
            r = tl.load(qrow_ptr + n).to(tl.int64)
        for b in range(tl.maximum(b0, nwb), b1):
            g = (b - nwb) * BLOCK_K + rk
            ok = g < length
            entry = tl.load(table_ptr + r * stride_t + g // spp, mask=ok, other=0).to(tl.int64)
            slot = entry * spp + g % spp
            k = tl.load(
                xkv_ptr + slot[:, None] * stride_xkv + cols[None, :],
                mask=_tile_mask(ok, cols, D, BLOCK_D),
                other=0.0,
            )
            if UPCAST:
                k = k.to(tl.float32)
            m, lsum, acc = _update(q, k, ok, m, lsum, acc, qk_scale, PREC)

    if not SPLIT:
        o = acc / lsum[:, None]
        dst = out_ptr + (n * H + heads[:, None]) * D + cols[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & c_ok[None, :])
    else:
        row = (n * splits + split) * H + heads
        tl.store(part_ptr + row[:, None] * D + cols[None, :], acc, mask=h_ok[:, None] & c_ok)
        tl.store(pm_ptr + row, m, mask=h_ok)
        tl.store(pl_ptr + row, lsum, mask=h_ok)


@triton.jit
def _combine_kernel(
    part_ptr,
    pm_ptr,
    pl_ptr,
    out_ptr,
    H,
    splits,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # one (query, head): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    rows = (n * splits + s) * H + h
    ms = tl.load(pm_ptr + rows, mask=s < splits, other=float("-inf"))
    mx = tl.max(ms, 0)
    ls = tl.load(pl_ptr + rows, mask=s < splits, other=0.0)
    denom = tl.sum(tl.exp2(ms - mx) * ls, 0)
    cols = tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for i in range(splits):
        row = (n * splits + i) * H + h
        w = tl.exp2(tl.load(pm_ptr + row) - mx)
        acc += w * tl.load(part_ptr + row * D + cols, mask=cols < D, other=0.0)
    dst = out_ptr + (n * H + h) * D + cols
    tl.store(dst, (acc / denom).to(out_ptr.dtype.element_ty), mask=cols < D)


def _program_target(device: torch.device) -> int:
    """Programs that fill the device once (a program holds most of an SM's registers)."""
    if device.type == "cuda":  # pragma: no cover - needs a GPU
        return _sm_count(torch.cuda.current_device() if device.index is None else device.index)
    return 1


@functools.cache
def _sm_count(index: int) -> int:  # pragma: no cover - needs a GPU
    return torch.cuda.get_device_properties(index).multi_processor_count


def launch_config(
    n_queries: int,
    heads: int,
    dim: int,
    width: int,
    device: torch.device,
    fp32: bool = False,
    *,
    block_h: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    splits: int | None = None,
) -> dict:
    """Launch shape for ``n_queries`` queries of ``heads`` heads over at most ``width`` rows
    each (window + extra), every knob overridable (benchmark sweeps): ``BLOCK_H`` heads and
    ``BLOCK_K`` rows per tile (powers of two, at least 16: `tl.dot`), warps, pipeline stages
    and the split-K ``splits`` (module docstring; 1: no split). ``fp32``: the products run on
    fp32 operands (FMA, not tensor cores), which takes small tiles. Raises `ValueError` for
    bad knobs."""
    bh = block_h or (16 if fp32 else min(64, max(16, triton.next_power_of_2(heads))))
    bk = block_k or (16 if fp32 else 32)
    for name, v in (("block_h", bh), ("block_k", bk)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} {v} must be a power of two >= 16")
    bd = max(16, triton.next_power_of_2(dim))
    if splits is None:
        programs = max(1, n_queries * triton.cdiv(heads, bh))
        most = max(1, triton.cdiv(width, SPLIT_MIN_ROWS))
        splits = max(1, min(_program_target(device) // programs, most))
    if splits < 1:
        raise ValueError(f"splits {splits} must be positive")
    warps = num_warps or (8 if bh * bd >= (16 if fp32 else 64) * 256 else 4)
    return dict(
        BLOCK_H=bh, BLOCK_K=bk, BLOCK_D=bd, splits=splits, num_warps=warps,
        num_stages=num_stages or (2 if fp32 else 3),
    )  # fmt: skip


def _rowmajor(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check(q, window_kv, window_slots, window_mask, sink, extra_kv, extra, window_scale) -> None:
    if (extra_kv is None) != (extra is None):
        raise ValueError("extra_kv and extra go together")
    check_window_scale(window_kv, window_scale)
    if q.dim() != 3:
        raise ValueError(f"q {tuple(q.shape)} must be (N, H, d)")
    n, h, d = q.shape
    pools = [window_kv] if extra_kv is None else [window_kv, extra_kv]
    if any(p.dim() != 2 or p.shape[1] != d for p in pools):
        raise ValueError(f"the pools must be (S, {d})")
    if window_slots.dim() != 2 or window_slots.shape[0] != n:
        raise ValueError(f"window_slots {tuple(window_slots.shape)} must be ({n}, W)")
    if window_mask.shape != window_slots.shape:
        raise ValueError("window_mask must have the shape of window_slots")
    if sink.shape != (h,):
        raise ValueError(f"sink must be ({h},)")
    if extra is not None and extra.num_queries != n:
        raise ValueError(f"extra has {extra.num_queries} queries, q has {n}")
    if any(t.dtype == torch.float64 for t in [q, *pools]):
        raise ValueError("fp64 is not supported by the kernel (the reference computes it)")


def _extra_args(extra_kv, extra, dummy) -> tuple:
    """``(pool, table, lengths, qrow, slots_per_page)`` of the extra rows (dummies without)."""
    if extra is None or extra_kv is None:
        return dummy, dummy, dummy, dummy, 1
    qrow = extra.lengths if extra.qrow is None else extra.qrow
    return _rowmajor(extra_kv), _rowmajor(extra.table), extra.lengths, qrow, extra.slots_per_page


def flash_sparse_attention(
    q: torch.Tensor,
    window_kv: torch.Tensor,
    window_slots: torch.Tensor,
    window_mask: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    extra_kv: torch.Tensor | None = None,
    extra: PoolRows | None = None,
    *,
    window_scale: torch.Tensor | None = None,
    **knobs: int | None,
) -> torch.Tensor:
    """``(N, H, d)`` attention of ``q`` (its dtype) over its window rows ``window_kv
    [window_slots[n, j]]`` where ``window_mask[n, j]``, its ``extra`` rows of ``extra_kv`` and
    the sink; the same maths as `attention_reference.sparse_attention_reference`, in one
    launch (two with split-K). An FP8 ``window_kv`` takes ``window_scale`` ``(S1,)`` (fp32, one
    per pool row). Masked window slots (and their scales) and rows past a length are never
    read. Nothing is synchronised with the host (CUDA-graph safe). ``knobs`` (``block_h``,
    ``block_k``, ``num_warps``, ``num_stages``, ``splits``) override `launch_config`. Raises
    `ValueError` for inconsistent shapes, a lone ``extra_kv`` or ``extra``, an FP8 window
    without its scales (or scales without one), and fp64 inputs."""
    _check(q, window_kv, window_slots, window_mask, sink, extra_kv, extra, window_scale)
    n, h, d = q.shape
    w, g = window_slots.shape[1], (extra.num_rows if extra is not None else 0)
    fp8 = window_kv.dtype in FP8_WINDOW_DTYPES
    dtypes = {q.dtype, torch.bfloat16 if fp8 else window_kv.dtype}
    dtypes |= {extra_kv.dtype} if extra_kv is not None else set()
    upcast = len(dtypes) > 1 or q.dtype not in _HALF
    cfg = launch_config(n, h, d, w + g, q.device, upcast, **knobs)
    out = torch.empty((n, h, d), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    q, window_kv, window_slots = _rowmajor(q), _rowmajor(window_kv), _rowmajor(window_slots)
    wmask = _rowmajor(window_mask)
    wmask = wmask.view(torch.uint8) if wmask.dtype == torch.bool else wmask
    xkv, table, lengths, qrow, spp = _extra_args(extra_kv, extra, window_slots)
    wscale = window_scale.contiguous() if window_scale is not None else sink
    splits = cfg.pop("splits")
    part = pm = pl = out
    if splits > 1:
        part = torch.empty((n, splits, h, d), dtype=torch.float32, device=q.device)
        pm, pl = torch.empty((2, n, splits, h), dtype=torch.float32, device=q.device)
    _attention_kernel[(n, triton.cdiv(h, cfg["BLOCK_H"]), splits)](
        q, window_kv, window_slots, wmask, wscale, sink, xkv, table, lengths, qrow, out, part,
        pm, pl, h, w, g, spp, splits, float(scale) * _LOG2E, q.stride(0), q.stride(1),
        window_kv.stride(0), window_slots.stride(0), wmask.stride(0), xkv.stride(0),
        table.stride(0), D=d, SPLIT=splits > 1, HAS_EXTRA=extra is not None,
        HAS_QROW=extra is not None and extra.qrow is not None, HAS_WSCALE=fp8, UPCAST=upcast,
        PREC="ieee" if upcast else "tf32", **cfg,
    )  # fmt: skip
    if splits > 1:
        _combine_kernel[(n, h)](
            part, pm, pl, out, h, splits, D=d, BLOCK_S=triton.next_power_of_2(splits),
            BLOCK_D=cfg["BLOCK_D"], num_warps=4,
        )  # fmt: skip
    return out
