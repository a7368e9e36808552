"""mHC (manifold hyper-connection) kernels: the residual-stream merge and the Sinkhorn mixing.

Maths: `adapters.model.ops.hc_merge_reference` and `adapters.model.ops.sinkhorn_reference`, which
define the
results (fp64 and CPU tensors always run them).

* `flash_hc_merge`: ``out[n, s] = sum_t res[n, s, t] * streams[n, t] + post[n, s] * y[n]``. One
  program per (token, block of channels) loads the token's ``S`` stream tiles once, accumulates
  in fp32 and rounds once to the streams' dtype. The torch reference runs it as a batched
  ``S x S`` by ``S x D`` matmul, which cuBLAS serves with a slow generic kernel (2.5 ms for an
  8K-token chunk on the H200, against the ~0.15 ms its bytes take): a sixth of a prefill step.
* `flash_sinkhorn`: ``iters`` row/column normalisations of ``exp(logits - max)`` per token, in
  registers (``S x S`` = 16 values per token): one launch instead of ``4 + 4 * iters`` small
  ones per call, eight calls per layer pair of a decode step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_kernel(
    s_ptr, y_ptr, post_ptr, res_ptr, out_ptr, D, stride_sn, stride_ss, stride_yn, stride_on,
    stride_os, S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # 1-D rows only: a (S, BLOCK_D) tile summed over S would reduce across warps. Each stream
    # row is read S times, from L1 after the first.
    n = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = d < D
    y = tl.load(y_ptr + n * stride_yn + d, mask=ok, other=0.0).to(tl.float32)
    for s in tl.static_range(S):
        acc = tl.load(post_ptr + n * S + s).to(tl.float32) * y
        for t in tl.static_range(S):
            r = tl.load(res_ptr + (n * S + s) * S + t).to(tl.float32)
            x = tl.load(s_ptr + n * stride_sn + t * stride_ss + d, mask=ok, other=0.0)
            acc += r * x.to(tl.float32)
        tl.store(out_ptr + n * stride_on + s * stride_os + d,
                 acc.to(out_ptr.dtype.element_ty), mask=ok)  # fmt: skip


@triton.jit
def _sinkhorn_kernel(x_ptr, out_ptr, N, iters, S: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    i = tl.arange(0, S)
    offs = rows[:, None, None] * (S * S) + i[None, :, None] * S + i[None, None, :]
    ok = offs < N * S * S
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    top = tl.max(tl.max(x, axis=2), axis=1)
    m = tl.exp(x - top[:, None, None])
    for _ in range(iters):
        m = m / tl.sum(m, axis=2)[:, :, None]
        m = m / tl.sum(m, axis=1)[:, None, :]
    tl.store(out_ptr + offs, m.to(out_ptr.dtype.element_ty), mask=ok)


def _check(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, res: torch.Tensor):
    n, s, d = streams.shape
    if y.shape != (n, d) or post.shape != (n, s) or res.shape != (n, s, s):
        raise ValueError(
            f"hc_merge shapes: streams {tuple(streams.shape)}, y {tuple(y.shape)}, post "
            f"{tuple(post.shape)}, res {tuple(res.shape)}"
        )
    if s & (s - 1):
        raise ValueError(f"the kernels need a power-of-two stream count, not {s}")


def flash_hc_merge(
    streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, res: torch.Tensor,
    *, block_d: int = 1024, num_warps: int = 4,
) -> torch.Tensor:  # fmt: skip
    """New residual streams ``(N, S, D)`` (see the module doc); the streams' dtype."""
    _check(streams, y, post, res)
    n, s, d = streams.shape
    streams = streams if streams.stride(-1) == 1 else streams.contiguous()
    y = y if y.stride(-1) == 1 else y.contiguous()
    post, res = post.contiguous(), res.contiguous()
    out = torch.empty((n, s, d), dtype=streams.dtype, device=streams.device)
    if n:
        grid = (n, triton.cdiv(d, block_d))
        _merge_kernel[grid](
            streams, y, post, res, out, d, streams.stride(0), streams.stride(1), y.stride(0),
            out.stride(0), out.stride(1), S=s, BLOCK_D=block_d, num_warps=num_warps,
        )  # fmt: skip
    return out


def flash_sinkhorn(logits: torch.Tensor, iters: int, *, block_n: int = 64) -> torch.Tensor:
    """Doubly-stochastic ``(N, S, S)`` matrices from ``logits`` (its dtype)."""
    n, s, s2 = logits.shape
    if s != s2 or s & (s - 1):
        raise ValueError(f"sinkhorn needs square power-of-two matrices, not {s}x{s2}")
    x = logits.contiguous()
    out = torch.empty_like(x)
    if n:
        _sinkhorn_kernel[(triton.cdiv(n, block_n),)](x, out, n, iters, S=s, BLOCK_N=block_n,
                                                    num_warps=4)  # fmt: skip
    return out
