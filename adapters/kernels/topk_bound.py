"""Lightning TopK's bound algorithm (see `topk`; the most throughput for many rows).

**bound** (three launches, two light passes over the scores, no full-row histogram):

1. ``_colmax_kernel``: the row seen as an ``R x M`` matrix (``M`` about ``2k`` columns; column
   ``j`` holds the entries ``i`` with ``i % M == j``): each CTA stores the maximum key of its
   columns and adds their top bytes to the row's histogram; the row's last CTA finds the 16-bit
   prefix ``P`` of the ``k``-th largest column maximum. At least ``k`` columns, hence ``k``
   entries, are at or above ``P << 16``: every top-``k`` entry is. Columns interleave the row,
   so a run of large entries (recent tokens, an ascending row) spreads over as many columns as
   it has entries; for unordered scores about ``1.4 k`` entries pass the bound.
2. ``_gather_kernel``: each CTA counts its keys at or above the bound (and their key range),
   publishes the count, adds up the earlier CTAs' counts (they started first: the wait is short
   and never circular) and copies its candidates to the row's list, in index order.
3. ``_finish_kernel``: one CTA per row selects exactly among the candidates: equal candidates
   (ties at the threshold) need no refining; else the threshold's 16-bit prefix in one
   histogram of offsets from ``P`` (two rounds when it lies far above), two 8-bit rounds, one
   scan. Output order: by index.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .topk_pdl import gdc_launch_dependents, gdc_wait
from .topk_radix import _histogram, _keys, _load_limit, _row_extent, _select_bin
from .topk_state import (
    BOUND,
    COUNTS,
    HIST1,
    KMAX,
    KMIN,
    NB,
    TICKET_A,
    WS_ROW,
    _stamp,
    _trace_end,
    _trace_start,
)
from .topk_tail import _clear_state, _emit, _finish_row, _low_bytes, _prefix16


@triton.jit(do_not_specialize=["R"])  # a loop bound: one compile for every row count
def _colmax_kernel(
    x_ptr,
    len_ptr,
    st_ptr,
    mx_ptr,
    N,
    HN,
    stride_x,
    k,
    C,
    M,
    R,
    tr_ptr,
    S: tl.constexpr,
    RB: tl.constexpr,
    MB: tl.constexpr,
    HAS_LEN: tl.constexpr,
    HIST_MASK: tl.constexpr,
    PDL: tl.constexpr,
    TRACE: tl.constexpr,
):
    """Maximum key of every column of the row seen as an ``R x M`` matrix (column ``j``: the
    entries ``i`` with ``i % M == j``). CTA ``pid`` owns columns ``[pid*S, pid*S + S)``, stores
    their maxima and adds their top bytes to the row's histogram; the row's last CTA finds the
    16-bit prefix ``P`` of the ``k``-th largest maximum and publishes the bound ``P << 16``: at
    least ``k`` columns have a maximum at or above it, so at least ``k`` entries are, and every
    top-``k`` entry is. Columns interleave the row, so a run of large entries (recent tokens, an
    ascending row) spreads over as many columns as it has entries."""
    pid = tl.program_id(0)
    b = tl.program_id(1)
    _trace_start(tr_ptr, b, pid, TRACE)
    row = x_ptr + b.to(tl.int64) * stride_x
    n, hist_n, keep = _row_extent(len_ptr, b, N, HN, k, HAS_LEN)
    lim = N * tl.minimum(hist_n, 1)  # N: keeps the masked loads 16-byte vectors
    cols = pid * S + tl.arange(0, S)
    i = tl.arange(0, RB)[:, None] * M + cols[None, :]
    x = tl.load(row + i, mask=i < lim, other=0.0)
    acc = tl.zeros((S,), tl.uint32)
    for _ in range(0, tl.minimum(tl.cdiv(hist_n, M), R), RB):  # rows holding valid entries
        i_n = i + RB * M
        x_n = tl.load(row + i_n, mask=i_n < lim, other=0.0)
        key = tl.where(i < hist_n, _keys(x), 0)  # 0: below every real key
        acc = tl.maximum(acc, tl.max(key, axis=0))
        x, i = x_n, i_n
    _stamp(tr_ptr, b, pid, 4, TRACE)
    if PDL:  # not earlier: waiting gather CTAs would hold SMs that column CTAs still need
        gdc_launch_dependents()
    mrow = mx_ptr + b.to(tl.int64) * M
    tl.store(mrow + cols, acc.to(tl.int32, bitcast=True))
    st = st_ptr + b.to(tl.int64) * WS_ROW
    bins = tl.arange(0, NB)
    h = _histogram((acc >> 24).to(tl.int32), acc > 0, NB, S, HIST_MASK)
    tl.atomic_add(st + HIST1 + bins, h, mask=h > 0, sem="relaxed")
    tl.debug_barrier()
    if tl.atomic_add(st + TICKET_A, 1, sem="acq_rel") == C - 1:
        _stamp(tr_ptr, b, pid, 5, TRACE)
        h1 = tl.load(st + HIST1 + bins, cache_modifier=".cg")
        chunks = tl.sum(h1, axis=0)  # columns with an entry (0 for rows taking every entry)
        t1, krem, _ = _select_bin(h1, k, NB)
        t1 = tl.maximum(t1, 0).to(tl.uint32)
        h2 = tl.zeros((NB,), tl.int32)
        for s in range(0, M, MB):
            p = s + tl.arange(0, MB)
            v = tl.load(mrow + p, mask=p < M, other=0, cache_modifier=".cg")
            v = v.to(tl.uint32, bitcast=True)
            ok = (p < M) & (v > 0) & ((v >> 24) == t1)
            h2 += _histogram(((v >> 16) & 0xFF).to(tl.int32), ok, NB, MB, HIST_MASK)
        t2, _, _ = _select_bin(h2, krem, NB)
        t2 = tl.maximum(t2, 0).to(tl.uint32)
        # fewer than k columns: no bound, every entry is a candidate
        bound = tl.where(chunks >= k, (t1 << 24) | (t2 << 16), 0)
        tl.store(st + BOUND, bound.to(tl.int32, bitcast=True))
        tl.store(st + TICKET_A, 0)
        _stamp(tr_ptr, b, pid, 6, TRACE)
    _trace_end(tr_ptr, b, pid, TRACE)


@triton.jit
def _gather_kernel(
    x_ptr,
    len_ptr,
    st_ptr,
    cv_ptr,
    ci_ptr,
    N,
    HN,
    stride_x,
    span,
    k,
    tr_ptr,
    BLOCK: tl.constexpr,
    CB: tl.constexpr,
    HAS_LEN: tl.constexpr,
    PDL: tl.constexpr,
    TRACE: tl.constexpr,
):
    """Copies the keys at or above the bound to the row's candidate list in index order: each
    CTA counts its own, publishes the count and adds up the earlier CTAs' counts (they started
    first, so the wait is short and never circular), then copies."""
    if PDL:
        gdc_launch_dependents()  # the finishing kernel: one CTA per row
    pid = tl.program_id(0)
    b = tl.program_id(1)
    _trace_start(tr_ptr, b, pid, TRACE)
    row = x_ptr + b.to(tl.int64) * stride_x
    n, hist_n, keep = _row_extent(len_ptr, b, N, HN, k, HAS_LEN)
    start = pid * span
    stop = tl.minimum(start + span, n)
    lim = _load_limit(start, span, N, stop)
    idx = start + tl.arange(0, BLOCK)
    x = tl.load(row + idx, mask=idx < lim, other=0.0)  # scores are ready already
    if PDL:
        gdc_wait()  # the bound is published and visible
    st = st_ptr + b.to(tl.int64) * WS_ROW
    bound = tl.load(st + BOUND, cache_modifier=".cg").to(tl.uint32, bitcast=True)
    _stamp(tr_ptr, b, pid, 3, TRACE)
    count = tl.sum(tl.zeros((BLOCK,), tl.int32), axis=0)
    kmax = tl.zeros((BLOCK,), tl.uint32)
    kmin = kmax ^ 0xFFFFFFFF
    for off in range(start, stop, BLOCK):
        idx_n = off + BLOCK + tl.arange(0, BLOCK)
        x_n = tl.load(row + idx_n, mask=idx_n < lim, other=0.0)
        key = _keys(x)
        cand = (idx < stop) & (key >= bound)
        count += tl.sum(cand.to(tl.int32), axis=0)
        kmax = tl.maximum(kmax, tl.where(cand, key, 0))  # elementwise; reduced at the end
        kmin = tl.minimum(kmin, tl.where(cand, key, 0xFFFFFFFF))
        x, idx = x_n, idx_n
    _stamp(tr_ptr, b, pid, 4, TRACE)
    # the candidates' key range (keys in signed order): equal keys need no refining
    tl.store(st + KMAX + pid, (tl.max(kmax, axis=0) ^ 0x80000000).to(tl.int32, bitcast=True))
    tl.store(st + KMIN + pid, (tl.min(kmin, axis=0) ^ 0x80000000).to(tl.int32, bitcast=True))
    cnt = st + COUNTS
    tl.atomic_xchg(cnt + pid, count + 1, sem="relaxed")  # 0 means "not counted yet"
    running = count * 0
    for c0 in range(0, pid, CB):
        cc = c0 + tl.arange(0, CB)
        earlier = cc < pid
        v = tl.load(cnt + cc, mask=earlier, other=1, volatile=True)
        while tl.min(v, axis=0) == 0:  # earlier CTAs started first: they are counting
            v = tl.load(cnt + cc, mask=earlier, other=1, volatile=True)
        running += tl.sum(v - 1, axis=0)
    _stamp(tr_ptr, b, pid, 5, TRACE)
    cv = cv_ptr + b.to(tl.int64) * (2 * N)  # the row's candidates: [values | indices]
    ci = ci_ptr + b.to(tl.int64) * (2 * N) + N
    idx = start + tl.arange(0, BLOCK)
    x = tl.load(row + idx, mask=idx < lim, other=0.0)
    for off in range(start, stop * tl.minimum(count, 1), BLOCK):  # none: nothing to copy
        idx_n = off + BLOCK + tl.arange(0, BLOCK)
        x_n = tl.load(row + idx_n, mask=idx_n < lim, other=0.0)
        cand = (idx < stop) & (_keys(x) >= bound)
        c = cand.to(tl.int32)
        pos = running + tl.cumsum(c, axis=0) - c
        tl.store(cv + pos, x, mask=cand)
        tl.store(ci + pos, idx, mask=cand)
        running += tl.sum(c, axis=0)
        x, idx = x_n, idx_n
    _stamp(tr_ptr, b, pid, 6, TRACE)
    _trace_end(tr_ptr, b, pid, TRACE)


@triton.jit
def _finish_kernel(
    len_ptr,
    st_ptr,
    cv_ptr,
    ci_ptr,
    val_ptr,
    idx_ptr,
    cnt_ptr,
    N,
    HN,
    k,
    C,
    tr_ptr,
    CB: tl.constexpr,
    MC: tl.constexpr,
    HAS_LEN: tl.constexpr,
    HIST_MASK: tl.constexpr,
    PDL: tl.constexpr,
    TRACE: tl.constexpr,
):
    """One CTA per row: the exact top-``count`` of the row's candidates (all at or above the
    bound, in index order): equal candidates need no refining (ties: the lowest indices), else
    the threshold key ``T`` byte by byte and one scan."""
    b = tl.program_id(0)
    pid = b * 0
    _trace_start(tr_ptr, b, pid, TRACE)
    n, hist_n, keep = _row_extent(len_ptr, b, N, HN, k, HAS_LEN)
    count = tl.minimum(n, k)
    if PDL:
        gdc_wait()  # every candidate is in the list
    st = st_ptr + b.to(tl.int64) * WS_ROW
    total = count * 0
    top = tl.full((), -(2**31), tl.int32)
    low = tl.full((), 2**31 - 1, tl.int32)
    for c0 in range(0, C, CB):
        cc = c0 + tl.arange(0, CB)
        v = tl.load(st + COUNTS + cc, mask=cc < C, other=1, cache_modifier=".cg") - 1
        total += tl.sum(v, axis=0)
        some = (cc < C) & (v > 0)
        hi = tl.load(st + KMAX + cc, mask=some, other=-(2**31), cache_modifier=".cg")
        lo = tl.load(st + KMIN + cc, mask=some, other=2**31 - 1, cache_modifier=".cg")
        top = tl.maximum(top, tl.max(hi, axis=0))
        low = tl.minimum(low, tl.min(lo, axis=0))
    cv = cv_ptr + b.to(tl.int64) * (2 * N)
    ci = ci_ptr + b.to(tl.int64) * (2 * N) + N
    p = tl.arange(0, MC)
    v0 = tl.load(cv + p, mask=p < total, other=0.0, cache_modifier=".cg")
    i0 = tl.load(ci + p, mask=p < total, other=0, cache_modifier=".cg")
    _stamp(tr_ptr, b, pid, 3, TRACE)
    thr = (count * 0).to(tl.uint32)
    need = total  # at most count candidates: all of them (every valid key is above 0)
    every = need == need
    if total > count:
        if top == low:  # all candidates tie: the lowest indices
            thr = top.to(tl.uint32, bitcast=True) ^ 0x80000000
            need = count
            every = need != need
        else:  # the exact threshold key T among the candidates
            base = tl.load(st + BOUND, cache_modifier=".cg").to(tl.uint32, bitcast=True) >> 16
            p16, krem = _prefix16(cv, v0, total, base, count, MC, HIST_MASK)
            _stamp(tr_ptr, b, pid, 4, TRACE)
            thr, need, every = _low_bytes(cv, v0, total, p16, krem, MC, HIST_MASK)
    _stamp(tr_ptr, b, pid, 5, TRACE)
    out_v = val_ptr + b.to(tl.int64) * k
    out_i = idx_ptr + b.to(tl.int64) * k
    _emit(cv, ci, v0, i0, total, thr, need, every, count, out_v, out_i, MC)
    _stamp(tr_ptr, b, pid, 6, TRACE)
    _finish_row(out_v, out_i, cnt_ptr, b, count, k, MC)
    _clear_state(st, MC)
    _trace_end(tr_ptr, b, pid, TRACE)
