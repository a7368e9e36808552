"""The query-side operands of the fused indexer's dots (`indexer`): bf16 parts of fp32 values
whose sum is the value (`_parts`, `_dot16`), fp16 q scaled by powers of two (`_scaled_q`), q as
two e4m3 parts for fp8 x fp8 dots (`_fp8_q`), and q rounded to e4m3 once (`_e4m3_q`, the FP8
indexer's own rounding). Triton device functions only.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def _e4m3_q(qt, wv, INTERPRETED: tl.constexpr):
    """q rounded to e4m3 (Q_FORMAT 3: V4's FP8 indexer, q and keys both e4m3): each column of
    fp32 ``Q^T`` (one query head) scaled by a power of two into ``[2**7, 2**8)`` and rounded
    to nearest, ties to even (`indexer_reference.round_q_e4m3` is the same rounding); its
    ``2**-a`` moves to the head weights ``wv`` as in `_scaled_q`."""
    a = _column_exponents(qt, 7)
    x = qt * _pow2(a)[None, :]
    if INTERPRETED:  # the interpreter's fp32 -> e4m3 cast is wrong at times: by arithmetic
        return _e4m3_values(x), wv * _pow2(-a)
    return x.to(tl.float8e4nv), wv * _pow2(-a)  # pragma: no cover - needs a GPU
