"""Frozen shape of the embedded DeepSeek-V4-style model, with the presets the runner ships."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from shadowradix import CacheConfig

VOCAB_SIZE = 258  # 256 UTF-8 bytes + BOS + EOS


@dataclass(frozen=True)
class ModelConfig:
    """Structure of the embedded model (DESIGN.md §1), every size in elements.

    ``compress_ratios[i]`` picks layer ``i``'s compressed stream: 0 = SWA only, 4 = C4
    (overlapped, sparse top-k through the indexer), anything else = dense compressed attention.
    One latent of ``head_dim`` values (the last ``rope_dim`` rotated) is both K and V.
    """

    name: str = "tiny"
    vocab_size: int = VOCAB_SIZE
    hidden: int = 256
    compress_ratios: tuple[int, ...] = (0, 0, 4, 128, 4, 128)
    num_heads: int = 4
    head_dim: int = 64
    rope_dim: int = 16
    window: int = 128
    index_heads: int = 4
    index_dim: int = 32
    index_topk: int = 32
    mlp_hidden: int = 512
    hc_streams: int = 4
    sinkhorn_iters: int = 12
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6
    overlap_ratios: tuple[int, ...] = field(default=(4,))
    seed: int = 0
    #: one extra SWA-only MTP layer for speculative drafts (weights from their own generator,
    #: so the main model's weights are the same with or without it); see docs/speculative.md
    mtp: bool = True

    def __post_init__(self) -> None:
        if self.head_dim % 2 or self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            raise ValueError("head_dim and rope_dim must be even with 0 < rope_dim <= head_dim")
        if self.index_dim % 2 or self.index_dim < self.rope_dim:
            raise ValueError("index_dim must be even and >= rope_dim")
        if min(self.hidden, self.num_heads, self.index_heads, self.index_topk, self.window) < 1:
            raise ValueError("sizes must be positive")
        if any(r < 0 or (r and r & (r - 1)) for r in self.compress_ratios):
            raise ValueError("compress ratios must be 0 or powers of two")

    @property
    def num_layers(self) -> int:
        return len(self.compress_ratios)

    @property
    def ratios(self) -> tuple[int, ...]:
        """Distinct compressed ratios, ascending (the cache's streams)."""
        return tuple(sorted({r for r in self.compress_ratios if r}))

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def is_overlap(self, ratio: int) -> bool:
        return ratio in self.overlap_ratios

    def is_sparse(self, ratio: int) -> bool:
        """C4 layers select top-k entries through the indexer; other ratios attend densely."""
        return ratio == 4

    def cache_config(self, **kwargs: object) -> CacheConfig:
        """A `CacheConfig` whose window and streams match this model."""
        return CacheConfig(
            window=self.window,
            compress_ratios=self.compress_ratios,
            overlap_ratios=tuple(r for r in self.overlap_ratios if r in self.ratios),
            **kwargs,  # type: ignore[arg-type]
        )


TINY = ModelConfig()

#: The real attention dimensions of DeepSeek-V4-Flash with few layers (for GPU benchmarks).
FLASH_SHAPED = ModelConfig(
    name="flash-shaped",
    hidden=4096,
    compress_ratios=(0, 4, 128, 4),
    num_heads=64,
    head_dim=512,
    rope_dim=64,
    window=128,
    index_heads=64,
    index_dim=128,
    index_topk=512,
    mlp_hidden=4096,
)

PRESETS = {"tiny": TINY, "flash-shaped": FLASH_SHAPED}


def preset(name: str, **overrides: object) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)  # type: ignore[arg-type]
