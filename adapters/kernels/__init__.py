"""Fused GPU kernels of the model's hot spots, with PyTorch fallbacks.

* `compress` / `compress_gathered`: the Flash Compressor (group softmax pooling of the
  compressor's per-token rows, optional RMSNorm + RoPE epilogue), prefill and decode layouts.
* `topk`: Lightning TopK (exact radix-select top-k, ties to the lowest index).
* `index_logits`: the fused Lightning indexer (``sum_h w_h relu(q_h . k)`` over pool rows read
  in place through a `PoolRows` table, no ``(N, H, G)`` intermediate).
* `sparse_attention`: one attention over a query's window, its extra rows (C4 selection or every
  C128 entry, through a `PoolRows` table) and the sink.
* `quantize.fp8_store`: FP8 (e4m3) pool rows quantised and stored in one launch (``pools.store``
  on CUDA, `QUANTIZE_KERNEL`).

CUDA tensors go to the Triton kernels (`.compressor`, `.topk_lightning`, ...) when Triton is
installed; anything else goes to the PyTorch references (`.reference`), which define the
results. Triton is imported only on the first CUDA call, so importing this package never needs
it (and a test may still set ``TRITON_INTERPRET=1`` before Triton's first import).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from .attention_reference import sparse_attention_reference
from .indexer_reference import FP8_DTYPES, index_logits_reference
from .reference import (
    compress_gathered_reference,
    compress_reference,
    naive_torch_chain,
    topk_reference,
)
from .rows import PoolRows

__all__ = [
    "TRITON_AVAILABLE",
    "PoolRows",
    "index_logits",
    "index_logits_reference",
    "sparse_attention",
    "sparse_attention_reference",
    "compress",
    "compress_gathered",
    "compress_gathered_reference",
    "compress_reference",
    "naive_torch_chain",
    "topk",
    "topk_reference",
    "use_triton",
]

TRITON_AVAILABLE: bool = importlib.util.find_spec("triton") is not None

#: Route `index_logits` / `sparse_attention` on CUDA to the Triton kernels; benchmarks set it to
#: False to time the tiled torch references (gathered keys) in the same process.
SPARSE_KERNELS = True

#: Route the mHC merge and Sinkhorn (`adapters.model.ops.hc_merge`, `adapters.model.ops.sinkhorn`)
#: on CUDA
#: to `kernels.hc`; ``ADAPTERS_HC_KERNELS=0`` (or False at run time) keeps the torch references.
HC_KERNELS = os.environ.get("ADAPTERS_HC_KERNELS", "1") != "0"

#: Route RoPE and RMSNorm (`adapters.model.ops.rope`, `adapters.model.ops.rms_norm`) on CUDA to
#: `kernels.rope`; ``ADAPTERS_ROPE_KERNELS=0`` (or False at run time) keeps the torch chains.
ROPE_KERNELS = os.environ.get("ADAPTERS_ROPE_KERNELS", "1") != "0"

#: Store FP8 pool rows on CUDA with the fused quantiser (`kernels.quantize.fp8_store`);
#: False keeps `formats.write_rows`' torch chain (the same bytes: benchmarks time both).
QUANTIZE_KERNEL = True


def use_triton(t: torch.Tensor) -> bool:
    """Whether `t`'s work goes to the Triton kernels: a CUDA tensor with Triton installed."""
    return TRITON_AVAILABLE and t.is_cuda


def compress(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor | None,
    ratio: int,
    overlap: bool,
    *,
    norm: torch.Tensor | None = None,
    rope_dim: int = 0,
    theta: float = 10000.0,
    eps: float = 1e-6,
    group_offset: int = 0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Compressed entries ``(T // ratio, d)`` of contiguous token rows ``kv``/``score``
    ``(T, c*d)`` with the bias ``ape`` ``(ratio, c*d)`` (None: already in ``score``); with
    ``norm``, RMSNorm + RoPE (last ``rope_dim`` channels, position ``(group_offset+g)*ratio``).
    See `reference.compress_reference`."""
    fn = compress_reference
    if use_triton(kv):  # pragma: no cover - needs a GPU
        from .compressor import flash_compress as fn
    return fn(
        kv, score, ape, ratio, overlap, norm=norm, rope_dim=rope_dim, theta=theta, eps=eps,
        group_offset=group_offset, out_dtype=out_dtype,
    )  # fmt: skip


def compress_gathered(
    ring: torch.Tensor,
    rows: torch.Tensor,
    ratio: int,
    overlap: bool,
    *,
    pad: torch.Tensor | None = None,
    ape: torch.Tensor | None = None,
    groups: torch.Tensor | None = None,
    norm: torch.Tensor | None = None,
    rope_dim: int = 0,
    theta: float = 10000.0,
    eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One entry per request from ring rows (the decode layout); see
    `reference.compress_gathered_reference`."""
    fn = compress_gathered_reference
    if use_triton(ring):  # pragma: no cover - needs a GPU
        from .compressor import flash_compress_gathered as fn
    return fn(
        ring, rows, ratio, overlap, pad=pad, ape=ape, groups=groups, norm=norm,
        rope_dim=rope_dim, theta=theta, eps=eps, out_dtype=out_dtype,
    )  # fmt: skip


def topk(
    scores: torch.Tensor, k: int, lengths: torch.Tensor | None = None, *, sorted: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(values, indices, counts)``: exact top-``k`` of each row's valid prefix, ties to the
    lowest index, padding index 0 / value -inf past ``counts``; value order with ``sorted``,
    else a deterministic order that is the implementation's (the reference's: by index; Lightning
    TopK's: see `topk.lightning_topk`). See `reference.topk_reference`."""
    if use_triton(scores):  # pragma: no cover - needs a GPU
        from .topk_lightning import lightning_topk

        return lightning_topk(scores, k, lengths, sorted=sorted)
    return topk_reference(scores, k, lengths, sorted=sorted)


def index_logits(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: torch.Tensor,
    rows: PoolRows,
    *,
    key_scale: torch.Tensor | None = None,
    fp8_q: bool = False,
) -> torch.Tensor:
    """``(N, G)`` indexer logits of ``q`` ``(N, H, d)`` (head weights ``w`` ``(N, H)``) over
    the pool ``keys`` read through ``rows``, -inf past each query's length; see
    `indexer_reference.index_logits_reference`. FP8 keys (``key_scale`` ``(S,)``) and FP4
    keys (V4.1, packed uint8 with block scales ``(S, d // 32)``) go to the kernel on CUDA.
    ``fp8_q`` (FP8 keys only) rounds q to e4m3 first, as V4's FP8 indexer does
    (`indexer_reference.round_q_e4m3`; on CUDA the kernel's one fp8 dot, ``Fp8Mode.FP8_Q``).
    Not the runner's default: on the H200 it is faster than 16-bit q for decode without shared
    rows (19 against 23 µs at 1 x 262,144 rows) but slower where the key tiles are shared (the
    shared-prefix decode, prefill): docs/benchmarks.md. Raises `ValueError` for ``fp8_q``
    with other keys."""
    if fp8_q and keys.dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_q rounds q for FP8 keys (the FP8 indexer), not {keys.dtype} ones")
    kernel = SPARSE_KERNELS and q.dtype != torch.float64
    if kernel and use_triton(q):  # pragma: no cover - needs a GPU
        from .indexer import flash_index_logits
        from .indexer_plan import Fp8Mode

        if fp8_q:
            return flash_index_logits(q, w, keys, rows, key_scale=key_scale, fp8_mode=Fp8Mode.FP8_Q)
        return flash_index_logits(q, w, keys, rows, key_scale=key_scale)
    return index_logits_reference(q, w, keys, rows, key_scale=key_scale, fp8_q=fp8_q)


def sparse_attention(
    q: torch.Tensor,
    window_kv: torch.Tensor,
    window_slots: torch.Tensor,
    window_mask: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    extra_kv: torch.Tensor | None = None,
    extra: PoolRows | None = None,
    *,
    window_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(N, H, d)`` attention of ``q`` over its window rows, its ``extra`` rows and the sink,
    keys read in place from their pools (an FP8 window pool with ``window_scale``, one fp32
    scale per pool row); see `attention_reference.sparse_attention_reference`."""
    if SPARSE_KERNELS and use_triton(q) and q.dtype != torch.float64:  # pragma: no cover
        from .attention import flash_sparse_attention

        return flash_sparse_attention(
            q, window_kv, window_slots, window_mask, sink, scale, extra_kv, extra,
            window_scale=window_scale,
        )  # fmt: skip
    return sparse_attention_reference(
        q, window_kv, window_slots, window_mask, sink, scale, extra_kv, extra,
        window_scale=window_scale,
    )  # fmt: skip
