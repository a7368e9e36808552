"""The PyTorch reference of the sparse attention kernel (`adapters.kernels.sparse_attention`).

One query attends over two key sets read from their pools in place, plus a learned sink:

* the window: ``window_kv[window_slots[n, j]]`` where ``window_mask[n, j]`` (any mask); an FP8
  window pool (``float8_e4m3fn``, `adapters.memory.formats`) comes with ``window_scale`` ``(S1,)``,
  one fp32 scale per pool row: its rows are ``fp8 * scale`` in the compute dtype;
* the extra rows (C4's selected entries, or every visible C128 entry): a `PoolRows` over
  ``extra_kv``, rows ``[0, lengths[n])``.

The latent is both key and value (DeepSeek-V4's shared KV)::

    logit = scale * q[n, h] . k        p = exp(logit - m) / (sum exp(logit - m) + exp(sink_h - m))
    out[n, h] = sum_k p * k

fp64 computes in fp64, everything else in fp32; the output has ``q``'s dtype. The reference
gathers the keys of a tile of queries at a time and runs the model's `sink.sink_attention` on
``cat(window, extra)``, so its memory is bounded by the tile and its arithmetic is the one every
forward of the model used before (bit for bit in fp64).
"""

from __future__ import annotations

import torch

from adapters.model.sink import acc_dtype, sink_attention

from .rows import PoolRows

FP8_WINDOW_DTYPES = (torch.float8_e4m3fn,)


def check_window_scale(window_kv: torch.Tensor, window_scale: torch.Tensor | None) -> None:
    """Raises `ValueError` unless an FP8 ``window_kv`` ``(S1, d)`` has an fp32 ``window_scale``
    ``(S1,)`` and any other window has none."""
    if window_kv.dtype not in FP8_WINDOW_DTYPES:
        if window_scale is not None:
            raise ValueError(f"window_scale goes with an FP8 window_kv, not {window_kv.dtype}")
        return
    rows = tuple(window_kv.shape[:1])
    if window_scale is None or window_scale.dtype != torch.float32 or window_scale.shape != rows:
        raise ValueError(f"an FP8 window_kv needs window_scale: fp32 {rows}, one per pool row")


def _window_keys(window_kv, window_scale, slots, dt) -> torch.Tensor:
    """The window rows of ``slots``: FP8 ones dequantised in ``dt``, others as stored."""
    if window_scale is None:
        return window_kv[slots]
    return window_kv[slots].to(dt) * window_scale[slots].to(dt)[..., None]


def sparse_attention_reference(
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
    tile_bytes: int = 1 << 28,
) -> torch.Tensor:
    """``(N, H, d)`` attention of ``q`` over its window and extra rows (module docstring).
    Raises `ValueError` for a lone ``extra_kv`` or ``extra`` and for a ``window_scale`` that
    does not fit ``window_kv`` (`check_window_scale`)."""
    if (extra_kv is None) != (extra is None):
        raise ValueError("extra_kv and extra go together")
    check_window_scale(window_kv, window_scale)
    n, _, d = q.shape
    width = window_slots.shape[1] + (extra.num_rows if extra is not None else 0)
    dt = acc_dtype(q)
    elem = dt.itemsize
    step = max(1, tile_bytes // max(1, width * d * elem))
    out = torch.empty_like(q)
    for a in range(0, n, step):
        b = min(n, a + step)
        keys = _window_keys(window_kv, window_scale, window_slots[a:b], dt)
        mask = window_mask[a:b]
        if extra is not None and extra_kv is not None:
            part = extra.select(slice(a, b))
            keys = torch.cat((keys, extra_kv[part.slots()]), dim=1)
            mask = torch.cat((mask, part.mask()), dim=1)
        out[a:b] = sink_attention(q[a:b], keys, mask, sink, scale)
    return out
