"""Lightning TopK: exact, deterministic radix-select top-k over fp32 rows, no global sort.

Maths: `adapters.kernels.reference.topk_reference` (the set of a stable descending sort of the
valid prefix cut at ``k``: ties at the k-th value go to the LOWEST indices; ``-0.0`` equals
``+0.0``; no NaN). Output: ``(values (B, k) fp32, indices (B, k) int64, counts (B,) int32)``;
``counts[b] = min(k, lengths[b])`` real entries first, then padding (index 0, value -inf; the
project does not use -1 indices). The real entries come in a deterministic order that depends
on the algorithm (the same call always gives the same order); ``sorted=True`` adds one small
kernel that orders them by value descending, ties by index ascending.

Each fp32 maps to an order-preserving uint32 key (sign flip; -0.0 canonicalised). Rows are
split over CTAs; no host synchronisation anywhere (CUDA-graph safe). Per-row state lives in a
small int32 workspace that the last kernel leaves zeroed (on CUDA, one per stream is kept by
this module, so no memset per call). Two algorithms; ``algorithm="auto"`` takes the first for
fewer than `AUTO_BOUND_ROWS` rows (least latency), the second from there (most throughput).

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
   few dozen): by pairwise ranking when the bin holds at most `PAIR` entries, by index when
   all its keys are equal, else by two more 8-bit histograms and one scan.

On Hopper the later kernels use programmatic dependent launch (``pdl``): they start while the
previous kernel finishes, load their first block of scores, and wait (``griddepcontrol.wait``)
before reading anything it wrote. Output order: the entries above ``P`` by index, then the
bin's by index.

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

Costs. The histogram algorithm reads the row three times with two 256-bin histograms, which
are compute-bound at large batch (``tl.histogram`` is ~100 instructions per 32 keys); its
serial part is one short tail. The bound algorithm's passes are a max and a compare, but its
finishing CTA refines over ~1.4k candidates. When many entries tie at or near the threshold,
or the top entries repeat with a period dividing ``M``, more entries pass the bound and the
finishing CTA does more (exact, slower); a tie class at the threshold is taken by index with
no refining. `bench/kernels.py` times both on such inputs; `bench/topk_profile.py` traces every
CTA's phases (``trace=``).
"""

from __future__ import annotations

import inspect
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launch import KernelLaunch, PlanCache, aligned

try:  # programmatic dependent launch (Hopper+): Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAS_GDC = True
except ImportError:  # pragma: no cover - older Triton
    _HAS_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


__all__ = ["lightning_topk", "sort_topk", "topk_trace", "topk_workspace"]

try:  # kernel phase traces (`lightning_topk(trace=...)`, benchmarks only)
    from triton.language.extra.cuda import globaltimer
except ImportError:  # pragma: no cover - older Triton

    @triton.jit
    def globaltimer():
        return 0


@triton.jit
def _clock():  # pragma: no cover - GPU traces only
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _stamp(tr_ptr, b, pid, slot: tl.constexpr, TRACE: tl.constexpr):
    """Phase trace of one CTA (``TRACE``): slots 0 and 1 the global timer (ns) at its start and
    end, 2.. its SM clock (cycles) at the phases the kernel marks."""
    if TRACE:  # pragma: no cover - GPU traces only
        at = tr_ptr + (b.to(tl.int64) * _MAX_CTAS_C + pid) * 8 + slot
        if slot < 2:
            tl.store(at, globaltimer())
        else:
            tl.store(at, _clock())


@triton.jit
def _trace_start(tr_ptr, b, pid, TRACE: tl.constexpr):
    """A CTA's start: global timer (slot 0) and SM clock (slot 2)."""
    _stamp(tr_ptr, b, pid, 0, TRACE)
    _stamp(tr_ptr, b, pid, 2, TRACE)


@triton.jit
def _trace_end(tr_ptr, b, pid, TRACE: tl.constexpr):
    """A CTA's end: SM clock (slot 7) and global timer (slot 1)."""
    _stamp(tr_ptr, b, pid, 7, TRACE)
    _stamp(tr_ptr, b, pid, 1, TRACE)


# Per-row state, int32 words, all zero between calls: hist1[256], hist2[256], a header of 16
# words (tickets, the bound, key ranges), then per CTA a count, a largest and a smallest key
# (the bound algorithm's gather).
_NB = 256
_MAX_CTAS = 1024  # CTAs per row
_HEAD = 2 * _NB
_WS_ROW = _HEAD + 16 + 3 * _MAX_CTAS
NB = tl.constexpr(_NB)
HIST1, HIST2 = tl.constexpr(0), tl.constexpr(_NB)
TICKET, LOMAX, LONEG = tl.constexpr(_HEAD), tl.constexpr(_HEAD + 1), tl.constexpr(_HEAD + 2)
TICKET_A, BOUND = tl.constexpr(_HEAD + 3), tl.constexpr(_HEAD + 4)
COUNTS = tl.constexpr(_HEAD + 16)  # per CTA: its candidate count + 1 (0: not counted yet)
KMAX = tl.constexpr(_HEAD + 16 + _MAX_CTAS)  # per CTA: its largest candidate key, signed order
KMIN = tl.constexpr(_HEAD + 16 + 2 * _MAX_CTAS)  # per CTA: its smallest
WS_ROW = tl.constexpr(_WS_ROW)
_MAX_CTAS_C = tl.constexpr(_MAX_CTAS)
# `tl.histogram(..., mask=)` skips masked keys; without it (older Triton) masked keys go to bin 0
# and are subtracted again.
try:
    HIST_MASK = "mask" in inspect.signature(tl.histogram).parameters
except (TypeError, ValueError):  # pragma: no cover - an unintrospectable builtin
    HIST_MASK = False


@triton.jit
def _keys(x):
    u = x.to(tl.uint32, bitcast=True)
    u = tl.where(u == 0x80000000, u ^ 0x80000000, u)  # -0.0 -> +0.0
    return tl.where((u & 0x80000000) != 0, u ^ 0xFFFFFFFF, u | 0x80000000)


@triton.jit
def _histogram(digit, ok, NBINS: tl.constexpr, BLOCK: tl.constexpr, HIST_MASK: tl.constexpr):
    if HIST_MASK:
        h = tl.histogram(digit, NBINS, mask=ok)
    else:
        h = tl.histogram(tl.where(ok, digit, 0), NBINS)
        h -= tl.where(tl.arange(0, NBINS) == 0, BLOCK - tl.sum(ok.to(tl.int32), axis=0), 0)
    return h


@triton.jit
def _row_extent(len_ptr, b, N, HN, k, HAS_LEN: tl.constexpr):
    """Valid length ``n`` of row ``b``, the length to histogram (``n`` when the row has more than
    ``k`` entries, else 0: it takes them all) and whether it selects (1) or takes all (0).
    Without lengths the host passes ``HN``."""
    if HAS_LEN:
        # clamped in the lengths' own dtype (int64 lengths past 2**31 must not wrap), then narrowed
        n = tl.minimum(tl.maximum(tl.load(len_ptr + b), 0), N).to(tl.int32)
        hist_n = n * tl.minimum(tl.maximum(n - k, 0), 1)
    else:
        n = N
        hist_n = HN
    return n, hist_n, tl.minimum(hist_n, 1)


@triton.jit
def _load_limit(start, span, N, end):
    """Bound for the loads of a CTA's range ``[start, end)``: ``min(start + span, N)``, or 0 when
    the range is empty. Rounded to the row, not to ``end`` (a row length): ``N`` and ``span`` are
    multiples of 16 in practice, so the masked loads stay 16-byte vectors; the elements between
    ``end`` and the limit are loaded and ignored."""
    return tl.minimum(start + span, N) * (end > start).to(tl.int32)


@triton.jit
def _select_bin(h, krem, NBINS: tl.constexpr):
    """Bin ``t`` holding the ``krem``-th largest key of histogram ``h``, the rank left in it, and
    the number of keys in the bins above it."""
    bins = tl.arange(0, NBINS)
    gt = tl.sum(h, axis=0) - tl.cumsum(h, axis=0)  # keys in bins above each bin
    hit = (gt < krem) & (gt + h >= krem)
    t = tl.max(tl.where(hit, bins, -1), axis=0)
    above = tl.sum(tl.where(bins == t, gt, 0), axis=0)
    return t, krem - above, above


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
def _chunk(ptr, v0, s, total, MC: tl.constexpr):
    """Entries ``s .. s+MC`` of a tail's list: the first chunk from registers ``v0`` (loaded
    once), later ones from memory (L2: written by other CTAs of this kernel)."""
    p = s + tl.arange(0, MC)
    okp = p < total
    v = tl.load(ptr + p, mask=okp & (p >= MC), other=0, cache_modifier=".cg")
    return tl.where(p < MC, v0, v), okp


@triton.jit
def _refine(
    cv, v0, total, prefix, shift: tl.constexpr, krem, MC: tl.constexpr, HIST_MASK: tl.constexpr
):
    """Next 8-bit digit (bits ``shift+7 .. shift``) of the ``krem``-th largest entry of the list
    among those whose key >> (shift + 8) equals ``prefix`` (``shift = 24``: ``prefix`` is 0 and
    every entry counts), and the rank left in that digit's bin."""
    h = tl.zeros((NB,), tl.int32)
    for s in range(0, total, MC):
        v, okp = _chunk(cv, v0, s, total, MC)
        key = _keys(v)
        if shift == 24:
            inb = okp
        else:
            inb = okp & ((key >> (shift + 8)) == prefix)
        h += _histogram(((key >> shift) & 0xFF).to(tl.int32), inb, NB, MC, HIST_MASK)
    t, krem2, _ = _select_bin(h, krem, NB)
    inbin = tl.sum(tl.where(tl.arange(0, NB) == t, h, 0), axis=0)
    return (prefix << 8) | tl.maximum(t, 0).to(tl.uint32), krem2, inbin


@triton.jit
def _prefix16(cv, v0, total, base, krem, MC: tl.constexpr, HIST_MASK: tl.constexpr):
    """16-bit prefix of the ``krem``-th largest entry of a list whose keys are all at or above
    ``base << 16``, and the rank left in it: one histogram of the prefixes' offsets from
    ``base`` when it is within 255 of it (the usual case for a bound), else two rounds."""
    h = tl.zeros((NB,), tl.int32)
    for s in range(0, total, MC):
        v, okp = _chunk(cv, v0, s, total, MC)
        off = tl.minimum((_keys(v) >> 16) - base, NB - 1).to(tl.int32)
        h += _histogram(off, okp, NB, MC, HIST_MASK)
    t, krem2, _ = _select_bin(h, krem, NB)
    p16 = base + tl.maximum(t, 0).to(tl.uint32)
    if t == NB - 1:  # at or past base + 255: byte by byte
        p8, krem2, _ = _refine(cv, v0, total, p16 * 0, 24, krem, MC, HIST_MASK)
        p16, krem2, _ = _refine(cv, v0, total, p8, 16, krem2, MC, HIST_MASK)
    return p16, krem2


@triton.jit
def _low_bytes(cv, v0, total, p16, krem, MC: tl.constexpr, HIST_MASK: tl.constexpr):
    """The exact threshold key ``T`` of a list under its known 16-bit prefix (two 8-bit rounds),
    how many of its ties to take, and whether that is all of them."""
    p24, krem2, _ = _refine(cv, v0, total, p16, 8, krem, MC, HIST_MASK)
    thr, need, ties = _refine(cv, v0, total, p24, 0, krem2, MC, HIST_MASK)
    return thr, need, need == ties


@triton.jit
def _emit(cv, ci, v0, i0, total, thr, need, every, want, out_v, out_i, MC: tl.constexpr):
    """Writes, from a list in index order, the keys above ``thr`` and the ``need`` lowest-index
    ties at ``thr`` (``every``: need is all of them) to ``out_v``/``out_i``, in index order,
    stopping at ``want`` entries."""
    written = total * 0
    ties = total * 0
    s = total * 0
    while (s < total) & (written < want):
        v, okp = _chunk(cv, v0, s, total, MC)
        i, okp = _chunk(ci, i0, s, total, MC)
        key = _keys(v)
        if every:  # no tie is left out: no ranking
            sel = (okp & (key >= thr)).to(tl.int32)
        else:
            tie = (okp & (key == thr)).to(tl.int32)
            rank = ties + tl.cumsum(tie, axis=0) - tie
            sel = (okp & ((key > thr) | ((tie != 0) & (rank < need)))).to(tl.int32)
            ties += tl.sum(tie, axis=0)
        pos = written + tl.cumsum(sel, axis=0) - sel
        put = (sel != 0) & (pos < want)
        tl.store(out_v + pos, v, mask=put)
        tl.store(out_i + pos, i.to(tl.int64), mask=put)
        written += tl.sum(sel, axis=0)
        s += MC


@triton.jit
def _take_first(cv, ci, want, out_v, out_i, MC: tl.constexpr):
    """Copies the first ``want`` entries of a list to ``out_v``/``out_i``."""
    for s in range(0, want, MC):
        p = s + tl.arange(0, MC)
        ok = p < want
        v = tl.load(cv + p, mask=ok, other=0.0, cache_modifier=".cg")
        i = tl.load(ci + p, mask=ok, other=0, cache_modifier=".cg")
        tl.store(out_v + p, v, mask=ok)
        tl.store(out_i + p, i.to(tl.int64), mask=ok)


@triton.jit
def _take_ranked(cv, ci, m, want, out_v, out_i, PAIR: tl.constexpr):
    """Writes the ``want`` largest of the ``m <= PAIR`` entries of a list in index order (ties to
    the earlier entry) to ``out_v``/``out_i``, in index order: every entry's rank is counted
    against every other (``PAIR**2`` comparisons, no histogram rounds)."""
    p = tl.arange(0, PAIR)
    ok = p < m
    v = tl.load(cv + p, mask=ok, other=0.0, cache_modifier=".cg")
    i = tl.load(ci + p, mask=ok, other=0, cache_modifier=".cg")
    key = _keys(v)
    kj = key[None, :]
    ki = key[:, None]
    pj = p[None, :]
    beats = (pj < m) & ((kj > ki) | ((kj == ki) & (pj < p[:, None])))
    rank = tl.sum(beats.to(tl.int32), axis=1)
    sel = ok & (rank < want)
    s = sel.to(tl.int32)
    pos = tl.cumsum(s, axis=0) - s
    tl.store(out_v + pos, v, mask=sel)
    tl.store(out_i + pos, i.to(tl.int64), mask=sel)


@triton.jit
def _finish_row(out_v, out_i, cnt_ptr, b, count, k, MC: tl.constexpr):
    """Padding (value -inf, index 0) after the row's ``count`` entries, and the count."""
    for off in range(count, k, MC):
        p = off + tl.arange(0, MC)
        pm = p < k
        tl.store(out_v + p, tl.full((MC,), float("-inf"), tl.float32), mask=pm)
        tl.store(out_i + p, tl.zeros((MC,), tl.int64), mask=pm)
    tl.store(cnt_ptr + b, count)


@triton.jit
def _clear_state(st, MC: tl.constexpr):
    """Leaves the row's state zeroed for the next call (every CTA has read it: they all took a
    ticket)."""
    for off in range(0, WS_ROW, MC):
        p = off + tl.arange(0, MC)
        tl.store(st + p, tl.zeros((MC,), tl.int32), mask=p < WS_ROW)


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


# -- the bound algorithm: column maxima give a lower bound; one pass gathers what is above it ---


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


@triton.jit
def _sort_kernel(x_ptr, val_ptr, idx_ptr, cnt_ptr, stride_x, k, KP: tl.constexpr):
    b = tl.program_id(0)
    pos = tl.arange(0, KP)
    cnt = tl.load(cnt_ptr + b)
    ok = pos < cnt
    out_v = val_ptr + b.to(tl.int64) * k
    out_i = idx_ptr + b.to(tl.int64) * k
    idx = tl.load(out_i + pos, mask=ok, other=0)
    key = _keys(tl.load(out_v + pos, mask=ok, other=0.0)).to(tl.int64)
    comp = ((key - 0x80000000) << 32) | (0xFFFFFFFF - idx)  # value desc, then index asc
    comp = tl.where(ok, comp, -9223372036854775807 - 1)
    comp = tl.sort(comp, descending=True)
    idx = 0xFFFFFFFF - (comp & 0xFFFFFFFF)
    v = tl.load(x_ptr + b.to(tl.int64) * stride_x + idx, mask=ok, other=float("-inf"))
    tl.store(out_v + pos, v, mask=ok)
    tl.store(out_i + pos, idx, mask=ok)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":  # pragma: no cover - needs a GPU
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _split(
    n: int, b: int, block: int, device: torch.device, ctas: int | None, per_sm: int = 4
) -> tuple[int, int]:
    """(CTAs per row, span per CTA, a multiple of ``block``): about ``per_sm`` CTAs per SM in
    all (as many as are resident at once: one wave)."""
    most = max(1, triton.cdiv(n, block))
    c = ctas or triton.cdiv(per_sm * _sm_count(device), b)
    c = max(1, min(c, most, _MAX_CTAS))
    span = triton.cdiv(triton.cdiv(max(n, 1), c), block) * block
    return max(1, triton.cdiv(n, span)), span


def _columns(n: int, k: int, b: int, tile: int, device, chunk, ctas) -> tuple[int, ...]:
    """The bound algorithm's column maxima: ``(M columns, R rows, C CTAs per row, S columns
    per CTA, RB rows per load of about ``tile`` entries)``, powers of two but ``R``. ``M`` is
    about ``2k`` (then, for scores without order, about ``M ln(M / (M - k)) ~ 1.4 k`` entries
    pass the bound), or ``N / chunk`` with ``chunk`` entries per column; CTAs own 32 columns
    or more."""
    if chunk is None:
        m = triton.next_power_of_2(2 * k)
    else:
        m = triton.next_power_of_2(triton.cdiv(max(n, 1), chunk))
    m = max(32, min(m, triton.next_power_of_2(max(n, 1))))
    r = triton.cdiv(max(n, 1), m)
    want = ctas or triton.cdiv(4 * _sm_count(device), b)
    c = 1 << max(0, min(want, m // 32, _MAX_CTAS).bit_length() - 1)  # a power of two <= want
    s = m // c
    rb = max(1, tile // s)  # not from ``r``: a new RB is a new compile (short rows mask rows off)
    return m, r, c, s, rb


def _use_pdl(device: torch.device, pdl: bool | None) -> bool:
    """Programmatic dependent launch: Hopper or newer, Triton with ``griddepcontrol``; on by
    default unless ``ADAPTERS_TOPK_PDL=0``."""
    if device.type != "cuda" or not _HAS_GDC or (pdl is not None and not pdl):
        return False
    if pdl is None and os.environ.get("ADAPTERS_TOPK_PDL", "1") == "0":  # pragma: no cover
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9  # pragma: no cover - needs a GPU


# bins of up to this many entries are ranked pairwise in the select tail (two tile sizes)
PAIR_SMALL, PAIR = 32, 128
AUTO_BOUND_ROWS = 8  # `algorithm="auto"`: the bound algorithm from this many rows up


def lightning_topk(
    scores: torch.Tensor,
    k: int,
    lengths: torch.Tensor | None = None,
    *,
    sorted: bool = False,
    block: int | None = None,
    ctas: int | None = None,
    num_warps: int | None = None,
    hist_mask: bool | None = None,
    workspace: torch.Tensor | None = None,
    pdl: bool | None = None,
    algorithm: str = "auto",
    chunk: int | None = None,
    trace: torch.Tensor | None = None,
    bound_warps: tuple[int, int] = (4, 4),
    tile: int = 4096,
    gather_regs: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-``k`` of each row of ``scores`` ``(B, N)`` fp32 over its valid prefix ``lengths``
    ``(B,)`` (None: all ``N``). Returns ``(values, indices, counts)``: the set of
    `reference.topk_reference`, in a deterministic order (``sorted=True``: value descending,
    ties by index ascending, as the reference's). ``block`` (entries per CTA step; None: 1024),
    ``ctas`` (CTAs per row), ``num_warps`` (None: 8), ``bound_warps`` (the bound algorithm's
    column and finishing kernels), ``tile`` (entries per load of its column kernel) and
    ``gather_regs`` (a register cap for its gather kernel; None: 64) are launch knobs
    (benchmark sweeps); ``hist_mask`` forces the histogram variant (None: masked when this
    Triton supports it); ``pdl``: programmatic dependent launch
    of the later kernels (None: on for CUDA capability >= 9 unless ``ADAPTERS_TOPK_PDL=0``).
    ``algorithm``: ``"histogram"`` (two histogram passes, three launches: the least latency
    for few rows), ``"bound"`` (column maxima bound, two light passes: the most throughput for
    many rows; slower when many entries tie at the threshold), or ``"auto"`` (the default:
    bound from `AUTO_BOUND_ROWS` rows up); see the module docstring. ``chunk``: entries per
    column maximum of the bound algorithm (None: about ``2k`` columns). ``trace``: a zeroed int64
    tensor from `topk_trace` that the kernels fill with per-CTA phase timestamps (CUDA only;
    `bench/topk_profile.py` reads it).

    ``workspace``: an int32 buffer from `topk_workspace` (all zeros), reused across calls: the
    kernels leave it zeroed again, which saves the memset of a fresh one. Calls sharing one
    workspace must not run concurrently (one per stream, or per captured graph replayed on one
    stream). None: on CUDA, the current stream's own workspace, kept by this module (as PyTorch
    keeps a cuBLAS workspace per stream; calls on one stream never overlap); elsewhere a fresh
    one.

    Host cost: the launches of one shape, flags and knobs (grids, constexprs, compiled kernels)
    are planned once and kept in `_PLANS` (`launch.PlanCache`); later calls launch the compiled
    kernels directly (`launch.KernelLaunch`): on the lent H200, an eager call at 1 x 262,144
    took 118 us instead of 313 us (`bench/results/topk_eager_h200.json`). A plan reads
    ``ADAPTERS_TOPK_PDL`` and the device when it is built. A call that fails drops its plan (and
    the stream workspace it may have left dirty)."""
    _check_knobs(scores, k, algorithm, chunk, block)
    if scores.dtype != torch.float32:
        scores = scores.float()
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    b, n = scores.shape
    dev = scores.device
    values = torch.empty((b, k), dtype=torch.float32, device=dev)
    indices = torch.empty((b, k), dtype=torch.int64, device=dev)
    counts = torch.empty((b,), dtype=torch.int32, device=dev)
    if b == 0:
        return values, indices, counts
    _check_buffers(b, n, workspace, trace)
    lens = lengths.contiguous() if lengths is not None else counts
    knobs = _Knobs(
        block or 1024, ctas, num_warps or 8, HIST_MASK if hist_mask is None else hist_mask, pdl,
        algorithm, chunk, tuple(bound_warps), tile, gather_regs,
    )  # fmt: skip
    stride = scores.stride(0)
    # everything the kernels' specialisation depends on (`launch`): shapes, integer arguments,
    # dtypes, and the alignment of every pointer that is not a fresh allocation
    key = (dev, b, n, stride, k, sorted, None if lengths is None else lengths.dtype, knobs,
           trace is not None, aligned(scores), aligned(lens),
           workspace is None or aligned(workspace), trace is None or aligned(trace))  # fmt: skip
    plan = _PLANS.get(key, lambda: _plan(b, n, stride, k, dev, sorted, lengths is not None, knobs,
                                         trace is not None))  # fmt: skip
    ws = _stream_workspace(b, dev) if workspace is None else workspace
    tr = (counts,) * 3 if trace is None else tuple(trace)
    try:
        plan.launch(scores, lens, ws, values, indices, counts, tr)
    except BaseException:  # a launch failed part-way: the state may be left dirty
        _PLANS.discard(key)
        if workspace is None:
            _forget_workspace(ws)
        raise
    return values, indices, counts


def _check_knobs(scores: torch.Tensor, k: int, algorithm: str, chunk, block) -> None:
    if scores.dim() != 2:
        raise ValueError("scores must be (B, N)")
    if k < 1:
        raise ValueError("k must be positive")
    if algorithm not in ("auto", "histogram", "bound"):
        raise ValueError(f"unknown algorithm {algorithm!r}: 'auto', 'histogram' or 'bound'")
    if chunk is not None and (chunk < 1 or chunk & (chunk - 1)):
        raise ValueError("chunk must be a power of two")
    if block is not None and (block & (block - 1) or not 16 <= block <= 16384):
        # the select kernel packs two per-block counts into one 32-bit scan
        raise ValueError("block must be a power of two from 16 to 16384")


def _check_buffers(b: int, n: int, workspace, trace) -> None:
    if n >= 2**31 // 2:
        raise ValueError("rows of 2**30 entries or more are not supported")
    if workspace is not None and (
        workspace.dtype != torch.int32 or workspace.numel() < b * _WS_ROW
    ):
        raise ValueError(f"workspace must be int32 with at least {b} x {_WS_ROW} entries")
    if trace is not None and (trace.dtype != torch.int64 or trace.shape != (3, b, _MAX_CTAS, 8)):
        raise ValueError(f"trace must be int64 of shape (3, {b}, {_MAX_CTAS}, 8): see topk_trace")


class _Knobs(NamedTuple):
    """`lightning_topk`'s launch knobs, defaults resolved (``algorithm`` may still be auto)."""

    block: int
    ctas: int | None
    num_warps: int
    hist_mask: bool
    pdl: bool | None
    algorithm: str
    chunk: int | None
    bound_warps: tuple[int, ...]
    tile: int
    gather_regs: int | None


class _Plan(NamedTuple):
    """One shape's launches and their integer arguments: ``n``, ``hn`` (the histogrammed length
    without lengths), the row stride, ``span`` and ``c`` (entries and CTAs per row of the
    streaming kernels), ``m``, ``r``, ``cc`` (the bound algorithm's columns, rows and column
    CTAs); one int32 scratch of ``scratch_words`` whose candidate lists start at ``cand_at``.
    (Not a dataclass: the tests load private copies of this module outside `sys.modules`.)"""

    bound: bool
    launches: tuple[KernelLaunch, KernelLaunch, KernelLaunch]
    sort: KernelLaunch | None
    n: int
    hn: int
    stride: int
    k: int
    span: int
    c: int
    m: int
    r: int
    cc: int
    scratch_words: int
    cand_at: int

    def launch(self, x, lens, ws, values, indices, counts, tr) -> None:
        # one scratch: per-CTA counts (histogram) or column maxima (bound) first, then per row
        # [candidate values | candidate indices]
        scratch = torch.empty((self.scratch_words,), dtype=torch.int32, device=x.device)
        ci = scratch[self.cand_at :]
        cv = ci.view(torch.float32)
        n, hn, stride, k, span, c = self.n, self.hn, self.stride, self.k, self.span, self.c
        first, second, last = self.launches
        if self.bound:
            first(x, lens, ws, scratch, n, hn, stride, k, self.cc, self.m, self.r, tr[0])
            second(x, lens, ws, cv, ci, n, hn, stride, span, k, tr[1])
            last(lens, ws, cv, ci, values, indices, counts, n, hn, k, c, tr[2])
        else:
            first(x, lens, ws, n, hn, stride, span, k, tr[0])
            second(x, lens, ws, scratch, n, hn, stride, span, k, c, tr[1])
            last(x, lens, ws, scratch, cv, ci, values, indices, counts, n, hn, stride, span, k, c,
                 tr[2])  # fmt: skip
        if self.sort is not None:
            self.sort(x, values, indices, counts, stride, k)


def _plan(b, n, stride, k, dev, sort, has_len, knobs: _Knobs, tracing: bool) -> _Plan:
    """The launches of a `lightning_topk` call (see there for the knobs)."""
    bound = knobs.algorithm == "bound" or (knobs.algorithm == "auto" and b >= AUTO_BOUND_ROWS)
    c, span = _split(n, b, knobs.block, dev, knobs.ctas)
    use_pdl = _use_pdl(dev, knobs.pdl)
    cuda = dev.type == "cuda"
    flags = dict(HAS_LEN=has_len, PDL=use_pdl, TRACE=tracing)
    common = dict(flags, HIST_MASK=knobs.hist_mask)
    follow = dict(launch_pdl=True) if use_pdl else {}
    nn = max(n, 1)
    mc = min(2048, max(1024, triton.next_power_of_2(k + k // 2)))  # the tail's chunk
    cb = min(1024, triton.next_power_of_2(c))
    if bound:
        m, r, cc, s, rb = _columns(n, k, b, knobs.tile, dev, knobs.chunk, knobs.ctas)
        # capped, the gather keeps enough CTAs resident to hide its loads (the compiler would
        # take ~100 registers: two CTAs per SM, several waves)
        regs = dict(maxnreg=knobs.gather_regs or 64) if cuda else {}
        launches = (
            KernelLaunch(_colmax_kernel, (cc, b), S=s, RB=rb, MB=min(2048, m), **common,
                         num_warps=knobs.bound_warps[0]),
            KernelLaunch(_gather_kernel, (c, b), BLOCK=knobs.block, CB=cb, **flags,
                         num_warps=knobs.num_warps, **follow, **regs),
            KernelLaunch(_finish_kernel, (b,), CB=cb, MC=mc, **common,
                         num_warps=knobs.bound_warps[1], **follow),
        )  # fmt: skip
        cand_at = b * m
    else:
        m = r = cc = 0
        # the tail's code must not cost the streaming part its occupancy: two 8-warp CTAs per SM
        tail = dict(maxnreg=128) if cuda and knobs.num_warps == 8 else {}
        kw = dict(common, BLOCK=knobs.block, num_warps=knobs.num_warps)
        launches = (
            KernelLaunch(_hist1_kernel, (c, b), **kw),
            KernelLaunch(_hist2_kernel, (c, b), **kw, **follow),
            KernelLaunch(_select_kernel, (c, b), **kw, CB=cb, MC=mc, PAIR_SMALL=PAIR_SMALL,
                         PAIR=PAIR, **follow, **tail),
        )  # fmt: skip
        cand_at = b * (_NB + 1) * c
    hn = n if n > k else 0  # the histogrammed length of every row when lengths is None
    return _Plan(
        bound, launches, _sort_launch(b, k) if sort else None, n, hn, stride, k, span, c, m, r,
        cc, cand_at + b * 2 * nn, cand_at,
    )  # fmt: skip


_PLANS: PlanCache[_Plan] = PlanCache()
_SORTS: PlanCache[KernelLaunch] = PlanCache()


# (device, stream) -> every workspace made for that stream, the largest last. None is freed (a
# graph captured before the growth may hold an older one's address) unless a call failed on it.
_STREAM_WORKSPACES: dict[tuple[int, int], list[torch.Tensor]] = {}


def _stream_workspace(batch: int, device: torch.device) -> torch.Tensor:
    """The current stream's zeroed workspace for ``batch`` rows (CUDA), or a fresh one."""
    if device.type != "cuda":
        return topk_workspace(batch, device)
    return _cuda_stream_workspace(batch, device)  # pragma: no cover - needs a GPU


def _cuda_stream_workspace(batch: int, device: torch.device) -> torch.Tensor:  # pragma: no cover
    if torch.cuda.is_current_stream_capturing():
        # graphs captured on one stream (torch's default capture stream is shared) may replay in
        # any order or at once: each gets its own workspace, zeroed by a memset in the graph
        return topk_workspace(batch, device)
    stream = torch.cuda.current_stream(device)
    made = _STREAM_WORKSPACES.setdefault((stream.device_index, stream.cuda_stream), [])
    if not made or made[-1].shape[0] < batch:
        made.append(topk_workspace(max(batch, 2 * made[-1].shape[0] if made else 8), device))
    return made[-1]


def _forget_workspace(ws: torch.Tensor) -> None:
    """Drops a cached workspace that a failed call may have left dirty."""
    for made in _STREAM_WORKSPACES.values():
        if any(w is ws for w in made):
            made[:] = [w for w in made if w is not ws]


def topk_trace(batch: int, device: torch.device | str) -> torch.Tensor:
    """A zeroed phase-trace buffer for `lightning_topk(trace=...)`: ``[kernel, row, CTA]`` ->
    the global timer (ns) at the CTA's start and end, then SM clocks (cycles) at its phases."""
    return torch.zeros((3, batch, _MAX_CTAS, 8), dtype=torch.int64, device=device)


def topk_workspace(batch: int, device: torch.device | str) -> torch.Tensor:
    """A zeroed workspace for `lightning_topk` calls of up to ``batch`` rows."""
    return torch.zeros((batch, _WS_ROW), dtype=torch.int32, device=device)


def sort_topk(
    scores: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, counts: torch.Tensor
) -> None:
    """Reorders `lightning_topk` results in place: value descending, ties by index ascending
    (one program per row, a bitonic sort of ``next_pow2(k)`` 64-bit keys)."""
    b, k = values.shape
    stride = scores.stride(0)
    tensors = (scores, values, indices, counts)
    key = (scores.device, b, k, stride, *(aligned(t) for t in tensors))
    _SORTS.get(key, lambda: _sort_launch(b, k))(*tensors, stride, k)


def _sort_launch(b: int, k: int) -> KernelLaunch:
    kp = triton.next_power_of_2(k)
    return KernelLaunch(_sort_kernel, (b,), KP=kp, num_warps=4 if kp <= 1024 else 8)
