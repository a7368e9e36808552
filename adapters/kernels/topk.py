"""Lightning TopK: exact, deterministic radix-select top-k over fp32 rows, no global sort.

Maths and output conventions: `adapters.kernels.reference.topk_reference` (same set as a stable
descending sort of the valid prefix cut at ``k``: ties at the k-th value go to the LOWEST
indices; ``-0.0`` equals ``+0.0``; no NaN). Output: ``(values (B, k) fp32, indices (B, k) int64,
counts (B,) int32)``; ``counts[b] = min(k, lengths[b])`` real entries first, then padding (index
0, value -inf; the project does not use -1 indices). Real entries come by index ascending (the
natural, deterministic order); ``sorted=True`` adds one small kernel that orders them by value
descending, ties by index ascending.

Algorithm. Each fp32 maps to an order-preserving uint32 key (sign flip; -0.0 canonicalised). A
row is split over ``C`` programs (CTAs), each owning a contiguous index range. Three launches
(after a memset of a small state block, none when the caller passes a reused `topk_workspace`,
which the last kernel leaves zeroed), no host synchronisation (CUDA-graph safe):

1. ``_hist1_kernel``: each CTA histograms the key's top 8 bits (``tl.histogram``, 256 bins) and
   adds it into the row's histogram (relaxed atomics, only non-empty bins).
2. ``_hist2_kernel``: every CTA derives the threshold digit ``t1`` from the row histogram (a
   256-bin cumsum, redone by each CTA: no "last CTA" step), histograms the next 8 bits of the
   keys whose top byte is ``t1``, adds it to the row's second histogram, and stores, for each
   digit ``d``, how many of its keys have a 16-bit prefix >= ``(t1, d)``.
3. ``_select_kernel``: every CTA derives the 16-bit threshold prefix ``P`` the same way, sums the
   previous CTAs' counts of keys >= ``P`` (its base), and copies its candidates (keys >= ``P``:
   the fewer than ``k`` keys above the threshold bin plus the bin, typically ``k`` + a few dozen)
   to a per-row buffer, compacted in index order. The last CTA of the row (an atomic ticket, no
   waiting) finishes on that buffer: two more 8-bit histograms over the candidates in the
   threshold bin give the exact threshold key ``T`` and how many of its ties to take (skipped
   when the bin's keys are all equal: their min and max are tracked with two atomics), then one
   scan writes the keys > ``T`` and the lowest-index ties, in index order, stopping at ``k``.

Costs: three passes over the row (L2-resident for moderate batches) with 256-bin histograms
(~60 instructions per 32 keys, against ~500 for the 4096-bin ones this replaces), and one short
serial tail per row. Rows with heavy ties make the candidate buffer long (up to the row); the
tail then scans it with one CTA: exact, slower. The buffer is ``(B, N)`` values + indices.

On Hopper the second and third kernels use programmatic dependent launch (``pdl``): they start
while the previous kernel finishes, load their first block of scores, and wait
(``griddepcontrol.wait``) before reading anything the previous kernel wrote.

A row with ``lengths[b] <= k`` skips the histograms and takes every valid entry.

The ``bound`` algorithm (opt-in, ``algorithm="bound"``) trades the histogram passes for a cheap
lower bound. ``_bound_kernel`` stores the maximum key of every chunk of ``G`` consecutive
entries (about ``8k`` chunks per row); the row's last CTA finds the 16-bit prefix ``P`` of the
``k``-th largest chunk maximum: at least ``k`` chunks, hence ``k`` entries, are at or above
``P << 16``, so every top-``k`` entry is. ``_gather_kernel`` counts each CTA's keys at or above
the bound, publishes the count, adds up the earlier CTAs' counts (they started first, so the
wait is short and never circular), copies its candidates in index order, and the row's last CTA
selects exactly among them (four 8-bit histogram rounds, then the scan above). For unordered
scores about ``1.07 k`` entries pass the bound, and the passes are light: on an H200 it is 1.4x
faster than the histogram algorithm at 32 and 128 rows of 262,144. But when the top entries are
packed into few chunks (a run of recent entries, an ascending row) up to ``k * G`` entries pass
and the single-CTA selection dominates (10x slower on ascending rows at batch 1), and at batch 1
its serial steps cost more than the third launch saves; hence not the default.
"""

from __future__ import annotations

import inspect
import os

import torch
import triton
import triton.language as tl

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


__all__ = ["lightning_topk", "sort_topk", "topk_workspace"]

# Per-row state, int32 words, all zero between calls: hist1[256], hist2[256], ticket, the
# threshold bin's max low-16 bits and (0xFFFF - min low-16 bits).
_NB = 256
_MAX_CTAS = 1024  # CTAs per row (the bound algorithm publishes one count per CTA)
_WS_ROW = 2 * _NB + 8 + _MAX_CTAS
NB = tl.constexpr(_NB)
HIST1, HIST2 = tl.constexpr(0), tl.constexpr(_NB)
TICKET, LOMAX, LONEG = tl.constexpr(2 * _NB), tl.constexpr(2 * _NB + 1), tl.constexpr(2 * _NB + 2)
TICKET_A, BOUND, COUNTS = (
    tl.constexpr(2 * _NB + 3),
    tl.constexpr(2 * _NB + 4),
    tl.constexpr(2 * _NB + 8),
)
WS_ROW = tl.constexpr(_WS_ROW)
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
        n = tl.minimum(tl.maximum(tl.load(len_ptr + b).to(tl.int32), 0), N)
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
    BLOCK: tl.constexpr,
    HAS_LEN: tl.constexpr,
    HIST_MASK: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()  # the next kernel may start its loads now
    pid = tl.program_id(0)
    b = tl.program_id(1)
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
    st = st_ptr + b.to(tl.int64) * WS_ROW
    tl.atomic_add(st + HIST1 + tl.arange(0, NB), hist, mask=hist > 0, sem="relaxed")


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
    BLOCK: tl.constexpr,
    HAS_LEN: tl.constexpr,
    HIST_MASK: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    b = tl.program_id(1)
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
    hist = tl.zeros((NB,), tl.int32)
    above = tl.sum(tl.zeros((BLOCK,), tl.int32), axis=0)
    for off in range(start, end, BLOCK):
        idx_n = off + BLOCK + tl.arange(0, BLOCK)
        x_n = tl.load(row + idx_n, mask=idx_n < lim, other=0.0)
        hist, above = _digit2(x, idx < end, t1, hist, above, BLOCK, HIST_MASK)
        x, idx = x_n, idx_n
    # keys of this CTA with a 16-bit prefix >= (t1, d), for every d
    ge = above + tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    tl.store(ge_ptr + (b.to(tl.int64) * NB + bins) * C + pid, ge)
    tl.atomic_add(st + HIST2 + bins, hist, mask=hist > 0, sem="relaxed")


@triton.jit
def _compact(x, idx, ok, p16, running, lomax, loneg, cv, ci, N):
    """Copies the candidates among ``x`` (keys with a 16-bit prefix >= ``p16``, or every valid
    entry when the row takes all) to ``cv``/``ci`` from position ``running``, in index order;
    tracks the low 16 bits of the keys in the threshold bin."""
    key = _keys(x)
    pre = key >> 16
    cand = ok & (pre >= p16)
    c = cand.to(tl.int32)
    pos = running + tl.cumsum(c, axis=0) - c
    put = cand & (pos < N)
    tl.store(cv + pos, x, mask=put)
    tl.store(ci + pos, idx, mask=put)
    inb = cand & (pre == p16)
    lo = (key & 0xFFFF).to(tl.int32)
    lomax = tl.maximum(lomax, tl.where(inb, lo, 0))  # elementwise; reduced once at the end
    loneg = tl.maximum(loneg, tl.where(inb, 0xFFFF - lo, 0))
    return running + tl.sum(c, axis=0), lomax, loneg


@triton.jit
def _chunk(ptr, v0, s, total, MC: tl.constexpr):
    """Candidates ``s .. s+MC`` of the tail's buffer: the first chunk from registers ``v0`` (loaded
    once), later ones from memory (L2: written by other CTAs of this kernel)."""
    p = s + tl.arange(0, MC)
    okp = p < total
    v = tl.load(ptr + p, mask=okp & (p >= MC), other=0, cache_modifier=".cg")
    return tl.where(p < MC, v0, v), okp


@triton.jit
def _refine(
    cv, v0, total, prefix, shift: tl.constexpr, krem, MC: tl.constexpr, HIST_MASK: tl.constexpr
):
    """Next 8-bit digit (bits ``shift+7 .. shift``) of the ``krem``-th largest candidate among those
    whose key >> (shift + 8) equals ``prefix``."""
    h = tl.zeros((NB,), tl.int32)
    for s in range(0, total, MC):
        v, okp = _chunk(cv, v0, s, total, MC)
        key = _keys(v)
        inb = okp & ((key >> (shift + 8)) == prefix)
        h += _histogram(((key >> shift) & 0xFF).to(tl.int32), inb, NB, MC, HIST_MASK)
    t, krem2, _ = _select_bin(h, krem, NB)
    return (prefix << 8) | t.to(tl.uint32), krem2


@triton.jit
def _emit(
    cv, ci, v0, i0, total, thr, need, count, val_ptr, idx_ptr, cnt_ptr, b, k, MC: tl.constexpr
):
    """Writes row ``b``'s result from its candidates: the keys above ``thr`` and the ``need``
    lowest-index ties at ``thr``, in index order, stopping at ``count``; then the padding."""
    out_v = val_ptr + b.to(tl.int64) * k
    out_i = idx_ptr + b.to(tl.int64) * k
    written = 0
    ties = 0
    s = 0
    while (s < total) & (written < count):
        v, okp = _chunk(cv, v0, s, total, MC)
        i, okp = _chunk(ci, i0, s, total, MC)
        key = _keys(v)
        tie = (okp & (key == thr)).to(tl.int32)
        rank = ties + tl.cumsum(tie, axis=0) - tie
        sel = (okp & ((key > thr) | ((tie != 0) & (rank < need)))).to(tl.int32)
        pos = written + tl.cumsum(sel, axis=0) - sel
        put = (sel != 0) & (pos < k)
        tl.store(out_v + pos, v, mask=put)
        tl.store(out_i + pos, i.to(tl.int64), mask=put)
        ties += tl.sum(tie, axis=0)
        written += tl.sum(sel, axis=0)
        s += MC
    for off in range(count, k, MC):
        p = off + tl.arange(0, MC)
        pm = p < k
        tl.store(out_v + p, tl.full((MC,), float("-inf"), tl.float32), mask=pm)
        tl.store(out_i + p, tl.zeros((MC,), tl.int64), mask=pm)
    tl.store(cnt_ptr + b, count)


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
    BLOCK: tl.constexpr,
    CB: tl.constexpr,
    MC: tl.constexpr,
    HAS_LEN: tl.constexpr,
    HIST_MASK: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    b = tl.program_id(1)
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
    p16 = (((t1 << 8) | t2) * keep).to(tl.uint32)  # 0 for rows taking all: every key is >= 0
    # candidates in the CTAs before this one (rows taking all: every index is a candidate)
    base = start * (1 - keep)
    gep = ge_ptr + (b.to(tl.int64) * NB + t2) * C
    for c0 in range(0, pid * keep, CB):
        cc = c0 + tl.arange(0, CB)
        base += tl.sum(tl.load(gep + cc, mask=cc < pid, other=0, cache_modifier=".cg"), axis=0)
    cv = cv_ptr + b.to(tl.int64) * (2 * N)  # the row's candidates: [values | indices]
    ci = ci_ptr + b.to(tl.int64) * (2 * N) + N
    lomax = tl.zeros((BLOCK,), tl.int32)
    loneg = lomax
    running = base
    for off in range(start, stop, BLOCK):
        idx_n = off + BLOCK + tl.arange(0, BLOCK)
        x_n = tl.load(row + idx_n, mask=idx_n < lim, other=0.0)
        running, lomax, loneg = _compact(x, idx, idx < stop, p16, running, lomax, loneg, cv, ci, N)
        x, idx = x_n, idx_n
    tl.atomic_max(st + LOMAX, tl.max(lomax, axis=0), sem="relaxed")
    tl.atomic_max(st + LONEG, tl.max(loneg, axis=0), sem="relaxed")
    tl.debug_barrier()
    if tl.atomic_add(st + TICKET, 1, sem="acq_rel") == C - 1:
        # the row's last CTA: every candidate is in the buffer; finish there
        count = tl.minimum(n, k)
        total = n + keep * (a1 + tl.sum(tl.where(bins >= t2, h2, 0), axis=0) - n)
        # the first chunk of candidates, and the threshold bin's key range, in one round trip
        p = tl.arange(0, MC)
        v0 = tl.load(cv + p, mask=p < total, other=0.0, cache_modifier=".cg")
        i0 = tl.load(ci + p, mask=p < total, other=0, cache_modifier=".cg")
        lo_hi = tl.load(st + LOMAX, cache_modifier=".cg")
        lo_lo = 0xFFFF - tl.load(st + LONEG, cache_modifier=".cg")
        if keep != 0:
            if lo_hi == lo_lo:  # every key of the threshold bin is the same: it is T
                thr = (p16 << 16) | lo_hi.to(tl.uint32)
                need = krem2
            else:
                p24, krem3 = _refine(cv, v0, total, p16, 8, krem2, MC, HIST_MASK)
                thr, need = _refine(cv, v0, total, p24, 0, krem3, MC, HIST_MASK)
        else:  # every valid key is > 0: take them all
            thr = p16 * 0
            need = krem2 * 0
        _emit(cv, ci, v0, i0, total, thr, need, count, val_ptr, idx_ptr, cnt_ptr, b, k, MC)
        # leave the state zeroed for the next call (every CTA has read it: they all took a ticket)
        for off in range(0, WS_ROW, MC):
            p = off + tl.arange(0, MC)
            tl.store(st + p, tl.zeros((MC,), tl.int32), mask=p < WS_ROW)


# -- the bound algorithm: chunk maxima give a lower bound; one pass gathers what is above it ----


@triton.jit
def _refine_top(cv, v0, total, krem, MC: tl.constexpr, HIST_MASK: tl.constexpr):
    """Top byte of the ``krem``-th largest candidate, and the rank left in its bin."""
    h = tl.zeros((NB,), tl.int32)
    for s in range(0, total, MC):
        v, okp = _chunk(cv, v0, s, total, MC)
        h += _histogram((_keys(v) >> 24).to(tl.int32), okp, NB, MC, HIST_MASK)
    t, krem2, _ = _select_bin(h, krem, NB)
    return t.to(tl.uint32), krem2


@triton.jit
def _maxima_digit(
    mrow, chunks, t1, krem, TOP: tl.constexpr, MB: tl.constexpr, HIST_MASK: tl.constexpr
):
    """Bin of the ``krem``-th largest chunk maximum and the rank left in it: by the top byte
    (``TOP``), else by the second byte among the maxima whose top byte is ``t1``."""
    h = tl.zeros((NB,), tl.int32)
    for s in range(0, chunks, MB):
        p = s + tl.arange(0, MB)
        v = tl.load(mrow + p, mask=p < chunks, other=0, cache_modifier=".cg")
        v = v.to(tl.uint32, bitcast=True)
        if TOP:
            h += _histogram((v >> 24).to(tl.int32), p < chunks, NB, MB, HIST_MASK)
        else:
            ok = (p < chunks) & ((v >> 24) == t1)
            h += _histogram(((v >> 16) & 0xFF).to(tl.int32), ok, NB, MB, HIST_MASK)
    t, krem2, _ = _select_bin(h, krem, NB)
    return tl.maximum(t, 0).to(tl.uint32), krem2


@triton.jit
def _bound_kernel(
    x_ptr,
    len_ptr,
    st_ptr,
    mx_ptr,
    N,
    HN,
    stride_x,
    span,
    k,
    C,
    M,
    BLOCK: tl.constexpr,
    G: tl.constexpr,
    MB: tl.constexpr,
    HAS_LEN: tl.constexpr,
    HIST_MASK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Stores the maximum key of every ``G`` consecutive entries; the row's last CTA then finds
    the 16-bit prefix ``P`` of the ``k``-th largest chunk maximum and publishes the bound
    ``P << 16``: at least ``k`` chunks have a maximum at or above it, so at least ``k`` entries
    are, and every top-``k`` entry is."""
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    b = tl.program_id(1)
    row = x_ptr + b.to(tl.int64) * stride_x
    n, hist_n, keep = _row_extent(len_ptr, b, N, HN, k, HAS_LEN)
    start = pid * span
    end = tl.minimum(start + span, hist_n)
    lim = _load_limit(start, span, N, end)
    mrow = mx_ptr + b.to(tl.int64) * M
    idx = start + tl.arange(0, BLOCK)
    x = tl.load(row + idx, mask=idx < lim, other=0.0)
    for off in range(start, end, BLOCK):
        idx_n = off + BLOCK + tl.arange(0, BLOCK)
        x_n = tl.load(row + idx_n, mask=idx_n < lim, other=0.0)
        key = tl.where(idx < end, _keys(x), 0)
        cmax = tl.max(tl.reshape(key, (BLOCK // G, G)), axis=1)
        tl.store(mrow + off // G + tl.arange(0, BLOCK // G), cmax.to(tl.int32, bitcast=True))
        x, idx = x_n, idx_n
    tl.debug_barrier()
    st = st_ptr + b.to(tl.int64) * WS_ROW
    if tl.atomic_add(st + TICKET_A, 1, sem="acq_rel") == C - 1:
        chunks = tl.cdiv(hist_n, G)  # 0 for rows taking every entry
        t1, krem = _maxima_digit(mrow, chunks, 0, k, True, MB, HIST_MASK)
        t2, _ = _maxima_digit(mrow, chunks, t1, krem, False, MB, HIST_MASK)
        # fewer than k chunks: no bound, every entry is a candidate
        bound = tl.where(chunks >= k, (t1 << 24) | (t2 << 16), 0)
        tl.store(st + BOUND, bound.to(tl.int32, bitcast=True))
        tl.store(st + TICKET_A, 0)


@triton.jit
def _gather_kernel(
    x_ptr,
    len_ptr,
    st_ptr,
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
    BLOCK: tl.constexpr,
    CB: tl.constexpr,
    MC: tl.constexpr,
    HAS_LEN: tl.constexpr,
    HIST_MASK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Copies the keys at or above the bound to the row's candidate buffer in index order (each
    CTA counts its own, publishes the count and adds up the earlier CTAs' counts: no chained
    wait), then the row's last CTA selects exactly among the candidates."""
    pid = tl.program_id(0)
    b = tl.program_id(1)
    row = x_ptr + b.to(tl.int64) * stride_x
    n, hist_n, keep = _row_extent(len_ptr, b, N, HN, k, HAS_LEN)
    start = pid * span
    stop = tl.minimum(start + span, n)
    lim = _load_limit(start, span, N, stop)
    first = start + tl.arange(0, BLOCK)
    x0 = tl.load(row + first, mask=first < lim, other=0.0)  # scores are ready already
    if PDL:
        gdc_wait()  # the bound is published and visible
    st = st_ptr + b.to(tl.int64) * WS_ROW
    bound = tl.load(st + BOUND, cache_modifier=".cg").to(tl.uint32, bitcast=True)
    count = tl.sum(tl.zeros((BLOCK,), tl.int32), axis=0)
    for off in range(start, stop, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        again = idx >= start + BLOCK  # the first block is still in registers
        x = tl.where(again, tl.load(row + idx, mask=again & (idx < lim), other=0.0), x0)
        count += tl.sum(((idx < stop) & (_keys(x) >= bound)).to(tl.int32), axis=0)
    cnt = st + COUNTS
    tl.atomic_xchg(cnt + pid, count + 1, sem="relaxed")  # 0 means "not counted yet"
    base = count * 0
    for c0 in range(0, pid, CB):
        cc = c0 + tl.arange(0, CB)
        earlier = cc < pid
        v = tl.load(cnt + cc, mask=earlier, other=1, volatile=True)
        while tl.min(v, axis=0) == 0:  # earlier CTAs started first: they are counting
            v = tl.load(cnt + cc, mask=earlier, other=1, volatile=True)
        base += tl.sum(v - 1, axis=0)
    cv = cv_ptr + b.to(tl.int64) * (2 * N)  # the row's candidates: [values | indices]
    ci = ci_ptr + b.to(tl.int64) * (2 * N) + N
    running = base
    for off in range(start, stop, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        again = idx >= start + BLOCK  # the first block is still in registers
        x = tl.where(again, tl.load(row + idx, mask=again & (idx < lim), other=0.0), x0)
        cand = (idx < stop) & (_keys(x) >= bound)
        c = cand.to(tl.int32)
        pos = running + tl.cumsum(c, axis=0) - c
        put = cand & (pos < N)
        tl.store(cv + pos, x, mask=put)
        tl.store(ci + pos, idx, mask=put)
        running += tl.sum(c, axis=0)
    tl.debug_barrier()
    if tl.atomic_add(st + TICKET, 1, sem="acq_rel") == C - 1:
        total = base * 0
        for c0 in range(0, C, CB):
            cc = c0 + tl.arange(0, CB)
            v = tl.load(cnt + cc, mask=cc < C, other=1, cache_modifier=".cg")
            total += tl.sum(v - 1, axis=0)
        count = tl.minimum(n, k)
        p = tl.arange(0, MC)
        v0 = tl.load(cv + p, mask=p < total, other=0.0, cache_modifier=".cg")
        i0 = tl.load(ci + p, mask=p < total, other=0, cache_modifier=".cg")
        if total > count:  # exact threshold key T among the candidates, byte by byte
            p8, krem = _refine_top(cv, v0, total, count, MC, HIST_MASK)
            p16, krem = _refine(cv, v0, total, p8, 16, krem, MC, HIST_MASK)
            p24, krem = _refine(cv, v0, total, p16, 8, krem, MC, HIST_MASK)
            thr, need = _refine(cv, v0, total, p24, 0, krem, MC, HIST_MASK)
        else:  # exactly the candidates
            thr = bound * 0
            need = total
        _emit(cv, ci, v0, i0, total, thr, need, count, val_ptr, idx_ptr, cnt_ptr, b, k, MC)
        tl.store(st + TICKET, 0)
        tl.store(st + BOUND, 0)
        for c0 in range(0, C, MC):
            p = c0 + tl.arange(0, MC)
            tl.store(cnt + p, tl.zeros((MC,), tl.int32), mask=p < C)


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


def _split(n: int, b: int, block: int, device: torch.device, ctas: int | None) -> tuple[int, int]:
    """(CTAs per row, span per CTA, a multiple of ``block``): about four CTAs per SM in all."""
    most = max(1, triton.cdiv(n, block))
    c = ctas or triton.cdiv(4 * _sm_count(device), b)
    c = max(1, min(c, most, _MAX_CTAS))
    span = triton.cdiv(triton.cdiv(max(n, 1), c), block) * block
    return max(1, triton.cdiv(n, span)), span


def _chunk_size(n: int, k: int, block: int) -> int:
    """Entries per chunk maximum: about ``8k`` chunks per row. Then, for scores without order,
    the bound lets through about ``1.07 k`` entries (``M ln(M / (M - k))`` for ``M`` chunks);
    at worst (the top entries packed into ``k`` chunks) ``k`` chunks' worth."""
    g = triton.next_power_of_2(max(1, n // (8 * k)))
    return max(1, min(g, block))


def _use_pdl(device: torch.device, pdl: bool | None) -> bool:
    """Programmatic dependent launch: Hopper or newer, Triton with ``griddepcontrol``; on by
    default unless ``ADAPTERS_TOPK_PDL=0``."""
    if device.type != "cuda" or not _HAS_GDC or pdl is False:
        return False
    if pdl is None and os.environ.get("ADAPTERS_TOPK_PDL", "1") == "0":  # pragma: no cover
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9  # pragma: no cover - needs a GPU


def lightning_topk(
    scores: torch.Tensor,
    k: int,
    lengths: torch.Tensor | None = None,
    *,
    sorted: bool = False,
    block: int = 2048,
    ctas: int | None = None,
    num_warps: int = 8,
    hist_mask: bool | None = None,
    workspace: torch.Tensor | None = None,
    pdl: bool | None = None,
    algorithm: str = "histogram",
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-``k`` of each row of ``scores`` ``(B, N)`` fp32 over its valid prefix ``lengths``
    ``(B,)`` (None: all ``N``). Returns ``(values, indices, counts)`` as
    `reference.topk_reference` does (index order; ``sorted=True``: value order). ``block``,
    ``ctas`` (CTAs per row) and ``num_warps`` are launch knobs (benchmark sweeps); ``hist_mask``
    forces the histogram variant (None: masked when this Triton supports it); ``pdl``:
    programmatic dependent launch of the 2nd and 3rd kernels (None: on for CUDA capability >= 9
    unless ``ADAPTERS_TOPK_PDL=0``). ``algorithm``: ``"histogram"`` (the default: two
    histogram passes, three launches; the same cost whatever the data) or ``"bound"`` (chunk
    maxima bound, two launches: 1.4x faster at 32+ rows of random scores, but slow when the top
    entries are packed into few chunks; see the module docstring); ``chunk``: entries per chunk
    maximum of the bound algorithm (None: about ``N / 8k``).

    ``workspace``: an int32 buffer from `topk_workspace` (all zeros), reused across calls: the
    kernels leave it zeroed again, which saves the memset of a fresh one. Calls sharing one
    workspace must not run concurrently (one per stream, or per captured graph replayed on one
    stream)."""
    if scores.dim() != 2:
        raise ValueError("scores must be (B, N)")
    if k < 1:
        raise ValueError("k must be positive")
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
    if n >= 2**31 // 2:
        raise ValueError("rows of 2**30 entries or more are not supported")
    if algorithm not in ("histogram", "bound"):
        raise ValueError(f"unknown algorithm {algorithm!r}: 'histogram' or 'bound'")
    if chunk is not None and (chunk < 1 or chunk > block or chunk & (chunk - 1)):
        raise ValueError("chunk must be a power of two no larger than block")
    c, span = _split(n, b, block, dev, ctas)
    if workspace is None:
        ws = torch.zeros((b, _WS_ROW), dtype=torch.int32, device=dev)
    elif workspace.dtype != torch.int32 or workspace.numel() < b * _WS_ROW:
        raise ValueError(f"workspace must be int32 with at least {b} x {_WS_ROW} entries")
    else:
        ws = workspace
    has_len = lengths is not None
    lens = lengths.contiguous() if lengths is not None else counts
    use_pdl = _use_pdl(dev, pdl)
    grid = (c, b)
    common = dict(
        BLOCK=block,
        HAS_LEN=has_len,
        HIST_MASK=HIST_MASK if hist_mask is None else hist_mask,
        PDL=use_pdl,
        num_warps=num_warps,
    )
    follow = dict(launch_pdl=True) if use_pdl else {}
    # the tail's code must not cost the streaming part its occupancy: two 8-warp CTAs per SM
    tail = dict(maxnreg=128) if dev.type == "cuda" and num_warps == 8 else {}
    stride = scores.stride(0)
    hn = n if n > k else 0  # the histogrammed length of every row when lengths is None
    nn = max(n, 1)
    mc = min(2048, max(1024, triton.next_power_of_2(k + k // 2)))  # the tail's chunk
    cb = min(1024, triton.next_power_of_2(c))
    if algorithm == "bound":
        g = chunk or _chunk_size(n, k, block)
        m = c * span // g  # chunk maxima per row (every block's chunks)
        # one scratch allocation: chunk maxima (b, m), then per row [values | indices] (2n)
        scratch = torch.empty((b * (m + 2 * nn),), dtype=torch.int32, device=dev)
        mx, cand = scratch[: b * m], scratch[b * m :]
        mb = min(2048, max(16, triton.next_power_of_2(m)))
        _bound_kernel[grid](
            scores, lens, ws, mx, n, hn, stride, span, k, c, m, G=g, MB=mb, **common
        )
        _gather_kernel[grid](
            scores, lens, ws, cand.view(torch.float32), cand, values, indices, counts,
            n, hn, stride, span, k, c, CB=cb, MC=mc, **common, **follow, **tail,
        )  # fmt: skip
    else:
        # one scratch allocation: per-CTA counts (b, 256, c), then per row [values | indices]
        scratch = torch.empty((b * (_NB * c + 2 * nn),), dtype=torch.int32, device=dev)
        ge, cand = scratch[: b * _NB * c], scratch[b * _NB * c :]
        _hist1_kernel[grid](scores, lens, ws, n, hn, stride, span, k, **common)
        _hist2_kernel[grid](scores, lens, ws, ge, n, hn, stride, span, k, c, **common, **follow)
        _select_kernel[grid](
            scores, lens, ws, ge, cand.view(torch.float32), cand, values, indices, counts,
            n, hn, stride, span, k, c, CB=cb, MC=mc, **common, **follow, **tail,
        )  # fmt: skip
    if sorted:
        sort_topk(scores, values, indices, counts)
    return values, indices, counts


def topk_workspace(batch: int, device: torch.device | str) -> torch.Tensor:
    """A zeroed workspace for `lightning_topk` calls of up to ``batch`` rows."""
    return torch.zeros((batch, _WS_ROW), dtype=torch.int32, device=device)


def sort_topk(
    scores: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, counts: torch.Tensor
) -> None:
    """Reorders `lightning_topk` results in place: value descending, ties by index ascending
    (one program per row, a bitonic sort of ``next_pow2(k)`` 64-bit keys)."""
    b, k = values.shape
    kp = triton.next_power_of_2(k)
    _sort_kernel[(b,)](
        scores,
        values,
        indices,
        counts,
        scores.stride(0),
        k,
        KP=kp,
        num_warps=4 if kp <= 1024 else 8,
    )
