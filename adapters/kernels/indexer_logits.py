"""The epilogues of the fused indexer (`indexer`): a tile's products ``q . k`` become logits
``sum_h w_h relu(s k_scale)`` of the tile's queries, -inf past each query's length, stored
into the output rows. Triton device functions only.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rows_out(s, sc, wv, g, lens, e_hi, n_ok, out_row, BQ: tl.constexpr, HP: tl.constexpr,
              HAS_SCALE: tl.constexpr):  # fmt: skip
    """Stores the logits of products ``s`` ``(BLOCK_E, BQ*HP)`` (keys on rows)."""
    if HAS_SCALE:
        s = s * sc[:, None]
    s = tl.maximum(s, 0.0) * wv[None, :]
    logit = tl.sum(tl.reshape(s, (s.shape[0], BQ, HP)), axis=2)  # (BLOCK_E, BQ)
    logit = tl.where(g[:, None] < lens[None, :], logit, float("-inf"))
    tl.store(out_row[None, :] + g[:, None], logit, mask=(g < e_hi)[:, None] & n_ok[None, :])


@triton.jit
def _cols_out(s, sc, wv, g, lens, e_hi, n_ok, out_row, BQ: tl.constexpr, HP: tl.constexpr,
              HAS_SCALE: tl.constexpr):  # fmt: skip
    """Stores the logits of products ``s`` ``(BQ*HP, BLOCK_E)`` (keys on columns)."""
    if HAS_SCALE:
        s = s * sc[None, :]
    s = tl.maximum(s, 0.0) * wv[:, None]
    logit = tl.sum(tl.reshape(s, (BQ, HP, s.shape[1])), axis=1)  # (BQ, BLOCK_E)
    logit = tl.where(g[None, :] < lens[:, None], logit, float("-inf"))
    tl.store(out_row[:, None] + g[None, :], logit, mask=(g < e_hi)[None, :] & n_ok[:, None])
