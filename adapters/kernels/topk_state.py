"""Lightning TopK's memory besides its inputs and outputs: the per-row workspace (its layout of
int32 words, all zero between calls; a zeroed buffer per call or, on CUDA, one kept per stream)
and the optional per-CTA phase trace (its buffer, and the device stamps the kernels write)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
