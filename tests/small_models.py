"""Model shapes the end-to-end test files share: the ``tiny`` preset shrunk so that fp64 CPU
forwards take milliseconds."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch

from adapters.model.model_config import ModelConfig, preset
from adapters.model.reference import reference_logits
from adapters.model.weights import ModelWeights, init_weights

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


def one_thread() -> Iterator[None]:
    """A module's torch CPU threads set to 1 and restored (fp64 forwards of these tiny models
    are faster on one thread, and the suite runs on two cores). Use as
    ``_one_thread = pytest.fixture(autouse=True, scope="module")(one_thread)``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.cache
def fp64_weights(cfg: ModelConfig) -> ModelWeights:
    """``cfg``'s seeded weights in fp64 on the CPU, built once per config."""
    return init_weights(cfg, "cpu", torch.float64)


@functools.cache
def fp64_reference(cfg: ModelConfig, tokens: tuple[int, ...]) -> torch.Tensor:
    """The dense reference's logits of ``tokens`` under `fp64_weights`, computed once."""
    return reference_logits(fp64_weights(cfg), list(tokens))
