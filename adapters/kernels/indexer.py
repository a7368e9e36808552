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
* FP8 keys with 16-bit q take one of several paths (`Fp8Mode`: where the FP8 tile is
  converted, which dot operand it is, or fp8 x fp8 dots with q in two e4m3 parts), chosen by
  `FP8_DECODE_MODE` / `FP8_PREFILL_MODE`; each has its launch defaults in `ONE_DOT_LAUNCH`.
* Offsets are int64 (``slot * d`` and ``n * G`` may pass 2**31).

Importing this module imports Triton and defines the kernel; `adapters.kernels` imports it only
when a CUDA tensor (or a test under ``TRITON_INTERPRET=1``) needs it.
"""

from __future__ import annotations

import enum
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .indexer_reference import FP8_DTYPES
from .rows import PoolRows

__all__ = [
    "FP8_DECODE_MODE",
    "FP8_PREFILL_MODE",
    "INTERPRETER_PLAN",
    "ONE_DOT_LAUNCH",
    "DotPlan",
    "Fp8Mode",
    "Launch",
    "dot_plan",
    "flash_index_logits",
    "fp8_mode_for",
    "launch_config",
]

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
def _pow2(e):
    """``2**e`` in fp32, exactly, for int32 ``e`` in ``[-126, 127]``."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _column_exponents(qt, TOP: tl.constexpr):
    """Per column of fp32 ``qt`` ``(DP, C)``: the ``a`` with ``max|column| * 2**a`` in
    ``[2**TOP, 2**(TOP + 1))`` (clamped to ``[-100, 100]``: all-zero columns)."""
    m = tl.max(tl.abs(qt), axis=0)
    e = ((m.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 m) for normal m
    return tl.minimum(tl.maximum(TOP - e, -100), 100)


@triton.jit
def _scaled_q(qt, wv, INTERPRETED: tl.constexpr):
    """fp16 q operands (Q_FORMAT 1) from fp32 ``Q^T``: each column scaled by a power of two
    into fp16's top binade (bf16 values there are exact in fp16); its ``2**-a`` moves to the
    head weights ``wv`` (``relu(s x) = x relu(s)`` for ``x > 0``)."""
    a = _column_exponents(qt, 14)
    qs = (qt * _pow2(a)[None, :]).to(tl.float16)
    if INTERPRETED:
        return qs.to(tl.float32), wv * _pow2(-a)
    return qs, wv * _pow2(-a)  # pragma: no cover - needs a GPU


@triton.jit
def _e4m3_values(x):
    """fp32 ``x`` (``|x| < 2**13``) rounded to the nearest e4m3 value, in fp32: 4 significant
    bits (Veltkamp's split by ``2**20 + 1``), below 2**-6 multiples of 2**-9 (subnormals)."""
    t = x * 1048577.0
    sub = (x + 24576.0) - 24576.0  # 1.5 * 2**14: fp32 steps of 2**-9
    return tl.where(tl.abs(x) < 0.015625, sub, t - (t - x))


@triton.jit
def _fp8_q(q_ptr, qt, wv, n0, N, stride_qn, stride_qh, H: tl.constexpr, D: tl.constexpr,
           HP: tl.constexpr, DP: tl.constexpr, BQ: tl.constexpr,
           INTERPRETED: tl.constexpr):  # fmt: skip
    """FP8 q operands (Q_FORMAT 2): ``(DP, 2 BQ*HP)``, columns ``2c, 2c + 1`` the parts of
    column ``c`` of ``Q^T`` (``qt``) scaled by a power of two into the top binade 2**7: ``p1``
    its e4m3 rounding, ``p2`` the rest's times 16 (at most 4 bits: bf16 values are exact down
    to 2**-14 of the column's largest); `_rows_dot` adds ``hi + lo / 16``. Each column is
    loaded twice (the pairs in place: no shuffles); ``2**-a`` moves to ``wv`` as in
    `_scaled_q`."""
    c = tl.arange(0, 2 * BQ * HP)
    qn = n0 + c // (2 * HP)
    hh = (c // 2) % HP
    dd = tl.arange(0, DP)
    q_ok = (qn < N) & (hh < H)
    q_off = qn.to(tl.int64) * stride_qn + hh * stride_qh
    x = tl.load(q_ptr + q_off[None, :] + dd[:, None], mask=q_ok[None, :] & (dd[:, None] < D))
    x = x.to(tl.float32)
    x = x * _pow2(_column_exponents(x, 7))[None, :]
    if INTERPRETED:  # its fp32 -> e4m3 cast is wrong at times (a binade off): by arithmetic
        p1 = _e4m3_values(x)
        qs = tl.where((c % 2 == 0)[None, :], p1, _e4m3_values((x - p1) * 16.0))
    else:  # pragma: no cover - needs a GPU
        p1 = x.to(tl.float8e4nv)
        p2 = ((x - p1.to(tl.float32)) * 16.0).to(tl.float8e4nv)
        qs = tl.where((c % 2 == 0)[None, :], p1, p2)
    return qs, wv * _pow2(-_column_exponents(qt, 7))


@triton.jit
def _slots(tab_row, e0, stop, SPP: tl.constexpr, BLOCK_E: tl.constexpr):
    """Pool slots ``(BLOCK_E,)`` of rows ``e0 ..`` (slot 0 from ``stop`` on)."""
    g = e0 + tl.arange(0, BLOCK_E)
    page = tl.load(tab_row + g // SPP, mask=g < stop, other=0).to(tl.int64)
    return page * SPP + g % SPP


@triton.jit
def _keys(k_ptr, sc_ptr, slot, e0, stop, stride_k, dd, D: tl.constexpr, BLOCK_E: tl.constexpr,
          HAS_SCALE: tl.constexpr):  # fmt: skip
    """Keys ``(BLOCK_E, DP)`` and scales of rows ``e0 ..`` at ``slot`` (zeros from ``stop``)."""
    g_ok = e0 + tl.arange(0, BLOCK_E) < stop
    k_msk = g_ok[:, None] & (dd[None, :] < D)
    k = tl.load(k_ptr + slot[:, None] * stride_k + dd[None, :], mask=k_msk, other=0.0)
    if HAS_SCALE:
        sc = tl.load(sc_ptr + slot, mask=g_ok, other=0.0).to(tl.float32)
    else:
        sc = tl.full((BLOCK_E,), 1.0, tl.float32)
    return k, sc


@triton.jit
def _rows_out(s, sc, wv, g, lens, e_hi, n_ok, out_row, BQ: tl.constexpr, HP: tl.constexpr,
              HAS_SCALE: tl.constexpr):  # fmt: skip
    """Stores the logits of products ``s`` ``(BLOCK_E, BQ*HP)`` (keys on rows)."""
    if HAS_SCALE:
        s = s * sc[:, None]
    s = tl.maximum(s, 0.0) * wv[None, :]
    logit = tl.sum(tl.reshape(s, (s.shape[0], BQ, HP)), axis=2)  # (BLOCK_E, BQ)
    logit = tl.where(g[:, None] < lens[None, :], logit, float("-inf"))
    tl.store(out_row[None, :] + g[:, None], logit, mask=(g < e_hi)[:, None] & n_ok[None, :])


@triton.jit
def _cols_out(s, sc, wv, g, lens, e_hi, n_ok, out_row, BQ: tl.constexpr, HP: tl.constexpr,
              HAS_SCALE: tl.constexpr):  # fmt: skip
    """Stores the logits of products ``s`` ``(BQ*HP, BLOCK_E)`` (keys on columns)."""
    if HAS_SCALE:
        s = s * sc[None, :]
    s = tl.maximum(s, 0.0) * wv[:, None]
    logit = tl.sum(tl.reshape(s, (BQ, HP, s.shape[1])), axis=1)  # (BQ, BLOCK_E)
    logit = tl.where(g[None, :] < lens[:, None], logit, float("-inf"))
    tl.store(out_row[:, None] + g[None, :], logit, mask=(g < e_hi)[None, :] & n_ok[:, None])


@triton.jit
def _operand(k, DOT_DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """A key tile as a dot operand: fp32 in the interpreter, else ``DOT_DTYPE``."""
    if INTERPRETED:
        return k.to(tl.float32)
    return k.to(DOT_DTYPE)  # pragma: no cover - needs a GPU


@triton.jit
def _rows_dot(k, q1, q2, q3, DOT_DTYPE: tl.constexpr, K_PARTS: tl.constexpr,
              Q_PARTS: tl.constexpr, Q_FORMAT: tl.constexpr):  # fmt: skip
    """``K @ Q^T`` ``(BLOCK_E, BQ*HP)`` in fp32: the interpreter in fp32 (``Q_PARTS`` 0),
    the interleaved e4m3 parts of q (``Q_FORMAT`` 2) in one fp8 dot, else `_dot16`."""
    if Q_PARTS == 0:
        s = tl.dot(k.to(tl.float32), q1, input_precision="ieee")
    elif Q_FORMAT == 2:  # pragma: no cover - needs a GPU
        s = tl.dot(k, q1)  # fp8 x fp8
    else:  # pragma: no cover - needs a GPU
        s = _dot16(k, q1, q2, q3, K_PARTS, Q_PARTS, DOT_DTYPE)
    if Q_FORMAT == 2:  # the two parts' products: adjacent columns, in one thread
        hi, lo = tl.split(tl.reshape(s, (s.shape[0], s.shape[1] // 2, 2)))
        s = hi + lo * 0.0625
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
    KEY_OPERAND: tl.constexpr,
    Q_FORMAT: tl.constexpr,
    AHEAD: tl.constexpr,
):
    """Logits of queries ``n0 .. n0 + BQ`` (all reading row set ``r``) for rows
    ``[e_lo, e_hi)``: key tiles up to the longest length, -inf after it. ``KEY_OPERAND``
    (`Fp8Mode`): 0 keys the dot's A operand, 1 its B operand (``Q @ K^T``), 2 the A operand
    converted a tile ahead (loop-carried; ``AHEAD``: its table entries two tiles ahead);
    ``Q_FORMAT`` 1: fp16 q (`_scaled_q`), 2: two e4m3 parts of q (`_fp8_q`)."""
    c = tl.arange(0, BQ * HP)  # dot columns (KEY_OPERAND 1: rows): (query, head)
    qn = n0 + c // HP
    hh = c % HP
    dd = tl.arange(0, DP)
    q_ok = (qn < N) & (hh < H)
    q_off = qn.to(tl.int64) * stride_qn + hh * stride_qh
    qt = tl.load(q_ptr + q_off[None, :] + dd[:, None], mask=q_ok[None, :] & (dd[:, None] < D))
    qt = qt.to(tl.float32)  # (DP, BQ*HP)
    wv = tl.load(w_ptr + qn.to(tl.int64) * stride_wn + hh, mask=q_ok, other=0.0).to(tl.float32)
    if Q_FORMAT == 1:
        q1, wv = _scaled_q(qt, wv, Q_PARTS == 0)
        q2 = q1
        q3 = q1
    elif Q_FORMAT == 2:
        q1, wv = _fp8_q(q_ptr, qt, wv, n0, N, stride_qn, stride_qh, H, D, HP, DP, BQ,
                        Q_PARTS == 0)  # fmt: skip
        q2 = q1
        q3 = q1
    elif Q_PARTS == 0:  # the interpreter (`INTERPRETER_PLAN`): fp32 operands
        q1 = qt
        q2 = qt
        q3 = qt
    else:  # pragma: no cover - needs a GPU
        q1, q2, q3 = _q_operands(qt, K_PARTS, Q_PARTS, DOT_DTYPE)
    j = tl.arange(0, BQ)
    n_ok = n0 + j < N
    lens = tl.load(len_ptr + n0 + j, mask=n_ok, other=0)
    lens = tl.minimum(tl.maximum(lens, 0), G).to(tl.int32)  # (BQ,)
    stop = tl.minimum(e_hi, tl.max(lens, axis=0))
    out_row = out_ptr + (n0 + j).to(tl.int64) * stride_o  # (BQ,)
    tab_row = tab_ptr + r.to(tl.int64) * stride_t
    if KEY_OPERAND == 2:  # tile 0 converted: a loop-carried dot operand
        slot = _slots(tab_row, e_lo, stop, SPP, BLOCK_E)
        k, sc = _keys(k_ptr, sc_ptr, slot, e_lo, stop, stride_k, dd, D, BLOCK_E, HAS_SCALE)
        kb = _operand(k, DOT_DTYPE, Q_PARTS == 0)
        if AHEAD:  # decode, latency-bound: the table read a tile further ahead (a prefill's
            # table row is hot in cache, and there registers set the occupancy)
            slot = _slots(tab_row, e_lo + BLOCK_E, stop, SPP, BLOCK_E)
    for e0 in range(e_lo, stop, BLOCK_E):
        g = e0 + tl.arange(0, BLOCK_E)
        if KEY_OPERAND == 2:  # the next tile's loads in flight over this tile's dot
            e1 = e0 + BLOCK_E
            if not AHEAD:
                slot = _slots(tab_row, e1, stop, SPP, BLOCK_E)
            k, sc_next = _keys(k_ptr, sc_ptr, slot, e1, stop, stride_k, dd, D, BLOCK_E,
                               HAS_SCALE)  # fmt: skip
            if AHEAD:
                slot = _slots(tab_row, e1 + BLOCK_E, stop, SPP, BLOCK_E)
            s = _rows_dot(kb, q1, q2, q3, DOT_DTYPE, K_PARTS, Q_PARTS, Q_FORMAT)
            _rows_out(s, sc, wv, g, lens, e_hi, n_ok, out_row, BQ, HP, HAS_SCALE)
            kb = _operand(k, DOT_DTYPE, Q_PARTS == 0)
            sc = sc_next
        else:
            slot = _slots(tab_row, e0, stop, SPP, BLOCK_E)
            k, sc = _keys(k_ptr, sc_ptr, slot, e0, stop, stride_k, dd, D, BLOCK_E, HAS_SCALE)
            if KEY_OPERAND == 1:  # (BQ*HP, BLOCK_E)
                if Q_PARTS == 0:
                    s = tl.dot(tl.trans(q1), tl.trans(k.to(tl.float32)), input_precision="ieee")
                else:  # pragma: no cover - needs a GPU
                    s = tl.dot(tl.trans(q1), tl.trans(k.to(DOT_DTYPE)))
                _cols_out(s, sc, wv, g, lens, e_hi, n_ok, out_row, BQ, HP, HAS_SCALE)
            else:
                s = _rows_dot(k, q1, q2, q3, DOT_DTYPE, K_PARTS, Q_PARTS, Q_FORMAT)
                _rows_out(s, sc, wv, g, lens, e_hi, n_ok, out_row, BQ, HP, HAS_SCALE)
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
    KEY_OPERAND: tl.constexpr,
    Q_FORMAT: tl.constexpr,
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
              1, BLOCK_E, HAS_SCALE, DOT_DTYPE, K_PARTS, Q_PARTS, KEY_OPERAND, Q_FORMAT,
              True)  # fmt: skip
    else:
        j = tl.arange(0, BLOCK_Q)
        rs = tl.load(qrow_ptr + n0 + j, mask=n0 + j < N, other=r0)
        if tl.min(rs, axis=0) == tl.max(rs, axis=0):  # one row set: share every key tile
            _span(q_ptr, w_ptr, k_ptr, sc_ptr, tab_ptr, len_ptr, out_ptr, n0, r0, e_lo, e_hi,
                  N, G, stride_qn, stride_qh, stride_wn, stride_k, stride_t, stride_o, H, D, HP,
                  DP, SPP, BLOCK_Q, BLOCK_E, HAS_SCALE, DOT_DTYPE, K_PARTS, Q_PARTS, KEY_OPERAND,
                  Q_FORMAT, False)  # fmt: skip
        else:  # query by query, each through its own row set
            for i in range(0, tl.minimum(N - n0, BLOCK_Q)):  # pragma: no branch - (as above)
                ri = tl.load(qrow_ptr + n0 + i)
                _span(q_ptr, w_ptr, k_ptr, sc_ptr, tab_ptr, len_ptr, out_ptr, n0 + i, ri, e_lo,
                      e_hi, N, G, stride_qn, stride_qh, stride_wn, stride_k, stride_t, stride_o,
                      H, D, HP, DP, SPP, 1, BLOCK_E, HAS_SCALE, DOT_DTYPE, K_PARTS,
                      Q_PARTS, KEY_OPERAND, Q_FORMAT, False)  # fmt: skip


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


class Fp8Mode(enum.IntEnum):
    """How FP8 keys meet 16-bit queries on the GPU (every other dtype mix: `DOT_A`, through
    its `dot_plan`). All but `FP8_DOT` are exact to fp32 rounding, as the reference. What the
    compiler makes of each (Triton 3.6, sm_90a):

    * ``DOT_A``: the key tile is the dot's A operand, cast to q's dtype as it is read: the
      FP8 tile stays in shared memory (8-byte async copies, one buffer below 5 stages) and is
      read into the dot-operand registers two bytes at a time, converted there.
    * ``KEYS_B``: keys the B operand (``Q (BQ*H, d) @ K^T``, heads on rows): converted to
      q's dtype in registers and stored so to shared memory, from where the wgmma reads them
      (B always comes from shared memory); 16-byte async copies. The head sum crosses the
      warps of a warp group.
    * ``STAGED``: keys the A operand, converted one tile ahead and carried through the loop:
      the compiler stages a loop-carried operand in shared memory as it does a loaded one, and
      the wgmma reads it there. The next tile's 16-byte loads (into registers) are in flight
      over the current dot; at decode the table is read two tiles ahead.
    * ``STAGED_F16``: ``STAGED`` in fp16 (e4m3 -> fp16 is one instruction per two values,
      bf16 three), q scaled per (query, head) by a power of two into fp16's top binade: bf16
      values there are exact in fp16 (the scale moves to ``w``).
    * ``FP8_DOT``: no conversion: q as two e4m3 parts ``p1 + p2 / 16`` per (query, head) (a
      power-of-two scale; bf16-exact but for entries below 2**-14 of the largest),
      interleaved along N: one fp8 x fp8 dot straight from the loaded tile. Hopper adds FP8
      products in fewer bits than fp32: approximate (``bench/indexer.py`` reports the error).
    """

    DOT_A = 0
    KEYS_B = 1
    STAGED = 2
    STAGED_F16 = 3
    FP8_DOT = 4

    @property
    def key_operand(self) -> int:
        """The kernel's ``KEY_OPERAND``: 0 A, 1 B, 2 A converted a tile ahead."""
        return {Fp8Mode.KEYS_B: 1, Fp8Mode.STAGED: 2, Fp8Mode.STAGED_F16: 2}.get(self, 0)

    @property
    def q_format(self) -> int:
        """The kernel's ``Q_FORMAT``: 0 q's plan, 1 scaled fp16, 2 two e4m3 parts."""
        return {Fp8Mode.STAGED_F16: 1, Fp8Mode.FP8_DOT: 2}.get(self, 0)


# The FP8 paths in use: the switch once bench/indexer.py --fp8-candidates has measured them
# (each mode's launch defaults are in `ONE_DOT_LAUNCH`).
FP8_DECODE_MODE = Fp8Mode.DOT_A
FP8_PREFILL_MODE = Fp8Mode.DOT_A


class Launch(NamedTuple):
    """Defaults of one kind of launch (`launch_config`)."""

    block_q: int
    block_e: int
    num_warps: int
    per_sm: int  # programs per SM in the one wave
    num_stages: int
    maxnreg: int | None = None  # registers per thread (None: as the compiler likes)


# 16-bit keys, DOT_A: measured on an H200 (bench/results/indexer_h200.json): 16-bit decode
# 64-row tiles, 4 warps, 4 programs per SM (50 KB of shared memory each); FP8 decode 128
# rows, 8 warps, 2 per SM; prefill 4 queries x 64 rows, 8 warps (2 per SM: but FP8 DOT_A
# compiles to 171 registers a thread, so only one is resident). The other FP8 modes: first
# guesses from their compiled registers and shared memory (Triton 3.6, sm_90a: 128 registers
# x 8 warps leave room for 2 programs per SM; ``maxnreg`` holds ptxas there), until measured.
ONE_DOT_LAUNCH = {  # (shared, FP8 mode or None: 16-bit keys)
    (False, None): Launch(1, 64, 4, 4, 3),
    (True, None): Launch(4, 64, 8, 2, 3),
    (False, Fp8Mode.DOT_A): Launch(1, 128, 8, 2, 3),
    (True, Fp8Mode.DOT_A): Launch(4, 64, 8, 2, 3),
    (False, Fp8Mode.KEYS_B): Launch(1, 128, 4, 3, 3),
    (True, Fp8Mode.KEYS_B): Launch(4, 64, 8, 2, 3, 128),
    (False, Fp8Mode.STAGED): Launch(1, 128, 8, 2, 3),
    (True, Fp8Mode.STAGED): Launch(4, 64, 8, 2, 3, 128),
    (False, Fp8Mode.STAGED_F16): Launch(1, 128, 8, 2, 3),
    (True, Fp8Mode.STAGED_F16): Launch(4, 64, 8, 2, 3, 128),
    (False, Fp8Mode.FP8_DOT): Launch(1, 128, 8, 2, 4),
    (True, Fp8Mode.FP8_DOT): Launch(2, 64, 8, 2, 3, 128),
}


def fp8_mode_for(
    q_dtype: torch.dtype, key_dtype: torch.dtype, shared: bool, requested: Fp8Mode | None = None
) -> Fp8Mode:
    """The FP8 path of a launch: ``requested``, else `FP8_PREFILL_MODE` (``shared``) or
    `FP8_DECODE_MODE` for FP8 keys with 16-bit q, else ``DOT_A`` (the other mixes have no
    choice). ``FP8_DOT`` needs bf16 q (its two e4m3 parts hold 8 of fp16's 11 bits): a
    default of ``FP8_DOT`` gives fp16 q ``DOT_A``. Raises `ValueError` for a requested mode
    other than ``DOT_A`` that does not apply."""
    applies = key_dtype in FP8_DTYPES and q_dtype in _DOT_DTYPES
    if requested is None:
        mode = (FP8_PREFILL_MODE if shared else FP8_DECODE_MODE) if applies else Fp8Mode.DOT_A
        return Fp8Mode.DOT_A if mode == Fp8Mode.FP8_DOT and q_dtype != torch.bfloat16 else mode
    requested = Fp8Mode(requested)
    if requested != Fp8Mode.DOT_A and not applies:
        raise ValueError(f"fp8_mode {requested.name} needs FP8 keys and 16-bit q")
    if requested == Fp8Mode.FP8_DOT and q_dtype != torch.bfloat16:
        raise ValueError("fp8_mode FP8_DOT needs bf16 q (two e4m3 parts hold 8 bits)")
    return requested


def launch_config(
    n: int,
    g: int,
    shared: bool,
    key_bytes: int,
    plan: DotPlan,
    device: torch.device,
    *,
    fp8_mode: Fp8Mode = Fp8Mode.DOT_A,
    block_q: int | None = None,
    block_e: int | None = None,
    span: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    per_sm: int | None = None,
    maxnreg: int | None = None,
) -> dict:
    """The launch of ``n`` queries over ``g`` rows (``shared``: queries carry ``qrow``) with
    keys of ``key_bytes`` (1: FP8, through ``fp8_mode``): ``BLOCK_Q``, ``BLOCK_E``, ``span``
    (rows per program, a multiple of ``BLOCK_E``), ``num_warps``, ``num_stages``,
    ``maxnreg`` (None: the compiler's choice), ``fp8_mode``; the keyword knobs override the
    defaults (benchmark sweeps). Without sharing a program takes one query; rows are split so
    that up to ``per_sm`` programs per SM (by default as many as are resident at once) run in
    one wave. Raises `ValueError` for block sizes that are not powers of two of at least 16
    rows (``tl.dot``)."""
    if plan.q_parts * plan.k_parts <= 1:
        dft = ONE_DOT_LAUNCH[(shared, Fp8Mode(fp8_mode) if key_bytes == 1 else None)]
    else:  # several dots from split operands: fewer queries per tile (registers, shared memory)
        bq = 2 if shared and plan.k_parts == 1 else 1
        dft = Launch(bq, 64, 8 if bq > 1 else 4, 2, 2)
    bq, be = block_q or dft.block_q, block_e or dft.block_e
    if bq & (bq - 1) or be & (be - 1) or be < 16 or (not shared and bq != 1):
        raise ValueError(f"bad block sizes: block_q {bq}, block_e {be} (queries without qrow: 1)")
    blocks = triton.cdiv(max(n, 1), bq)
    tiles = triton.cdiv(max(g, 1), be)
    if span is None:
        # at most one wave: a second, partial wave of equal programs would double the time
        splits = max(1, min(tiles, (per_sm or dft.per_sm) * _sm_count(device) // blocks))
        span = triton.cdiv(tiles, splits) * be
    elif span % be or span <= 0:
        raise ValueError(f"span {span} must be a positive multiple of block_e {be}")
    return dict(BLOCK_Q=bq, BLOCK_E=be, span=span, num_warps=num_warps or dft.num_warps,
                num_stages=num_stages or dft.num_stages, maxnreg=maxnreg or dft.maxnreg,
                fp8_mode=Fp8Mode(fp8_mode))  # fmt: skip


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
    along G) when given. The ``knobs`` (``fp8_mode``, ``block_q``, ``block_e``, ``span``,
    ``num_warps``, ``num_stages``, ``per_sm``, ``maxnreg``) override `fp8_mode_for` and
    `launch_config`.
    Raises `ValueError` for inconsistent shapes, other dtypes (fp64 is the reference's), FP8
    keys without scales, keys not contiguous along d, or an FP8 mode that does not apply."""
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
    mode = fp8_mode_for(q.dtype, keys.dtype, shared, knobs.pop("fp8_mode", None))
    cfg = launch_config(n, g, shared, keys.element_size(), plan, q.device, fp8_mode=mode, **knobs)
    span, bq, mode = cfg.pop("span"), cfg["BLOCK_Q"], cfg.pop("fp8_mode")
    if cfg["maxnreg"] is None:
        del cfg["maxnreg"]
    dot_dtype = tl.float16 if mode.q_format == 1 else _DOT_DTYPES.get(plan.dtype, tl.bfloat16)
    scale = key_scale.contiguous() if key_scale is not None and keys.dtype in FP8_DTYPES else None
    grid = (triton.cdiv(n, bq), triton.cdiv(g, span))
    _index_kernel[grid](
        q, w, keys, out if scale is None else scale, table, lengths, qrow, out,
        n, g, span, q.stride(0), q.stride(1), w.stride(0), keys.stride(0), table.stride(0),
        out.stride(0), H=h, D=d, HP=max(16, triton.next_power_of_2(h)),
        DP=max(16, triton.next_power_of_2(d)), SPP=rows.slots_per_page, HAS_QROW=shared,
        HAS_SCALE=scale is not None, DOT_DTYPE=dot_dtype, K_PARTS=plan.k_parts,
        Q_PARTS=plan.q_parts, KEY_OPERAND=mode.key_operand, Q_FORMAT=mode.q_format, **cfg,
    )  # fmt: skip
    return out
