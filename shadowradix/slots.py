"""Slot arithmetic, once: every formula from a position and a page-table entry to a pool slot.

The core (NumPy, over a step's tokens), the graph decode and verify metadata (torch, on the
device, inside a CUDA graph) and the oracle all call these functions; none writes a formula of
its own. Arguments are Python ints, NumPy int64 arrays or torch int64 tensors, mixed freely with
ints; only ``xp``-taking functions need the namespace (``numpy`` or ``torch``), for ``where``::

    virtual slot / SWA slot   page_slot(page, pos, P)        = page*P + pos % P
    ring row (C_r)            ring_row(swa_page, pos, ring)  = swa_page*ring_len + pos % ring_len
    entry slot (C_r)          compressed_slot(vpage(e), e)   = vpage(e)*spp + (e % P) // r
                              for the group ending at e = (g + 1) * r - 1 (group_end)
    group completing at pos   completes_group(pos, r): (pos + 1) % r == 0; group_of(pos, r)
                              (ends_page(pos, P): the same for a page)
    its rows                  [group_first(g, r, overlap), group_end(g, r)]
    in-flight rows at length  [first_inflight(L, r, overlap), L)
    visible entries at pos    visible_entries(pos, r) = (pos + 1) // r
    window at length L        [window_first(L, W), L): the query at pos sees the window at pos+1;
                              its pages from window_first_page(L, W, P), window_num_pages of
                              them before L's page
    window a request holds    from held_window_first_page(C, W, P) once C tokens are computed:
                              the window before the page boundary page_start(C, P)
    pages of L tokens         num_pages(L, P) = ceil(L / P); a node's tail window tier: the last
                              tail_window_pages(W, P) = num_pages(W, P) pages

Preconditions, because NumPy and torch share exactly these semantics only there:

- positions, pages and groups are non-negative integers (int64 arrays / tensors or ints);
  functions whose result can be negative say so and never clamp unless they take ``xp``;
- ``page_size``, ``ratio`` and ``ring_len`` are powers of two (`CacheConfig` validates it), so
  ``// n`` and ``% n`` are ``>> log2 n`` and ``& (n - 1)``: the same in both namespaces, cheaper
  than division, and exact. ``ratio`` / ``ring_len`` may be int64 columns (one row per stream)
  where only a mask is taken (`ring_row`, `completes_group`);
- no float ever enters: true division or a float scalar would promote differently in NumPy and
  torch. ``xp.where(cond, array, int)`` keeps int64 in both (NumPy 2's NEP 50 and torch's
  scalar rules agree for an int scalar against an int64 array).

Nothing here allocates a range (``arange`` differs across namespaces: device, dtype); callers
pass positions in. Everything is elementwise, so every torch call is capturable.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

#: an int, a NumPy int64 array or a torch int64 tensor (what goes in comes out)
Ints = Any


def log2(n: int) -> int:
    """``log2`` of a power of two."""
    return n.bit_length() - 1


def page_of(pos: Ints, page_size: int) -> Ints:
    """The page holding ``pos`` (``pos // P``)."""
    return pos >> log2(page_size)


def page_start(pos: Ints, page_size: int) -> Ints:
    """The first position of ``pos``'s page: the last page boundary at or before ``pos``
    (``pos // P * P``)."""
    return page_of(pos, page_size) << log2(page_size)


def num_pages(length: Ints, page_size: int) -> Ints:
    """Pages holding positions ``[0, length)``: ``ceil(length / P)``."""
    return (length + page_size - 1) >> log2(page_size)


def page_slot(page: Ints, pos: Ints, page_size: int) -> Ints:
    """The slot of ``pos`` in its page ``page``: a virtual slot (``page`` a virtual page) or an
    SWA slot (``page`` an SWA page)."""
    return page * page_size + (pos & (page_size - 1))


def ring_row(swa_page: Ints, pos: Ints, ring_len: Ints) -> Ints:
    """The in-flight ring row of ``pos`` in the SWA page holding it (``ring_len``: an int or an
    int64 column of one per stream)."""
    return swa_page * ring_len + (pos & (ring_len - 1))


def compressed_slot(
    vpage: Ints, end: Ints, page_size: int, ratio: int, slots_per_page: int
) -> Ints:
    """The entry slot of the group whose last token is ``end`` (``vpage``: the virtual page
    holding ``end``). ``P >= r``: ``P // r`` groups end in a page; ``P < r``: at most one, and
    ``(end % P) // r`` is 0."""
    offset = (end & (page_size - 1)) >> log2(ratio)
    return vpage * slots_per_page + offset


def completes_group(pos: Ints, ratio: Ints) -> Ints:
    """Whether ``pos`` is the last token of a group (``ratio``: an int or an int64 column)."""
    return ((pos + 1) & (ratio - 1)) == 0


def ends_page(pos: Ints, page_size: int) -> Ints:
    """Whether ``pos`` is the last position of its page (a page is a group of ``P``)."""
    return completes_group(pos, page_size)


def group_of(pos: Ints, ratio: int) -> Ints:
    """The group ending at ``pos`` when `completes_group`; in general the last group complete
    at ``pos`` (``-1`` before the first)."""
    return ((pos + 1) >> log2(ratio)) - 1


def group_end(group: Ints, ratio: int) -> Ints:
    """The last token of ``group``."""
    return (group + 1) * ratio - 1


def group_first(group: Ints, ratio: int, overlap: bool) -> Ints:
    """The first in-flight row ``group`` pools: its own first token, or with the overlap
    transform the previous group's (negative for group 0: those rows are padding)."""
    return group * ratio - (ratio if overlap else 0)


def visible_entries(pos: Ints, ratio: int) -> Ints:
    """Complete entries a query at ``pos`` sees (its own group's included when it completes
    one): ``(pos + 1) // r``."""
    return (pos + 1) >> log2(ratio)


def first_inflight(length: Ints, ratio: int, overlap: bool, xp: ModuleType | None = None) -> Ints:
    """The first position whose in-flight row the compressor still needs at ``length`` (the
    rows of the group in progress, and the previous group's with overlap), clamped at 0.
    ``xp`` for arrays; ints need none."""
    start = group_first(length >> log2(ratio), ratio, overlap)
    return clamp_low(start, xp)


def window_first(length: Ints, window: int) -> Ints:
    """The first position of the window at ``length``: ``[length - W, length)``, negative when
    the window reaches before position 0. The query at ``pos`` attends to the window at
    ``pos + 1`` (itself included)."""
    return length - window


def window_first_page(
    length: Ints, window: int, page_size: int, xp: ModuleType | None = None
) -> Ints:
    """The first page of the window at ``length`` (page 0 when it reaches before position 0):
    the SWA pages a request or a match must hold from."""
    if xp is None:  # ints: the same, without the calls (the core's per-request hot path)
        first = length - window
        return first >> (page_size.bit_length() - 1) if first > 0 else 0
    return page_of(clamp_low(window_first(length, window), xp), page_size)


def window_num_pages(
    length: Ints, window: int, page_size: int, xp: ModuleType | None = None
) -> Ints:
    """Pages ``[window_first_page(L, W, P), page_of(L, P))``: at a page boundary ``L``, the
    pages of the window at ``L`` (those a replayed hit ending at ``L`` rebuilds)."""
    return page_of(length, page_size) - window_first_page(length, window, page_size, xp)


def held_window_first_page(
    computed_len: Ints, window: int, page_size: int, xp: ModuleType | None = None
) -> Ints:
    """The first SWA page a running request still holds once ``computed_len`` tokens are
    computed: the window before the last page boundary ``F = page_start(computed_len)``,
    ``[F - W, F)``, so that inserting the request later leaves a live window before ``F``."""
    return window_first_page(page_start(computed_len, page_size), window, page_size, xp)


def tail_window_pages(window: int, page_size: int) -> int:
    """Pages the last ``window`` tokens before a page boundary meet (a node's tail-window
    eviction tier): ``ceil(W / P)``."""
    return num_pages(window, page_size)


def clamp_low(x: Ints, xp: ModuleType | None = None, low: int = 0) -> Ints:
    """``max(x, low)`` elementwise: ``xp.where`` for arrays and tensors (``torch.maximum``
    refuses an int, ``torch.clamp`` does not exist in NumPy), Python ``max`` for ints."""
    if xp is None:
        return max(x, low)
    return xp.where(x > low, x, low)
