"""Model shapes the end-to-end test files share: the ``tiny`` preset shrunk so that fp64 CPU
forwards take milliseconds."""

from __future__ import annotations

from adapters.model.model_config import preset

SMALL = dict(
    hidden=64,
    num_heads=2,
    head_dim=32,
    rope_dim=8,
    index_dim=16,
    index_heads=2,
    index_topk=8,
    mlp_hidden=96,
)
#: window 128, ratios (0, 0, 4, 128, 4, 128): the tiny preset's structure
CFG = preset("tiny", **SMALL)
#: window 16, C4 (overlapped, sparse) + C16 (dense): short prompts cross many windows/groups
SHORT = preset("tiny", **SMALL, window=16, compress_ratios=(0, 4, 16, 4))
#: SHORT's window with V4.1 sharing: KV sources 1 (C4) and 2 (C16), index sources 1 and 5
SHORT_SHARED = preset(
    "tiny-shared", **{**SMALL, "window": 16, "compress_ratios": (0, 4, 16, 4, 16, 4, 0, 4)}
)
