"""Lightning TopK: exact, deterministic radix-select top-k over fp32 rows, no global sort.

Maths and output conventions: `adapters.kernels.reference.topk_reference` (same set as a stable
descending sort of the valid prefix cut at ``k``: ties at the k-th value go to the LOWEST
indices; ``-0.0`` equals ``+0.0``; no NaN). Output: ``(values (B, k) fp32, indices (B, k) int64,
counts (B,) int32)``; ``counts[b] = min(k, lengths[b])`` real entries first, then padding (index
0, value -inf; the project does not use -1 indices). Real entries come by index ascending (the
scatter's natural, deterministic order); ``sorted=True`` adds one small kernel that orders them
by value descending, ties by index ascending.

Algorithm. Each fp32 maps to an order-preserving uint32 key (sign flip; -0.0 canonicalised).
A row is split over ``C`` programs (CTAs), each owning a contiguous index range. Four launches
after one memset of a small workspace (none when the caller passes a reused `topk_workspace`,
which the last kernel leaves zeroed), with no host synchronisation (CUDA-graph safe):

1. ``_hist_kernel`` PASS 1: each CTA histograms the key's top 12 bits locally (``tl.histogram``)
   and adds its histogram into the row's global one (relaxed atomics); the last CTA to finish
   (an atomic ticket, no waiting) scans it and stores the threshold digit and the count still
   needed below it.
2. ``_hist_kernel`` PASS 2: the same on the next 12 bits, among keys matching the 12-bit prefix.
3. ``_pass3_kernel``: the last 8 bits among keys matching the 24-bit prefix; each CTA also writes
   its own 256-bin histogram, its count of keys above the 24-bit prefix and its suffix counts.
4. ``_scatter_kernel``: every CTA finds the exact threshold key ``T`` and the number ``need`` of
   ties to take from the 256-bin global histogram, derives from the other CTAs' per-CTA counts
   how many selected entries and ties lie before its range, and writes its entries with key > T
   plus the ties whose row-wide tie rank is < need, at positions given by prefix sums: output
   order is index order, independent of scheduling.

A row with ``lengths[b] <= k`` skips the histograms and takes every valid entry.
"""

from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

__all__ = ["lightning_topk", "sort_topk", "topk_workspace"]

# Workspace layout, int32 words; the kernels see these as constexpr globals.
_BINS, _BINS3 = 4096, 256  # passes 1 and 2: 12-bit digits; pass 3: 8 bits
_STATE = 2 * _BINS + _BINS3  # per row: hist1, hist2, hist3, [P1, krem1, P2, krem2, 3 tickets]
_WS_ROW = _STATE + 16
_CTA_ROW = 1 + 2 * _BINS3  # per CTA: [above the 24-bit prefix, hist3[256], count above bin[256]]
BINS, BINS3 = tl.constexpr(_BINS), tl.constexpr(_BINS3)
HIST1, HIST2, HIST3 = tl.constexpr(0), tl.constexpr(_BINS), tl.constexpr(2 * _BINS)
STATE, WS_ROW, CTA_ROW = tl.constexpr(_STATE), tl.constexpr(_WS_ROW), tl.constexpr(_CTA_ROW)
# `tl.histogram(..., mask=)` skips masked keys (no shared-memory atomics on them); without it
# (older Triton) masked keys go to bin 0 and are subtracted again.
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
def _histogram(digit, ok, NB: tl.constexpr, BLOCK: tl.constexpr, HIST_MASK: tl.constexpr):
    if HIST_MASK:
        h = tl.histogram(digit, NB, mask=ok)
    else:
        h = tl.histogram(tl.where(ok, digit, 0), NB)
        h -= tl.where(tl.arange(0, NB) == 0, BLOCK - tl.sum(ok.to(tl.int32), axis=0), 0)
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
def _select_bin(h, krem, NB: tl.constexpr):
    """Bin ``t`` holding the ``krem``-th largest key of histogram ``h`` and the rank left in it."""
    bins = tl.arange(0, NB)
    gt = tl.sum(h, axis=0) - tl.cumsum(h, axis=0)  # keys in bins above each bin
    hit = (gt < krem) & (gt + h >= krem)
    t = tl.max(tl.where(hit, bins, -1), axis=0)
    return t, krem - tl.sum(tl.where(bins == t, gt, 0), axis=0)


@triton.jit
def _hist_kernel(
    x_ptr,
    len_ptr,
    ws_ptr,
    N,
    HN,
    stride_x,
    span,
    k,
    C,
    PASS: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_LEN: tl.constexpr,
    HIST_MASK: tl.constexpr,
):
    pid = tl.program_id(0)
    b = tl.program_id(1)
    row = x_ptr + b.to(tl.int64) * stride_x
    ws = ws_ptr + b.to(tl.int64) * WS_ROW
    n, hist_n, keep = _row_extent(len_ptr, b, N, HN, k, HAS_LEN)
    start = pid * span
    end = tl.minimum(start + span, hist_n)
    bins = tl.arange(0, BINS)
    prefix = tl.load(ws + STATE).to(tl.uint32)  # pass 2: the 12-bit prefix
    hist = tl.zeros((BINS,), tl.int32)
    for off in range(start, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        ok = idx < end
        key = _keys(tl.load(row + idx, mask=ok, other=0.0))
        if PASS == 1:
            digit = (key >> 20).to(tl.int32)
        else:
            ok = ok & ((key >> 20) == prefix)
            digit = ((key >> 8) & 0xFFF).to(tl.int32)
        hist += _histogram(digit, ok, BINS, BLOCK, HIST_MASK)
    hptr = ws + (HIST1 if PASS == 1 else HIST2) + bins
    tl.atomic_add(hptr, hist, mask=hist > 0, sem="relaxed")
    tl.debug_barrier()
    ticket = tl.atomic_add(ws + STATE + 3 + PASS, 1, sem="acq_rel")
    if ticket == C - 1:  # last CTA of the row: every histogram update is in
        h = tl.load(hptr, cache_modifier=".cg")
        if PASS == 1:
            t, krem = _select_bin(h, k, BINS)
            tl.store(ws + STATE, t)
            tl.store(ws + STATE + 1, krem)
        else:
            t, krem = _select_bin(h, tl.load(ws + STATE + 1), BINS)
            tl.store(ws + STATE + 2, (prefix.to(tl.int32) << 12) | t)
            tl.store(ws + STATE + 3, krem)


@triton.jit
def _pass3_kernel(
    x_ptr,
    len_ptr,
    ws_ptr,
    cta_ptr,
    N,
    HN,
    stride_x,
    span,
    k,
    C,
    BLOCK: tl.constexpr,
    HAS_LEN: tl.constexpr,
    HIST_MASK: tl.constexpr,
):
    pid = tl.program_id(0)
    b = tl.program_id(1)
    row = x_ptr + b.to(tl.int64) * stride_x
    ws = ws_ptr + b.to(tl.int64) * WS_ROW
    n, hist_n, keep = _row_extent(len_ptr, b, N, HN, k, HAS_LEN)
    start = pid * span
    stop = tl.minimum(start + span, n)
    end = tl.minimum(start + span, hist_n)
    bins = tl.arange(0, BINS3)
    prefix = tl.load(ws + STATE + 2).to(tl.uint32)  # the 24-bit prefix
    hist = tl.zeros((BINS3,), tl.int32)
    above = 0
    for off in range(start, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        ok = idx < end
        key = _keys(tl.load(row + idx, mask=ok, other=0.0))
        hi = key >> 8
        above += tl.sum((ok & (hi > prefix)).to(tl.int32), axis=0)
        ok = ok & (hi == prefix)
        hist += _histogram((key & 0xFF).to(tl.int32), ok, BINS3, BLOCK, HIST_MASK)
    if hist_n == 0:  # a row taking all its entries: they all count as above the threshold
        above = tl.maximum(stop - start, 0)
    cta = cta_ptr + (b.to(tl.int64) * C + pid) * CTA_ROW
    tl.store(cta, above)
    tl.store(cta + 1 + bins, hist)
    tl.store(cta + 1 + BINS3 + bins, tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0))
    tl.atomic_add(ws + HIST3 + bins, hist, mask=hist > 0, sem="relaxed")


@triton.jit
def _scatter_kernel(
    x_ptr,
    len_ptr,
    ws_ptr,
    cta_ptr,
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
    HAS_LEN: tl.constexpr,
    CLEAN: tl.constexpr,
):
    pid = tl.program_id(0)
    b = tl.program_id(1)
    row = x_ptr + b.to(tl.int64) * stride_x
    ws = ws_ptr + b.to(tl.int64) * WS_ROW
    n, hist_n, keep = _row_extent(len_ptr, b, N, HN, k, HAS_LEN)
    # keep == 0: the row takes all its entries (every valid key > 0)
    # the exact threshold key and how many of its ties to take
    h3 = tl.load(ws + HIST3 + tl.arange(0, BINS3))
    t3, need = _select_bin(h3, tl.load(ws + STATE + 3), BINS3)
    t3 = t3 * keep
    need = need * keep
    thr = (tl.load(ws + STATE + 2).to(tl.uint32) << 8) | t3.to(tl.uint32)
    thr = thr * keep.to(tl.uint32)
    # entries selected, and ties, in the CTAs before this one
    tie_before = 0
    sel_before = 0
    for c0 in range(0, pid, CB):
        cc = c0 + tl.arange(0, CB)
        m = cc < pid
        cta = cta_ptr + (b.to(tl.int64) * C + cc) * CTA_ROW
        gt = tl.load(cta, mask=m, other=0) + tl.load(cta + 1 + BINS3 + t3, mask=m, other=0)
        tie = tl.load(cta + 1 + t3, mask=m, other=0)
        tie_ex = tie_before + tl.cumsum(tie, axis=0) - tie
        chosen = tl.minimum(tl.maximum(need - tie_ex, 0), tie)
        tie_before += tl.sum(tie, axis=0)
        sel_before += tl.sum(gt + chosen, axis=0)
    out_v = val_ptr + b.to(tl.int64) * k
    out_i = idx_ptr + b.to(tl.int64) * k
    start = pid * span
    end = tl.minimum(start + span, n)
    for off in range(start, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        ok = idx < end
        x = tl.load(row + idx, mask=ok, other=0.0)
        key = _keys(x)
        tie = (ok & (key == thr)).to(tl.int32)
        rank = tie_before + tl.cumsum(tie, axis=0) - tie
        sel = ((ok & (key > thr)) | ((tie != 0) & (rank < need))).to(tl.int32)
        pos = sel_before + tl.cumsum(sel, axis=0) - sel
        put = (sel != 0) & (pos < k)  # pos < k always holds; it keeps every store in bounds
        tl.store(out_v + pos, x, mask=put)
        tl.store(out_i + pos, idx.to(tl.int64), mask=put)
        tie_before += tl.sum(tie, axis=0)
        sel_before += tl.sum(sel, axis=0)
    if pid == 0:
        count = tl.minimum(n, k)
        tl.store(cnt_ptr + b, count)
        for off in range(count, k, BLOCK):
            p = off + tl.arange(0, BLOCK)
            pm = p < k
            tl.store(out_v + p, tl.full((BLOCK,), float("-inf"), tl.float32), mask=pm)
            tl.store(out_i + p, tl.zeros((BLOCK,), tl.int64), mask=pm)
    if CLEAN:  # a caller-owned workspace: the row's last CTA (all reads done) zeroes it again
        tl.debug_barrier()
        if tl.atomic_add(ws + STATE + 6, 1, sem="acq_rel") == C - 1:
            for off in range(0, WS_ROW, BLOCK):
                p = off + tl.arange(0, BLOCK)
                tl.store(ws + p, tl.zeros((BLOCK,), tl.int32), mask=p < WS_ROW)


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
    """(CTAs per row, span per CTA, a multiple of ``block``)."""
    most = max(1, triton.cdiv(n, block))
    c = ctas or triton.cdiv(2 * _sm_count(device), b)
    c = max(1, min(c, most))
    span = triton.cdiv(triton.cdiv(max(n, 1), c), block) * block
    return max(1, triton.cdiv(n, span)), span


def lightning_topk(
    scores: torch.Tensor,
    k: int,
    lengths: torch.Tensor | None = None,
    *,
    sorted: bool = False,
    block: int = 2048,
    ctas: int | None = None,
    num_warps: int = 4,
    hist_mask: bool | None = None,
    workspace: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-``k`` of each row of ``scores`` ``(B, N)`` fp32 over its valid prefix ``lengths``
    ``(B,)`` (None: all ``N``). Returns ``(values, indices, counts)`` as
    `reference.topk_reference` does (index order; ``sorted=True``: value order). ``block``,
    ``ctas`` (CTAs per row) and ``num_warps`` are launch knobs (benchmark sweeps); ``hist_mask``
    forces the histogram variant (None: masked when this Triton supports it).

    ``workspace``: an int32 buffer from `topk_workspace` (all zeros), reused across calls: the
    kernels leave it zeroed again, which saves the memset launch of a fresh one. Calls sharing one
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
    c, span = _split(n, b, block, dev, ctas)
    if workspace is None:
        ws = torch.zeros((b, _WS_ROW), dtype=torch.int32, device=dev)
    elif workspace.dtype != torch.int32 or workspace.numel() < b * _WS_ROW:
        raise ValueError(f"workspace must be int32 with at least {b} x {_WS_ROW} entries")
    else:
        ws = workspace
    cta = torch.empty((b, c, _CTA_ROW), dtype=torch.int32, device=dev)
    has_len = lengths is not None
    lens = lengths.contiguous() if lengths is not None else counts
    grid = (c, b)
    common = dict(BLOCK=block, HAS_LEN=has_len, num_warps=num_warps)
    hist = dict(HIST_MASK=HIST_MASK if hist_mask is None else hist_mask, **common)
    args = (scores, lens, ws)
    stride = scores.stride(0)
    hn = n if n > k else 0  # the histogrammed length of every row when lengths is None
    _hist_kernel[grid](*args, n, hn, stride, span, k, c, PASS=1, **hist)
    _hist_kernel[grid](*args, n, hn, stride, span, k, c, PASS=2, **hist)
    _pass3_kernel[grid](*args, cta, n, hn, stride, span, k, c, **hist)
    cb = min(1024, triton.next_power_of_2(c))
    _scatter_kernel[grid](
        *args,
        cta,
        values,
        indices,
        counts,
        n,
        hn,
        stride,
        span,
        k,
        c,
        CB=cb,
        CLEAN=workspace is not None,
        **common,
    )
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
