"""``sorted=True`` for Lightning TopK: one program per row reorders its results by value
descending, ties by index ascending (a bitonic sort of 64-bit keys); `sort_topk` on its own."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import KernelLaunch, PlanCache, aligned
from .topk_radix import _keys


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


_SORTS: PlanCache[KernelLaunch] = PlanCache()


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
