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
* FP4 keys (V4.1: uint8, two e2m1 codes a byte, one fp32 scale per 32 channels) are unpacked
  in registers by arithmetic (`indexer_keys`), times their block scales (the scale varies
  along d: applied before the dot), and meet q as bf16 keys would (grid values times powers
  of two are exact in bf16): one dot for bf16 q, split q parts otherwise; launch defaults
  `FP4_LAUNCH` (unmeasured).
* FP8 keys with 16-bit q take one of several paths (`Fp8Mode`), see `indexer_plan`.
* Offsets are int64 (``slot * d`` and ``n * G`` may pass 2**31).

Importing this module imports Triton and defines the kernel; `adapters.kernels` imports it only
when a CUDA tensor (or a test under ``TRITON_INTERPRET=1``) needs it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .indexer_keys import _keys, _slots
from .indexer_logits import _cols_out, _rows_out
from .indexer_operands import _dot16, _e4m3_q, _fp8_q, _q_operands, _scaled_q
from .indexer_plan import (
    FP4_LAUNCH,
    FP8_DECODE_MODE,
    FP8_PREFILL_MODE,
    INTERPRETER_PLAN,
    ONE_DOT_LAUNCH,
    SHARED_PREFIX_MIN_ROWS,
    DotPlan,
    Fp8Mode,
    Launch,
    check_operands,
    dot_plan,
    fp8_mode_for,
    launch_config,
)
from .indexer_reference import FP4_DTYPE, FP8_DTYPES
from .rows import PoolRows, shared_prefix_rows

__all__ = [
    "FP4_LAUNCH",
    "FP8_DECODE_MODE",
    "FP8_PREFILL_MODE",
    "INTERPRETER_PLAN",
    "ONE_DOT_LAUNCH",
    "DotPlan",
    "Fp8Mode",
    "Launch",
    "dot_plan",
    "SHARED_PREFIX_MIN_ROWS",
    "flash_index_logits",
    "fp8_mode_for",
    "launch_config",
    "shared_prefix_rows",
]

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
_DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


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
    e4m3 q (``Q_FORMAT`` 2: two interleaved parts, 3: rounded once) in one fp8 dot, else
    `_dot16`."""
    if Q_PARTS == 0:
        s = tl.dot(k.to(tl.float32), q1, input_precision="ieee")
    elif Q_FORMAT >= 2:  # pragma: no cover - needs a GPU
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
    FP4: tl.constexpr,
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
    ``Q_FORMAT`` 1: fp16 q (`_scaled_q`), 2: two e4m3 parts of q (`_fp8_q`), 3: q rounded to
    e4m3 (`_e4m3_q`)."""
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
    elif Q_FORMAT == 3:
        q1, wv = _e4m3_q(qt, wv, Q_PARTS == 0)
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
        k, sc = _keys(k_ptr, sc_ptr, slot, e_lo, stop, stride_k, dd, D, BLOCK_E, HAS_SCALE,
                      FP4)  # fmt: skip
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
                               HAS_SCALE, FP4)  # fmt: skip
            if AHEAD:
                slot = _slots(tab_row, e1 + BLOCK_E, stop, SPP, BLOCK_E)
            s = _rows_dot(kb, q1, q2, q3, DOT_DTYPE, K_PARTS, Q_PARTS, Q_FORMAT)
            _rows_out(s, sc, wv, g, lens, e_hi, n_ok, out_row, BQ, HP, HAS_SCALE)
            kb = _operand(k, DOT_DTYPE, Q_PARTS == 0)
            sc = sc_next
        else:
            slot = _slots(tab_row, e0, stop, SPP, BLOCK_E)
            k, sc = _keys(k_ptr, sc_ptr, slot, e0, stop, stride_k, dd, D, BLOCK_E, HAS_SCALE,
                          FP4)  # fmt: skip
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
    clip_ptr,
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
    FP4: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    K_PARTS: tl.constexpr,
    Q_PARTS: tl.constexpr,
    KEY_OPERAND: tl.constexpr,
    Q_FORMAT: tl.constexpr,
    CLIP: tl.constexpr,
):
    """Program ``(b, s)``: queries ``b*BLOCK_Q ..``, rows ``[s*span, (s+1)*span) & [0, G)``,
    and with ``CLIP`` 1 only those below ``*clip_ptr``, with ``CLIP`` 2 only those from it on
    (the two halves of a shared-prefix decode)."""
    n0 = tl.program_id(0) * BLOCK_Q
    e_lo = tl.program_id(1) * span
    e_hi = tl.minimum(e_lo + span, G)
    if CLIP == 1:
        e_hi = tl.minimum(e_hi, tl.load(clip_ptr))
    elif CLIP == 2:
        e_lo = tl.maximum(e_lo, tl.load(clip_ptr))
    if HAS_QROW:
        r0 = tl.load(qrow_ptr + n0)
    else:  # decode: query n reads row set n (BLOCK_Q == 1)
        r0 = n0
    if BLOCK_Q == 1:
        _span(q_ptr, w_ptr, k_ptr, sc_ptr, tab_ptr, len_ptr, out_ptr, n0, r0, e_lo, e_hi, N, G,
              stride_qn, stride_qh, stride_wn, stride_k, stride_t, stride_o, H, D, HP, DP, SPP,
              1, BLOCK_E, HAS_SCALE, FP4, DOT_DTYPE, K_PARTS, Q_PARTS, KEY_OPERAND, Q_FORMAT,
              True)  # fmt: skip
    else:
        j = tl.arange(0, BLOCK_Q)
        rs = tl.load(qrow_ptr + n0 + j, mask=n0 + j < N, other=r0)
        if tl.min(rs, axis=0) == tl.max(rs, axis=0):  # one row set: share every key tile
            _span(q_ptr, w_ptr, k_ptr, sc_ptr, tab_ptr, len_ptr, out_ptr, n0, r0, e_lo, e_hi,
                  N, G, stride_qn, stride_qh, stride_wn, stride_k, stride_t, stride_o, H, D, HP,
                  DP, SPP, BLOCK_Q, BLOCK_E, HAS_SCALE, FP4, DOT_DTYPE, K_PARTS, Q_PARTS,
                  KEY_OPERAND, Q_FORMAT, False)  # fmt: skip
        else:  # query by query, each through its own row set
            for i in range(0, tl.minimum(N - n0, BLOCK_Q)):  # pragma: no branch - (as above)
                ri = tl.load(qrow_ptr + n0 + i)
                _span(q_ptr, w_ptr, k_ptr, sc_ptr, tab_ptr, len_ptr, out_ptr, n0 + i, ri, e_lo,
                      e_hi, N, G, stride_qn, stride_qh, stride_wn, stride_k, stride_t, stride_o,
                      H, D, HP, DP, SPP, 1, BLOCK_E, HAS_SCALE, FP4, DOT_DTYPE, K_PARTS,
                      Q_PARTS, KEY_OPERAND, Q_FORMAT, False)  # fmt: skip


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
    ``key_scale`` ``(S,)``, or FP4: uint8 ``(S, d // 2)``, two e2m1 codes a byte, with
    ``key_scale`` ``(S, d // 32)``) read in place through ``rows``; -inf past each query's
    length (lengths are clamped to ``[0, G]``). Written into ``out`` (fp32 ``(N, G)``, unit stride
    along G) when given. The ``knobs`` (``fp8_mode``, ``block_q``, ``block_e``, ``span``,
    ``num_warps``, ``num_stages``, ``per_sm``, ``maxnreg``) override `fp8_mode_for` and
    `launch_config`; ``shared_prefix`` (decode: one query per row set) forces the shared-prefix
    split on or off (default: on from `SHARED_PREFIX_MIN_ROWS` rows; ``block_q`` then sizes the
    shared half's blocks).
    Raises `ValueError` for inconsistent shapes, other dtypes (fp64 is the reference's), FP8
    or FP4 keys without (the right) scales, keys not contiguous along d, or an FP8 mode that
    does not apply."""
    check_operands(q, w, keys, rows, key_scale)
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
    plan = INTERPRETER_PLAN if _INTERPRETED else dot_plan(q.dtype, keys.dtype)
    requested = knobs.pop("fp8_mode", None)
    split = knobs.pop("shared_prefix", None)
    if split is None:
        split = rows.qrow is None and n > 1 and g >= SHARED_PREFIX_MIN_ROWS
    launch = _Launch(q, w, keys, key_scale, table, lengths, out, plan, rows.slots_per_page)
    if rows.qrow is not None:
        launch(rows.qrow.contiguous(), True, requested, knobs)
    elif not split or n == 1:
        launch(None, False, requested, knobs)
    else:  # the rows every request shares with request 0 once for all (a prefill's tiles),
        # then each request's own rows (a decode's); the split is computed on the device
        shared = shared_prefix_rows(table, rows.slots_per_page)
        mode = fp8_mode_for(q.dtype, keys.dtype, False, requested)  # one rounding for both
        everyone_reads_set_0 = torch.zeros(n, dtype=torch.long, device=q.device)
        launch(everyone_reads_set_0, True, mode, knobs, clip=(1, shared))
        own = {k: v for k, v in knobs.items() if k != "block_q"}  # one query a program
        launch(None, False, mode, own, clip=(2, shared))
    return out


class _Launch:
    """One `_index_kernel` launch over the operands of a `flash_index_logits` call."""

    def __init__(self, q, w, keys, key_scale, table, lengths, out, plan, spp) -> None:
        self.q, self.w, self.keys, self.out = q, w, keys, out
        self.table, self.lengths, self.plan, self.spp = table, lengths, plan, spp
        self.fp4 = keys.dtype == FP4_DTYPE
        scaled = keys.dtype in FP8_DTYPES + (FP4_DTYPE,)
        self.scale = key_scale.contiguous() if key_scale is not None and scaled else None

    def __call__(self, qrow, shared: bool, fp8_mode, knobs: dict, clip=(0, None)) -> None:
        q, keys, out, plan = self.q, self.keys, self.out, self.plan
        (n, h, d), g = q.shape, out.shape[1]
        mode = fp8_mode_for(q.dtype, keys.dtype, shared, fp8_mode)
        cfg = launch_config(n, g, shared, keys.element_size(), plan, q.device, fp8_mode=mode,
                            fp4=self.fp4, **knobs)  # fmt: skip
        span, bq, mode = cfg.pop("span"), cfg["BLOCK_Q"], cfg.pop("fp8_mode")
        if cfg["maxnreg"] is None:
            del cfg["maxnreg"]
        dot_dtype = tl.float16 if mode.q_format == 1 else _DOT_DTYPES.get(plan.dtype, tl.bfloat16)
        scale = self.scale
        grid = (triton.cdiv(n, bq), triton.cdiv(g, span))
        _index_kernel[grid](
            q, self.w, keys, out if scale is None else scale, self.table, self.lengths,
            self.lengths if qrow is None else qrow, self.lengths if clip[1] is None else clip[1],
            out, n, g, span, q.stride(0), q.stride(1), self.w.stride(0), keys.stride(0),
            self.table.stride(0), out.stride(0), H=h, D=d, HP=max(16, triton.next_power_of_2(h)),
            DP=max(16, triton.next_power_of_2(d)), SPP=self.spp, HAS_QROW=qrow is not None,
            HAS_SCALE=scale is not None and not self.fp4, FP4=self.fp4, DOT_DTYPE=dot_dtype,
            K_PARTS=plan.k_parts, Q_PARTS=plan.q_parts, KEY_OPERAND=mode.key_operand,
            Q_FORMAT=mode.q_format, CLIP=clip[0], **cfg,
        )  # fmt: skip
