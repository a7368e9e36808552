"""HiSparse graph decode's gather: each selected entry from the device buffer when its page is
resident, else zero-copy from the pinned host mirror (`adapters.memory.residency`).

One program per entry row: the row's ``hit`` flag masks the two loads, so a resident entry reads
the buffer only and a missing one the mirror only (a masked load issues no memory traffic: the
bus carries the misses, nothing else). Torch's ``torch.where`` of two gathers would read both.
Reference: `adapters.memory.residency.gather_reference` (tested equal under the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_kernel(buf, mirror, brow, mrow, hit, out, D: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    b = tl.load(brow + r)
    m = tl.load(mrow + r)
    cols = tl.arange(0, BLOCK_D)
    inside = cols < D
    h = (tl.zeros([BLOCK_D], dtype=tl.int8) + tl.load(hit + r)) != 0  # the row's flag, per column
    vb = tl.load(buf + b * D + cols, mask=inside & h, other=0.0)
    vm = tl.load(mirror + m * D + cols, mask=inside & (h == 0), other=0.0)
    tl.store(out + r * D + cols, tl.where(h, vb, vm), mask=inside)


def gather_split(
    buf: torch.Tensor, mirror: torch.Tensor, brow: torch.Tensor, mrow: torch.Tensor,
    hit: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """``out[r] = buf[brow[r]] if hit[r] else mirror[mrow[r]]`` for flat ``(R,)`` indices;
    ``buf`` and ``mirror``: ``(rows, D)`` contiguous, one dtype. Returns ``(R, D)``."""
    rows, d = brow.shape[0], buf.shape[1]
    out = torch.empty((rows, d), dtype=buf.dtype, device=buf.device)
    if rows:
        block = triton.next_power_of_2(d)
        _gather_kernel[(rows,)](
            buf, mirror, brow, mrow, hit.to(torch.int8), out, D=d, BLOCK_D=block
        )
    return out
