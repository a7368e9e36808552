"""The fused Lightning indexer: ``sum_h w[n, h] * relu(q[n, h] . key)`` over pool rows read in
place through a `PoolRows` table, in one Triton pass (DeepSeek's ``mqa_logits`` shape).

Maths and conventions: `indexer_reference.index_logits_reference` (which defines the result).
Design, for bandwidth (decode) and tensor-core throughput (prefill):

* A program owns ``BLOCK_Q`` consecutive queries and a span of ``span`` rows ``g`` of their row
  set; it streams key tiles of ``BLOCK_E`` rows straight from the pool (slot from the table:
  ``table[r, g // spp] * spp + g % spp``; a virtual page is ``spp`` consecutive rows, so a tile
  reads contiguous runs) and never writes gathered keys or ``(N, H, G)`` products.
* One ``tl.dot`` per tile: ``K (BLOCK_E, d) @ Q^T (d, BLOCK_Q*H)``. The key rows are the M axis
  and the heads (of all the block's queries) the N axis, so the weighted sum over heads is a
  reduction along N: inside each thread and across the four lanes of a quad, never through
  shared memory (heads on M, as in ``(H, d) @ (d, BLOCK_E)``, would reduce across warps).
* Decode (``qrow`` None): ``BLOCK_Q = 1``, N = H = 64; G is split over programs so that every
  SM streams at B = 1. Prefill (queries sharing a row set): ``BLOCK_Q`` queries share each key
  tile (N = ``BLOCK_Q * H``); tiles past the block's longest length are not loaded, only
  written as -inf. Whether a block's queries really share their row set is checked in the
  kernel: a block that does not is computed query by query (correct, without the sharing).
* Products exact (to fp32 rounding), sums in fp32, as the upcasting reference. 16-bit q with
  keys of its dtype or FP8 keys (``float8_e4m3fn``, loaded as bytes, exact in 16 bits): one dot.
  Other mixes split fp32 (fp16) operands into three (two) bf16 parts whose sum is the value
  and add the part products above fp32 rounding (`dot_plan`: fp32 q x bf16 keys is 3 dots).
  FP8 dots are multiplied by the row's scale before the relu (``q . (k s) = s (q . k)``).
* Offsets are int64 (``slot * d`` and ``n * G`` may pass 2**31).

Importing this module imports Triton and defines the kernel; `adapters.kernels` imports it only
when a CUDA tensor (or a test under ``TRITON_INTERPRET=1``) needs it.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .indexer_reference import FP8_DTYPES
from .rows import PoolRows

__all__ = ["INTERPRETER_PLAN", "DotPlan", "dot_plan", "flash_index_logits", "launch_config"]

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
_DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _parts(x, P: tl.constexpr):  # pragma: no cover - needs a GPU
    """fp32 ``x`` as ``P`` (1-3) bf16 parts, largest first, whose sum is ``x`` (8 significand
    bits each: three hold fp32's 24, two fp16's 11); unused parts repeat the first."""
    p1 = x.to(tl.bfloat16)
    p2 = p1
    p3 = p1
    if P >= 2:
        rest = x - p1.to(tl.float32)
        p2 = rest.to(tl.bfloat16)
        if P >= 3:
            p3 = (rest - p2.to(tl.float32)).to(tl.bfloat16)
    return p1, p2, p3


@triton.jit
def _q_operands(
    qt, K_PARTS: tl.constexpr, Q_PARTS: tl.constexpr, DOT_DTYPE: tl.constexpr
):  # pragma: no cover - needs a GPU
    """The 16-bit B operands of `_dot16` from fp32 ``Q^T`` (once per program)."""
    if Q_PARTS == 1 and K_PARTS == 1:
        q1 = qt.to(DOT_DTYPE)
        q2 = q1
        q3 = q1
    else:
        q1, q2, q3 = _parts(qt, Q_PARTS)
    return q1, q2, q3


@triton.jit
def _dot16(
    k, q1, q2, q3, K_PARTS: tl.constexpr, Q_PARTS: tl.constexpr, DOT_DTYPE: tl.constexpr
):  # pragma: no cover - needs a GPU
    """``K @ Q^T`` in fp32 from exact 16-bit products: one dot in ``DOT_DTYPE`` (1 x 1 parts),
    or the bf16 part pairs ``(i, j)`` with ``i + j <= 2`` (the rest are below fp32 rounding),
    smallest first."""
    if Q_PARTS == 1 and K_PARTS == 1:
        s = tl.dot(k.to(DOT_DTYPE), q1)
    else:
        if K_PARTS == 1:
            k1 = k.to(tl.bfloat16)
            k2 = k1
            k3 = k1
        else:
            k1, k2, k3 = _parts(k.to(tl.float32), K_PARTS)
        s = tl.zeros((k.shape[0], q1.shape[1]), tl.float32)
        if K_PARTS >= 2 and Q_PARTS >= 2:
            s = tl.dot(k2, q2, s)
        if K_PARTS >= 3:
            s = tl.dot(k3, q1, s)
        if Q_PARTS >= 3:
            s = tl.dot(k1, q3, s)
        if K_PARTS >= 2:
            s = tl.dot(k2, q1, s)
        if Q_PARTS >= 2:
            s = tl.dot(k1, q2, s)
        s = tl.dot(k1, q1, s)
    return s


@triton.jit
def _span(
    q_ptr,
    w_ptr,
    k_ptr,
    sc_ptr,
    tab_ptr,
    len_ptr,
    out_ptr,
    n0,
    r,
    e_lo,
    e_hi,
    N,
    G,
    stride_qn,
    stride_qh,
    stride_wn,
    stride_k,
    stride_t,
    stride_o,
    H: tl.constexpr,
    D: tl.constexpr,
    HP: tl.constexpr,
    DP: tl.constexpr,
    SPP: tl.constexpr,
    BQ: tl.constexpr,
    BLOCK_E: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    K_PARTS: tl.constexpr,
    Q_PARTS: tl.constexpr,
):
    """Logits of queries ``n0 .. n0 + BQ`` (all reading row set ``r``) for rows
    ``[e_lo, e_hi)``: key tiles up to the longest length, -inf after it."""
    c = tl.arange(0, BQ * HP)  # dot columns: (query, head)
    qn = n0 + c // HP
    hh = c % HP
    dd = tl.arange(0, DP)
    q_ok = (qn < N) & (hh < H)
    q_off = qn.to(tl.int64) * stride_qn + hh * stride_qh
    qt = tl.load(q_ptr + q_off[None, :] + dd[:, None], mask=q_ok[None, :] & (dd[:, None] < D))
    qt = qt.to(tl.float32)  # (DP, BQ*HP)
    if Q_PARTS == 0:  # the interpreter (`INTERPRETER_PLAN`): fp32 operands
        q1 = qt
        q2 = qt
        q3 = qt
    else:  # pragma: no cover - needs a GPU
        q1, q2, q3 = _q_operands(qt, K_PARTS, Q_PARTS, DOT_DTYPE)
    wv = tl.load(w_ptr + qn.to(tl.int64) * stride_wn + hh, mask=q_ok, other=0.0).to(tl.float32)
    j = tl.arange(0, BQ)
    n_ok = n0 + j < N
    lens = tl.load(len_ptr + n0 + j, mask=n_ok, other=0)
    lens = tl.minimum(tl.maximum(lens, 0), G).to(tl.int32)  # (BQ,)
    stop = tl.minimum(e_hi, tl.max(lens, axis=0))
    out_row = out_ptr + (n0 + j).to(tl.int64) * stride_o  # (BQ,)
    tab_row = tab_ptr + r.to(tl.int64) * stride_t
    for e0 in range(e_lo, stop, BLOCK_E):
        g = e0 + tl.arange(0, BLOCK_E)
        g_ok = g < stop
        page = tl.load(tab_row + g // SPP, mask=g_ok, other=0).to(tl.int64)
        slot = page * SPP + g % SPP
        k_msk = g_ok[:, None] & (dd[None, :] < D)
        k = tl.load(k_ptr + slot[:, None] * stride_k + dd[None, :], mask=k_msk, other=0.0)
        if Q_PARTS == 0:  # (BLOCK_E, BQ*HP)
            s = tl.dot(k.to(tl.float32), q1, input_precision="ieee")
        else:  # pragma: no cover - needs a GPU
            s = _dot16(k, q1, q2, q3, K_PARTS, Q_PARTS, DOT_DTYPE)
        if HAS_SCALE:
            s = s * tl.load(sc_ptr + slot, mask=g_ok, other=0.0).to(tl.float32)[:, None]
        s = tl.maximum(s, 0.0) * wv[None, :]
        logit = tl.sum(tl.reshape(s, (BLOCK_E, BQ, HP)), axis=2)  # (BLOCK_E, BQ)
        logit = tl.where(g[:, None] < lens[None, :], logit, float("-inf"))
        tl.store(out_row[None, :] + g[:, None], logit, mask=(g < e_hi)[:, None] & n_ok[None, :])
    rest = e_lo + tl.cdiv(tl.maximum(stop - e_lo, 0), BLOCK_E) * BLOCK_E  # first tile not computed
    ninf = tl.full((BLOCK_E, BQ), float("-inf"), tl.float32)
    for e1 in range(rest, e_hi, BLOCK_E):  # pragma: no branch - the interpreter hides the exit
        g = e1 + tl.arange(0, BLOCK_E)
        tl.store(out_row[None, :] + g[:, None], ninf, mask=(g < e_hi)[:, None] & n_ok[None, :])


@triton.jit
def _index_kernel(
    q_ptr,
    w_ptr,
    k_ptr,
    sc_ptr,
    tab_ptr,
    len_ptr,
    qrow_ptr,
    out_ptr,
    N,
    G,
    span,
    stride_qn,
    stride_qh,
    stride_wn,
    stride_k,
    stride_t,
    stride_o,
    H: tl.constexpr,
    D: tl.constexpr,
    HP: tl.constexpr,
    DP: tl.constexpr,
    SPP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_E: tl.constexpr,
    HAS_QROW: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    K_PARTS: tl.constexpr,
    Q_PARTS: tl.constexpr,
):
    """Program ``(b, s)``: queries ``b*BLOCK_Q ..``, rows ``[s*span, (s+1)*span) & [0, G)``."""
    n0 = tl.program_id(0) * BLOCK_Q
    e_lo = tl.program_id(1) * span
    e_hi = tl.minimum(e_lo + span, G)
    if HAS_QROW:
        r0 = tl.load(qrow_ptr + n0)
    else:  # decode: query n reads row set n (BLOCK_Q == 1)
        r0 = n0
    if BLOCK_Q == 1:
        _span(q_ptr, w_ptr, k_ptr, sc_ptr, tab_ptr, len_ptr, out_ptr, n0, r0, e_lo, e_hi, N, G,
              stride_qn, stride_qh, stride_wn, stride_k, stride_t, stride_o, H, D, HP, DP, SPP,
              1, BLOCK_E, HAS_SCALE, DOT_DTYPE, K_PARTS, Q_PARTS)  # fmt: skip
    else:
        j = tl.arange(0, BLOCK_Q)
        rs = tl.load(qrow_ptr + n0 + j, mask=n0 + j < N, other=r0)
        if tl.min(rs, axis=0) == tl.max(rs, axis=0):  # one row set: share every key tile
            _span(q_ptr, w_ptr, k_ptr, sc_ptr, tab_ptr, len_ptr, out_ptr, n0, r0, e_lo, e_hi,
                  N, G, stride_qn, stride_qh, stride_wn, stride_k, stride_t, stride_o, H, D, HP,
                  DP, SPP, BLOCK_Q, BLOCK_E, HAS_SCALE, DOT_DTYPE, K_PARTS, Q_PARTS)  # fmt: skip
        else:  # query by query, each through its own row set
            for i in range(0, tl.minimum(N - n0, BLOCK_Q)):  # pragma: no branch - (as above)
                ri = tl.load(qrow_ptr + n0 + i)
                _span(q_ptr, w_ptr, k_ptr, sc_ptr, tab_ptr, len_ptr, out_ptr, n0 + i, ri, e_lo,
                      e_hi, N, G, stride_qn, stride_qh, stride_wn, stride_k, stride_t, stride_o,
                      H, D, HP, DP, SPP, 1, BLOCK_E, HAS_SCALE, DOT_DTYPE, K_PARTS,
                      Q_PARTS)  # fmt: skip


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":  # pragma: no cover - needs a GPU
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


class DotPlan(NamedTuple):
    """How a key tile meets the queries: ``q_parts`` x ``k_parts`` bf16 parts (1 x 1: one dot
    in ``dtype``, q's 16-bit dtype); ``q_parts == 0``: fp32 operands (`INTERPRETER_PLAN`).
    Every plan accumulates exact products in fp32."""

    q_parts: int
    k_parts: int
    dtype: torch.dtype


_PARTS = {torch.bfloat16: 1, torch.float8_e4m3fn: 1, torch.float16: 2, torch.float32: 3}
# The interpreter's 16-bit arithmetic is unreliable (KERNELS.md): there, fp32 dots only.
INTERPRETER_PLAN = DotPlan(0, 0, torch.float32)


def dot_plan(q_dtype: torch.dtype, key_dtype: torch.dtype) -> DotPlan:
    """The GPU plan: 16-bit q with keys of its dtype (or FP8, exact in it): one dot in that
    dtype; other mixes: fp32 (3 parts), fp16 (2) and bf16 / FP8 (1) operands split into bf16
    parts. Raises `KeyError` for other dtypes."""
    if q_dtype in _DOT_DTYPES and (key_dtype == q_dtype or key_dtype in FP8_DTYPES):
        return DotPlan(1, 1, q_dtype)
    return DotPlan(_PARTS[q_dtype], _PARTS[key_dtype], torch.bfloat16)


def launch_config(
    n: int,
    g: int,
    shared: bool,
    key_bytes: int,
    plan: DotPlan,
    device: torch.device,
    *,
    block_q: int | None = None,
    block_e: int | None = None,
    span: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    per_sm: int | None = None,
) -> dict:
    """The launch of ``n`` queries over ``g`` rows (``shared``: queries carry ``qrow``):
    ``BLOCK_Q``, ``BLOCK_E``, ``span`` (rows per program, a multiple of ``BLOCK_E``),
    ``num_warps``, ``num_stages``; the keyword knobs override the defaults (benchmark sweeps).
    Without sharing a program takes one query; rows are split so that up to ``per_sm``
    programs per SM (by default as many as are resident at once) run in one wave. Raises
    `ValueError` for block sizes that are not powers of two of at least 16 rows (``tl.dot``)."""
    # Defaults measured on an H200 (bench/results/indexer_h200.json): 16-bit decode 64-row
    # tiles, 4 warps, 4 programs per SM (50 KB of shared memory each); FP8 decode 128 rows,
    # 8 warps, 2 per SM; prefill 4 queries x 64 rows, 8 warps (2 per SM).
    one_dot = plan.q_parts * plan.k_parts <= 1
    resident = 2
    if one_dot:
        bq = block_q or (4 if shared else 1)
        be = block_e or (64 if shared or key_bytes > 1 else 128)
        warps = num_warps or (8 if shared or key_bytes == 1 else 4)
        resident = 2 if shared or key_bytes == 1 else 4
    else:  # several dots from split operands: fewer queries per tile (registers, shared memory)
        bq = block_q or (2 if shared and plan.k_parts == 1 else 1)
        be = block_e or 64
        warps = num_warps or (8 if bq > 1 else 4)
    if bq & (bq - 1) or be & (be - 1) or be < 16 or (not shared and bq != 1):
        raise ValueError(f"bad block sizes: block_q {bq}, block_e {be} (queries without qrow: 1)")
    blocks = triton.cdiv(max(n, 1), bq)
    tiles = triton.cdiv(max(g, 1), be)
    if span is None:
        # at most one wave: a second, partial wave of equal programs would double the time
        splits = max(1, min(tiles, (per_sm or resident) * _sm_count(device) // blocks))
        span = triton.cdiv(tiles, splits) * be
    elif span % be or span <= 0:
        raise ValueError(f"span {span} must be a positive multiple of block_e {be}")
    stages = num_stages or (3 if one_dot else 2)
    return dict(BLOCK_Q=bq, BLOCK_E=be, span=span, num_warps=warps, num_stages=stages)


def _check(q, w, keys, rows: PoolRows, key_scale) -> None:
    if q.dim() != 3 or w.shape != q.shape[:2] or keys.dim() != 2 or keys.shape[1] != q.shape[2]:
        raise ValueError(f"q {tuple(q.shape)}, w {tuple(w.shape)}, keys {tuple(keys.shape)}")
    if q.dtype not in _PARTS or q.dtype in FP8_DTYPES or keys.dtype not in _PARTS:
        raise ValueError(
            f"q {q.dtype} / keys {keys.dtype}: the kernel takes fp32/bf16/fp16 q and "
            "fp32/bf16/fp16/float8_e4m3fn keys (fp64: index_logits_reference)"
        )
    if rows.num_queries != q.shape[0]:
        raise ValueError(f"rows has {rows.num_queries} queries, q {q.shape[0]}")
    if keys.dtype in FP8_DTYPES and (key_scale is None or key_scale.shape != keys.shape[:1]):
        raise ValueError("FP8 keys need key_scale (one fp32 scale per pool row)")
    if keys.stride(1) != 1:
        raise ValueError("keys must be contiguous along d (the pool is read in place)")


def flash_index_logits(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: torch.Tensor,
    rows: PoolRows,
    *,
    key_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    **knobs,
) -> torch.Tensor:
    """``(N, G)`` fp32 logits of ``q`` ``(N, H, d)`` (fp32/bf16/fp16) with head weights ``w``
    ``(N, H)`` over the pool ``keys`` ``(S, d)`` (bf16/fp16/fp32, or ``float8_e4m3fn`` with
    ``key_scale`` ``(S,)``) read in place through ``rows``; -inf past each query's length
    (lengths are clamped to ``[0, G]``). Written into ``out`` (fp32 ``(N, G)``, unit stride
    along G) when given. The ``knobs`` (``block_q``, ``block_e``, ``span``, ``num_warps``,
    ``num_stages``) override `launch_config`. Raises `ValueError` for inconsistent shapes,
    other dtypes (fp64 is the reference's), FP8 keys without scales, or keys not contiguous
    along d."""
    _check(q, w, keys, rows, key_scale)
    n, h, d = q.shape
    g = rows.num_rows
    if out is None:
        out = torch.empty((n, g), dtype=torch.float32, device=q.device)
    elif out.shape != (n, g) or out.dtype != torch.float32 or (g > 1 and out.stride(1) != 1):
        raise ValueError(f"out must be fp32 ({n}, {g}) with unit stride along G")
    if n == 0 or g == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    table = rows.table if rows.table.stride(1) == 1 else rows.table.contiguous()
    lengths = rows.lengths.contiguous()
    qrow = lengths if rows.qrow is None else rows.qrow.contiguous()
    shared = rows.qrow is not None
    plan = INTERPRETER_PLAN if _INTERPRETED else dot_plan(q.dtype, keys.dtype)
    cfg = launch_config(n, g, shared, keys.element_size(), plan, q.device, **knobs)
    span, bq = cfg.pop("span"), cfg["BLOCK_Q"]
    scale = key_scale.contiguous() if keys.dtype in FP8_DTYPES else None
    grid = (triton.cdiv(n, bq), triton.cdiv(g, span))
    _index_kernel[grid](
        q, w, keys, out if scale is None else scale, table, lengths, qrow, out,
        n, g, span, q.stride(0), q.stride(1), w.stride(0), keys.stride(0), table.stride(0),
        out.stride(0), H=h, D=d, HP=max(16, triton.next_power_of_2(h)),
        DP=max(16, triton.next_power_of_2(d)), SPP=rows.slots_per_page, HAS_QROW=shared,
        HAS_SCALE=scale is not None, DOT_DTYPE=_DOT_DTYPES.get(plan.dtype, tl.bfloat16),
        K_PARTS=plan.k_parts, Q_PARTS=plan.q_parts, **cfg,
    )  # fmt: skip
    return out
