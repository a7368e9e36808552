"""Lightning TopK's histogram algorithm (see `topk`; the least latency for few rows).

**histogram** (three launches):

1. ``_hist1_kernel``: each CTA histograms the key's top 8 bits (``tl.histogram``, 256 bins) and
   adds it into the row's histogram (relaxed atomics, only non-empty bins).
2. ``_hist2_kernel``: every CTA derives the threshold digit ``t1`` from the row histogram,
   histograms the next 8 bits of its keys whose top byte is ``t1``, adds it to the row's second
   histogram, and stores, for each digit ``d``, how many of its keys have a 16-bit prefix
   ``>= (t1, d)`` (and ``> (t1, 255)``).
3. ``_select_kernel``: every CTA derives the threshold prefix ``P`` (16 bits) and, from the
   earlier CTAs' counts, where its entries go: keys above ``P`` straight to the output, keys in
   ``P``'s bin to the row's bin list, both in index order. The row's last CTA (an atomic
   ticket, no waiting) picks the ``krem`` entries it still needs from the bin list (typically a
   few dozen): by pairwise ranking when the bin holds at most `topk.PAIR` entries, by index
   when all its keys are equal, else by two more 8-bit histograms and one scan.

On Hopper the later kernels use programmatic dependent launch (``pdl``): they start while the
previous kernel finishes, load their first block of scores, and wait (``griddepcontrol.wait``)
before reading anything it wrote. Output order: the entries above ``P`` by index, then the
bin's by index.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .topk_pdl import gdc_launch_dependents, gdc_wait
from .topk_radix import _histogram, _keys, _load_limit, _row_extent, _select_bin
from .topk_state import (
    HIST1,
    HIST2,
    LOMAX,
    LONEG,
    NB,
    TICKET,
    WS_ROW,
    _stamp,
    _trace_end,
    _trace_start,
)
from .topk_tail import _clear_state, _emit, _finish_row, _low_bytes, _take_first, _take_ranked


@triton.jit
def _hist1_kernel(
    x_ptr,
    len_ptr,
    st_ptr,
    N,
    HN,
    stride_x,
    span,
    k,
    tr_ptr,
    BLOCK: tl.constexpr,
    HAS_LEN: tl.constexpr,
    HIST_MASK: tl.constexpr,
    PDL: tl.constexpr,
    TRACE: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()  # the next kernel may start its loads now
    pid = tl.program_id(0)
    b = tl.program_id(1)
    _trace_start(tr_ptr, b, pid, TRACE)
    row = x_ptr + b.to(tl.int64) * stride_x
    n, hist_n, keep = _row_extent(len_ptr, b, N, HN, k, HAS_LEN)
    start = pid * span
    end = tl.minimum(start + span, hist_n)
    lim = _load_limit(start, span, N, end)
    hist = tl.zeros((NB,), tl.int32)
    idx = start + tl.arange(0, BLOCK)
    x = tl.load(row + idx, mask=idx < lim, other=0.0)
    for off in range(start, end, BLOCK):
        # the next block's load is in flight while this one is histogrammed
        idx_n = off + BLOCK + tl.arange(0, BLOCK)
        x_n = tl.load(row + idx_n, mask=idx_n < lim, other=0.0)
        hist += _histogram((_keys(x) >> 24).to(tl.int32), idx < end, NB, BLOCK, HIST_MASK)
        x, idx = x_n, idx_n
    _stamp(tr_ptr, b, pid, 4, TRACE)
    st = st_ptr + b.to(tl.int64) * WS_ROW
    tl.atomic_add(st + HIST1 + tl.arange(0, NB), hist, mask=hist > 0, sem="relaxed")
    _trace_end(tr_ptr, b, pid, TRACE)


@triton.jit
def _digit2(x, ok, t1, hist, above, BLOCK: tl.constexpr, HIST_MASK: tl.constexpr):
    key = _keys(x)
    top = (key >> 24).to(tl.int32)
    above += tl.sum((ok & (top > t1)).to(tl.int32), axis=0)
    digit = ((key >> 16) & 0xFF).to(tl.int32)
    hist += _histogram(digit, ok & (top == t1), NB, BLOCK, HIST_MASK)
    return hist, above


@triton.jit
def _hist2_kernel(
    x_ptr,
    len_ptr,
    st_ptr,
    ge_ptr,
    N,
    HN,
    stride_x,
    span,
    k,
    C,
    tr_ptr,
    BLOCK: tl.constexpr,
    HAS_LEN: tl.constexpr,
    HIST_MASK: tl.constexpr,
    PDL: tl.constexpr,
    TRACE: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    b = tl.program_id(1)
    _trace_start(tr_ptr, b, pid, TRACE)
    row = x_ptr + b.to(tl.int64) * stride_x
    n, hist_n, keep = _row_extent(len_ptr, b, N, HN, k, HAS_LEN)
    start = pid * span
    end = tl.minimum(start + span, hist_n)
    lim = _load_limit(start, span, N, end)
    idx = start + tl.arange(0, BLOCK)
    x = tl.load(row + idx, mask=idx < lim, other=0.0)  # scores are ready before the 1st kernel
    if PDL:
        gdc_wait()  # the first kernel's histogram is complete and visible
    st = st_ptr + b.to(tl.int64) * WS_ROW
    bins = tl.arange(0, NB)
    # written by the previous kernel: read at L2 (.cg), never through a possibly stale L1
    t1, krem1, a1 = _select_bin(tl.load(st + HIST1 + bins, cache_modifier=".cg"), k, NB)
    _stamp(tr_ptr, b, pid, 3, TRACE)
    hist = tl.zeros((NB,), tl.int32)
    above = tl.sum(tl.zeros((BLOCK,), tl.int32), axis=0)
    for off in range(start, end, BLOCK):
        idx_n = off + BLOCK + tl.arange(0, BLOCK)
        x_n = tl.load(row + idx_n, mask=idx_n < lim, other=0.0)
        hist, above = _digit2(x, idx < end, t1, hist, above, BLOCK, HIST_MASK)
        x, idx = x_n, idx_n
    _stamp(tr_ptr, b, pid, 4, TRACE)
    # keys of this CTA with a 16-bit prefix >= (t1, d), for every d; then (d = 256) > (t1, 255)
    ge = above + tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    gep = ge_ptr + b.to(tl.int64) * (NB + 1) * C + pid
    tl.store(gep + bins * C, ge)
    tl.store(gep + NB * C, above)
    tl.atomic_add(st + HIST2 + bins, hist, mask=hist > 0, sem="relaxed")
    _trace_end(tr_ptr, b, pid, TRACE)


@triton.jit
def _select_kernel(
    x_ptr,
    len_ptr,
    st_ptr,
    ge_ptr,
    cv_ptr,
    ci_ptr,
    val_ptr,
    idx_ptr,
    cnt_ptr,
    N,
    HN,
    stride_x,
    span,
    k,
    C,
    tr_ptr,
    BLOCK: tl.constexpr,
    CB: tl.constexpr,
    MC: tl.constexpr,
    PAIR_SMALL: tl.constexpr,
    PAIR: tl.constexpr,
    HAS_LEN: tl.constexpr,
    HIST_MASK: tl.constexpr,
    PDL: tl.constexpr,
    TRACE: tl.constexpr,
):
    """Every CTA writes its keys above the threshold bin ``P`` (16-bit prefix) straight to the
    output and its keys in the bin to the row's bin list, both in index order from offsets the
    earlier CTAs' counts give; the row's last CTA then picks the ``krem`` it needs from the bin
    list (typically a few dozen entries)."""
    pid = tl.program_id(0)
    b = tl.program_id(1)
    _trace_start(tr_ptr, b, pid, TRACE)
    row = x_ptr + b.to(tl.int64) * stride_x
    n, hist_n, keep = _row_extent(len_ptr, b, N, HN, k, HAS_LEN)
    start = pid * span
    stop = tl.minimum(start + span, n)
    lim = _load_limit(start, span, N, stop)
    idx = start + tl.arange(0, BLOCK)
    x = tl.load(row + idx, mask=idx < lim, other=0.0)
    if PDL:
        gdc_wait()  # both histograms are complete and visible
    st = st_ptr + b.to(tl.int64) * WS_ROW
    bins = tl.arange(0, NB)
    h1 = tl.load(st + HIST1 + bins, cache_modifier=".cg")  # previous kernels' results: at L2
    h2 = tl.load(st + HIST2 + bins, cache_modifier=".cg")
    t1, krem1, a1 = _select_bin(h1, k, NB)
    t2, krem2, a2 = _select_bin(h2, krem1, NB)
    t2 = tl.minimum(tl.maximum(t2, 0), NB - 1)  # rows taking all entries: unused, in range
    # 0 for rows taking all: every valid key's prefix is above it (keys are >= 0x007FFFFF)
    p16 = (((t1 << 8) | t2) * keep).to(tl.uint32)
    # entries of the earlier CTAs above the bin and in it (rows taking all: every entry above)
    above = start * (1 - keep)
    inbin = above * 0
    gep = ge_ptr + (b.to(tl.int64) * (NB + 1) + t2) * C
    for c0 in range(0, pid * keep, CB):
        cc = c0 + tl.arange(0, CB)
        ge_t = tl.load(gep + cc, mask=cc < pid, other=0, cache_modifier=".cg")
        ge_a = tl.load(gep + C + cc, mask=cc < pid, other=0, cache_modifier=".cg")
        above += tl.sum(ge_a, axis=0)
        inbin += tl.sum(ge_t - ge_a, axis=0)
    _stamp(tr_ptr, b, pid, 3, TRACE)
    out_v = val_ptr + b.to(tl.int64) * k
    out_i = idx_ptr + b.to(tl.int64) * k
    cv = cv_ptr + b.to(tl.int64) * (2 * N)  # the row's bin list: [values | indices]
    ci = ci_ptr + b.to(tl.int64) * (2 * N) + N
    # bins of up to PAIR entries are ranked pairwise; larger ones need the bin's key range
    m = tl.sum(tl.where(bins == t2, h2, 0), axis=0) * keep
    track = m > PAIR
    lomax = tl.zeros((BLOCK,), tl.int32)
    loneg = lomax
    for off in range(start, stop, BLOCK):
        idx_n = off + BLOCK + tl.arange(0, BLOCK)
        x_n = tl.load(row + idx_n, mask=idx_n < lim, other=0.0)
        key = _keys(x)
        pre = key >> 16
        ok = idx < stop
        up = ok & (pre > p16)
        inb = ok & (pre == p16)
        # both positions from one scan: above the bin in the low 16 bits, in it in the high ones
        c = up.to(tl.int32) | (inb.to(tl.int32) << 16)
        before = tl.cumsum(c, axis=0) - c
        pos = above + (before & 0xFFFF)
        tl.store(out_v + pos, x, mask=up)
        tl.store(out_i + pos, idx.to(tl.int64), mask=up)
        q = inbin + (before >> 16)
        tl.store(cv + q, x, mask=inb)
        tl.store(ci + q, idx, mask=inb)
        both = tl.sum(c, axis=0)
        above += both & 0xFFFF
        inbin += both >> 16
        if track:
            lo = (key & 0xFFFF).to(tl.int32)
            lomax = tl.maximum(lomax, tl.where(inb, lo, 0))  # elementwise; reduced at the end
            loneg = tl.maximum(loneg, tl.where(inb, 0xFFFF - lo, 0))
        x, idx = x_n, idx_n
    _stamp(tr_ptr, b, pid, 4, TRACE)
    if track:
        tl.atomic_max(st + LOMAX, tl.max(lomax, axis=0), sem="relaxed")
        tl.atomic_max(st + LONEG, tl.max(loneg, axis=0), sem="relaxed")
    tl.debug_barrier()
    if tl.atomic_add(st + TICKET, 1, sem="acq_rel") == C - 1:
        # the row's last CTA: the bin list is complete; take krem2 of its m entries
        _stamp(tr_ptr, b, pid, 5, TRACE)
        count = tl.minimum(n, k)
        want = krem2 * keep
        first = count - want  # entries above the bin, already written
        bv = out_v + first
        bi = out_i + first
        if m <= PAIR_SMALL:  # the usual case, and rows taking all (m = 0)
            _take_ranked(cv, ci, m, want, bv, bi, PAIR_SMALL)
        elif m <= PAIR:
            _take_ranked(cv, ci, m, want, bv, bi, PAIR)
        elif tl.load(st + LOMAX, cache_modifier=".cg") == 0xFFFF - tl.load(
            st + LONEG, cache_modifier=".cg"
        ):  # every key of the bin is the same: its lowest indices
            _take_first(cv, ci, want, bv, bi, MC)
        else:  # a crowded bin: its exact threshold key T, byte by byte, then one scan
            p = tl.arange(0, MC)
            v0 = tl.load(cv + p, mask=p < m, other=0.0, cache_modifier=".cg")
            i0 = tl.load(ci + p, mask=p < m, other=0, cache_modifier=".cg")
            thr, need, every = _low_bytes(cv, v0, m, p16, want, MC, HIST_MASK)
            _emit(cv, ci, v0, i0, m, thr, need, every, want, bv, bi, MC)
        _stamp(tr_ptr, b, pid, 6, TRACE)
        _finish_row(out_v, out_i, cnt_ptr, b, count, k, MC)
        _clear_state(st, MC)
    _trace_end(tr_ptr, b, pid, TRACE)
