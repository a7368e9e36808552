"""Lightning TopK's radix primitives, shared by every kernel: order-preserving uint32 keys of
fp32 scores, masked digit histograms, a row's valid extent and load bound, and the bin that
holds the k-th largest key of a histogram."""

from __future__ import annotations

import inspect

import triton
import triton.language as tl

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
