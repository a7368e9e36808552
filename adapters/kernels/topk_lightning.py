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
`topk_state`, so no memset per call). Two algorithms; ``algorithm="auto"`` takes the first for
fewer than `AUTO_BOUND_ROWS` rows (least latency), the second from there (most throughput).

**histogram** (three launches, `topk_histogram`): two passes histogram the keys' top 16 bits,
8 bits each, into the row's two histograms; a third writes the keys above the threshold bin
straight to the output and those in it to a bin list, from which the row's last CTA takes the
few it still needs (`topk_tail`). Output order: by index within each of the two parts.

**bound** (three launches, `topk_bound`): the maxima of about ``2k`` interleaved columns of the
row give a lower bound that every top-``k`` entry passes (about ``1.4 k`` entries do for
unordered scores); one pass gathers those candidates, one CTA per row selects exactly among
them (`topk_tail`). Output order: by index.

Costs. The histogram algorithm reads the row three times with two 256-bin histograms, which
are compute-bound at large batch (``tl.histogram`` is ~100 instructions per 32 keys); its
serial part is one short tail. The bound algorithm's passes are a max and a compare, but its
finishing CTA refines over ~1.4k candidates. When many entries tie at or near the threshold,
or the top entries repeat with a period dividing ``M``, more entries pass the bound and the
finishing CTA does more (exact, slower); a tie class at the threshold is taken by index with
no refining. `bench/kernels.py` times both on such inputs; `bench/topk_profile.py` traces every
CTA's phases (``trace=``).

Modules: `topk_state` (the workspace and phase-trace buffers), `topk_radix` (keys, digit
histograms, bin selection), `topk_pdl` (programmatic dependent launch), `topk_tail` (the exact
finish within a candidate list), `topk_histogram` and `topk_bound` (the kernels), `topk_sort`
(``sorted=True``). This module is the entry point (`lightning_topk`) and plans its launches
(`_plan`, kept per shape in `_PLANS`); it re-exports the kernels and buffers that tests and
benchmarks reach through it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from .launch import KernelLaunch, PlanCache, aligned
from .topk_bound import _colmax_kernel, _finish_kernel, _gather_kernel
from .topk_histogram import _hist1_kernel, _hist2_kernel, _select_kernel
from .topk_pdl import _use_pdl
from .topk_radix import HIST_MASK
from .topk_sort import _SORTS, _sort_kernel, _sort_launch, sort_topk  # noqa: F401 (re-exported)
from .topk_state import (  # noqa: F401 (_STREAM_WORKSPACES: re-exported)
    _MAX_CTAS,
    _NB,
    _STREAM_WORKSPACES,
    _WS_ROW,
    _forget_workspace,
    _stream_workspace,
    topk_trace,
    topk_workspace,
)

__all__ = ["lightning_topk", "sort_topk", "topk_trace", "topk_workspace"]


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
