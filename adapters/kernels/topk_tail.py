"""Lightning TopK's exact finish within a row's candidate list (the select kernel's last CTA,
the bound algorithm's finishing CTA): digit refinement to the threshold key, ranked or
by-index picks among its ties, and the row's padding, count and state reset."""

from __future__ import annotations

import triton
import triton.language as tl

from .topk_radix import _histogram, _keys, _select_bin
from .topk_state import NB, WS_ROW


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
