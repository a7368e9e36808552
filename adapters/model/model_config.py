"""Frozen shape of the embedded DeepSeek-V4-style model, with the presets the runner ships."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum

from shadowradix import CacheConfig

VOCAB_SIZE = 258  # 256 UTF-8 bytes + BOS + EOS


class EngramPlacement(Enum):
    """Where the Engram tables live (docs/engram.md); the lookup's result is the same."""

    DEVICE = "device"  # on the GPU with the weights
    HOST = "host"  # one copy in (pinned) host memory: a CPU gather and one copy per step
    SHARDED = "sharded"  # rows r % world on rank r's host memory, partials all-reduced


def plain_fields(config: object) -> dict[str, object]:
    """A dataclass config's fields with every enum as its value (JSON-safe, and safe for
    ``torch.load(weights_only=True)``)."""
    fields = dataclasses.asdict(config)  # type: ignore[call-overload]
    return {k: v.value if isinstance(v, Enum) else v for k, v in fields.items()}


@dataclass(frozen=True)
class ModelConfig:
    """Structure of the embedded model (DESIGN.md §1), every size in elements.

    ``compress_ratios[i]`` picks layer ``i``'s compressed stream: 0 = SWA only, 4 = C4
    (overlapped, sparse top-k through the indexer), 2 = C2 (V4.1 pairwise: no overlap, sparse
    top-k through its own indexer over C2 keys), anything else = dense compressed attention.
    ``overlap_ratios`` / ``sparse_ratios`` name those roles (docs/design.md, "C2").
    One latent of ``head_dim`` values (the last ``rope_dim`` rotated) is both K and V.

    V4.1 cross-layer sharing (docs/sharing.md), both empty by default (no sharing):

    * ``kv_sources``: the compressed layers that compress (their KV, and for C4 the indexer
      keys). Every other compressed layer is a *consumer*: it reads the nearest preceding
      source of its ratio and has no compressor, pool or ring of its own. Empty: every
      compressed layer is its own source.
    * ``index_sources``: the C4 layers that run the indexer (their own queries against their
      KV source's indexer keys). Every other C4 layer reuses the top-k selection of the nearest
      preceding index source. Empty: every C4 layer runs the indexer. A C4 KV source must be an
      index source (the layer that writes indexer keys also scores with them). The same holds
      for C2 layers, with C2 sources: a selection is only ever reused within one ratio.

    Raises `ValueError` for bad sizes or ratios, and for sources that are not increasing layer
    indices of the right kind, or a consumer with no preceding source of its ratio.
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
    #: ratios whose layers attend to an indexer's top-k entries (the rest attend densely)
    sparse_ratios: tuple[int, ...] = field(default=(2, 4))
    seed: int = 0
    kv_sources: tuple[int, ...] = ()
    index_sources: tuple[int, ...] = ()
    #: one extra SWA-only MTP layer for speculative drafts (weights from their own generator,
    #: so the main model's weights are the same with or without it); see docs/speculative.md
    mtp: bool = True
    #: V4.1 two-level selection (docs/sharing.md, "Shared candidates"): this indexer layer also
    #: publishes up to ``candidate_blocks`` blocks of ``candidate_block`` entries per query, and
    #: later indexer layers of its ratio take their top-k among those; None: off
    candidate_source: int | None = None
    candidate_blocks: int = 2048
    candidate_block: int = 8
    #: V4.1 Engram memory (docs/engram.md): these layers add a gated lookup of the last
    #: ``engram_ngram`` tokens' hashed 2..n-grams (``engram_heads`` hashes per order) into a
    #: table of ``engram_rows`` fp8 rows of ``engram_dim`` channels (one table per layer)
    engram_layers: tuple[int, ...] = ()
    engram_rows: int = 0
    engram_dim: int = 32
    engram_ngram: int = 3
    engram_heads: int = 2
    engram_placement: EngramPlacement = EngramPlacement.DEVICE

    def __post_init__(self) -> None:
        if self.head_dim % 2 or self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            raise ValueError("head_dim and rope_dim must be even with 0 < rope_dim <= head_dim")
        if self.index_dim % 2 or self.index_dim < self.rope_dim:
            raise ValueError("index_dim must be even and >= rope_dim")
        if min(self.hidden, self.num_heads, self.index_heads, self.index_topk, self.window) < 1:
            raise ValueError("sizes must be positive")
        if any(r < 0 or (r and r & (r - 1)) for r in self.compress_ratios):
            raise ValueError("compress ratios must be 0 or powers of two")
        if any(r < 1 or r & (r - 1) for r in self.overlap_ratios + self.sparse_ratios):
            raise ValueError("overlap and sparse ratios must be powers of two")
        self._check_sources("kv_sources", self.kv_sources, lambda r: r > 0, "a compressed")
        self._check_sources("index_sources", self.index_sources, self.is_sparse, "a sparse")
        for layer, ratio in enumerate(self.compress_ratios):
            self._check_consumer(layer, ratio)
        self._check_candidates()
        self._check_engram()

    def _check_engram(self) -> None:
        if not self.engram_layers:
            return
        self._check_sources("engram_layers", self.engram_layers, lambda r: True, "a")
        if min(self.engram_rows, self.engram_dim, self.engram_heads) < 1:
            raise ValueError("an Engram model needs positive engram_rows, engram_dim, heads")
        if not 2 <= self.engram_ngram <= 8:
            raise ValueError(f"engram_ngram must be 2 to 8, got {self.engram_ngram}")
        if not isinstance(self.engram_placement, EngramPlacement):
            raise ValueError(f"engram_placement must be an EngramPlacement, "
                             f"got {self.engram_placement!r}")  # fmt: skip

    @property
    def engram_lookups(self) -> int:
        """Table rows one token reads per Engram layer: ``heads`` per n-gram order 2..n."""
        return (self.engram_ngram - 1) * self.engram_heads

    def _check_candidates(self) -> None:
        c = self.candidate_source
        for name in ("candidate_blocks", "candidate_block"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if c is None:
            return
        if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < self.num_layers:
            raise ValueError(f"candidate_source {c!r} is not a layer of this model")
        if not self.runs_indexer(c):
            raise ValueError(f"candidate_source: layer {c} does not run an indexer")

    def _check_sources(
        self, name: str, layers: tuple[int, ...], kind: Callable[[int], bool], what: str
    ) -> None:
        if not isinstance(layers, tuple) or any(
            not isinstance(i, int) or isinstance(i, bool) for i in layers
        ):
            raise ValueError(f"{name} must be a tuple of layer indices, got {layers!r}")
        if list(layers) != sorted(set(layers)):
            raise ValueError(f"{name} must be strictly increasing, got {layers!r}")
        for i in layers:
            if not 0 <= i < self.num_layers or not kind(self.compress_ratios[i]):
                raise ValueError(f"{name}: layer {i} is not {what} layer of this model")

    def _check_consumer(self, layer: int, ratio: int) -> None:
        if ratio and self.kv_sources and self._nearest(self.kv_sources, layer, ratio) is None:
            raise ValueError(
                f"layer {layer} (ratio {ratio}) reads shared compressed KV, but no KV-source "
                f"layer of ratio {ratio} precedes it (kv_sources={self.kv_sources})"
            )
        if not (ratio and self.is_sparse(ratio) and self.index_sources):
            return
        if self._nearest(self.index_sources, layer, ratio) is None:
            raise ValueError(
                f"C{ratio} layer {layer} reuses a top-k selection, but no index-source layer of "
                f"ratio {ratio} precedes it (index_sources={self.index_sources})"
            )
        if layer in self.kv_sources and layer not in self.index_sources:
            raise ValueError(
                f"C{ratio} KV-source layer {layer} writes indexer keys, so it must be an index "
                "source"
            )

    def _nearest(self, sources: tuple[int, ...], layer: int, ratio: int) -> int | None:
        """The last layer of ``sources`` at or before ``layer`` with ``ratio``."""
        found = [s for s in sources if s <= layer and self.compress_ratios[s] == ratio]
        return found[-1] if found else None

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
        """Layers of ``sparse_ratios`` (C4, C2) select top-k entries through an indexer; other
        ratios attend densely."""
        return ratio in self.sparse_ratios

    @property
    def shares_kv(self) -> bool:
        return bool(self.kv_sources)

    @property
    def kv_source_layers(self) -> tuple[int, ...]:
        """Layers that compress and own compressed pools (every compressed layer unshared)."""
        if self.kv_sources:
            return self.kv_sources
        return tuple(i for i, r in enumerate(self.compress_ratios) if r)

    def kv_source_of(self, layer: int) -> int:
        """The layer whose compressed KV (and C4 indexer keys) ``layer`` reads."""
        ratio = self.compress_ratios[layer]
        if not ratio:
            raise ValueError(f"layer {layer} is SWA-only: it reads no compressed KV")
        if not self.kv_sources:
            return layer
        found = self._nearest(self.kv_sources, layer, ratio)
        assert found is not None  # validated in __post_init__
        return found

    def runs_indexer(self, layer: int) -> bool:
        """Whether sparse ``layer`` scores with its own queries (else it reuses a selection)."""
        return self.is_sparse(self.compress_ratios[layer]) and (
            not self.index_sources or layer in self.index_sources
        )

    def index_source_of(self, layer: int) -> int:
        """The layer whose top-k selection sparse ``layer`` uses (itself if it runs the
        indexer): the nearest preceding index source of the same ratio."""
        ratio = self.compress_ratios[layer]
        if not self.is_sparse(ratio):
            raise ValueError(f"layer {layer} is not a C4 / C2 (sparse) layer: it selects nothing")
        if not self.index_sources:
            return layer
        found = self._nearest(self.index_sources, layer, ratio)
        assert found is not None  # validated in __post_init__
        return found

    @property
    def last_kv_source(self) -> int | None:
        """The last KV-source layer under sharing (``None`` without): tail-only prefill runs
        the layers after it over the last W tokens of each chunk only."""
        return self.kv_sources[-1] if self.kv_sources else None

    def restricts_to_candidates(self, layer: int) -> bool:
        """Whether indexer ``layer`` takes its top-k among the shared candidates: it comes
        after the candidate source and has its ratio."""
        c = self.candidate_source
        return (
            c is not None
            and layer > c
            and self.runs_indexer(layer)
            and self.compress_ratios[layer] == self.compress_ratios[c]
        )

    def unshared(self) -> ModelConfig:
        """The same model without cross-layer sharing (every layer compresses and selects; no
        shared candidates)."""
        return replace(
            self, name=f"{self.name}-unshared", kv_sources=(), index_sources=(),
            candidate_source=None,
        )  # fmt: skip

    def plain(self) -> dict[str, object]:
        """The fields as JSON / ``torch.load(weights_only=True)``-safe values (`plain_fields`):
        what weights files, checkpoints and logs record."""
        return plain_fields(self)

    def first_layers(self, n: int) -> ModelConfig:
        """The model cut to its first ``n`` layers (sources beyond the cut dropped). Raises
        `ValueError` unless ``1 <= n <= num_layers``."""
        if not 1 <= n <= self.num_layers:
            raise ValueError(f"{self.name} has {self.num_layers} layers: keep 1 to "
                             f"{self.num_layers}, not {n}")  # fmt: skip
        return replace(
            self,
            compress_ratios=self.compress_ratios[:n],
            kv_sources=tuple(i for i in self.kv_sources if i < n),
            index_sources=tuple(i for i in self.index_sources if i < n),
            candidate_source=None if (self.candidate_source or 0) >= n else self.candidate_source,
        )

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

#: V4.1-style sharing over 8 layers ``(0, 4, 128, 4, 128, 4, 0, 4)``: layers 1 (C4) and 2 (C128)
#: are the KV sources; C4 layers 1 and 5 run the indexer, 3 reuses 1's selection and 7 reuses
#: 5's. Layers 3-7 come after the last KV source (tail-only prefill skips them).
SHARED_LAYERS = dict(
    compress_ratios=(0, 4, 128, 4, 128, 4, 0, 4), kv_sources=(1, 2), index_sources=(1, 5)
)
TINY_SHARED = replace(TINY, name="tiny-shared", **SHARED_LAYERS)  # type: ignore[arg-type]
FLASH_SHARED = replace(FLASH_SHAPED, name="flash-shared", **SHARED_LAYERS)  # type: ignore[arg-type]

#: ``tiny``'s shape, with trained weights shipped in the package
#: (`adapters.model.weights_file.SHIPPED`,
#: docs/training.md); ``Runner`` alone still draws random weights for it
TINY_TRAINED = replace(TINY, name="tiny-trained")
#: ``tiny-shared``'s layout with trained weights (shipped like ``tiny-trained``): tail-only
#: prefill's quality is measurable on it
TINY_SHARED_TRAINED = replace(TINY_SHARED, name="tiny-shared-trained")

#: V4.1's pairwise compression (seeds: layers 2-19 are C2) among V4's streams: SWA-only
#: layers 0-1, C2 layers 2 and 5 (sparse, each with its own indexer over C2 keys), C4 layer 3,
#: C128 layer 4 (docs/design.md, "C2")
TINY_C2 = replace(TINY, name="tiny-c2", compress_ratios=(0, 0, 2, 4, 128, 2))

#: V4.1 Engram memory (docs/engram.md): layers 1 and 4 each read a 4093-row fp8 table
TINY_ENGRAM = replace(TINY, name="tiny-engram", engram_layers=(1, 4), engram_rows=4093)
#: flash-shaped with two Engram tables of 47.2 GiB in all (a quarter of V4.1's 189 GiB: one
#: rank's share at TP4, the seeds' setting): 2 x 49.15M rows of 512 fp8 channels + a scale
FLASH_ENGRAM = replace(
    FLASH_SHAPED, name="flash-engram", engram_layers=(1, 2), engram_rows=49_152_000,
    engram_dim=512,
)  # fmt: skip

PRESETS = {
    "tiny": TINY,
    "tiny-trained": TINY_TRAINED,
    "flash-shaped": FLASH_SHAPED,
    "tiny-shared": TINY_SHARED,
    "tiny-shared-trained": TINY_SHARED_TRAINED,
    "flash-shared": FLASH_SHARED,
    "tiny-c2": TINY_C2,
    "tiny-engram": TINY_ENGRAM,
    "flash-engram": FLASH_ENGRAM,
}


def preset(name: str, **overrides: object) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)  # type: ignore[arg-type]
