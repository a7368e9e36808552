"""KV pools as torch tensors, sized from a `CacheConfig` and addressed only by its slot numbers.

Every tensor has one extra *sentinel* row at the end (index ``capacity``): fixed-shape code (the
CUDA-graph decode) sends the writes of padding rows and of groups that did not complete there,
and never reads it unmasked. The core never hands out that index.

Rows exist for the pools' *live* capacities only (the core keeps every id in use below them):
a re-balance moves pages and resizes the tensors (`pool_resize.apply_rebalance`), bumping
``generation`` so that code holding tensor addresses (captured CUDA graphs) rebuilds them.

Per layer: an SWA pool (one latent per SWA slot). Per KV-source layer (every compressed layer
without V4.1 sharing; `ModelConfig.kv_sources` with it): its compressed KV pool (one entry per
compressed slot of its stream) and its in-flight ring (one fp32 row per ring row: ``[kv |
score]`` of one token, both halves doubled under the C4 overlap). Per C4 KV-source layer also
the indexer's own compressed keys and ring. Consumer layers own no compressed pool: they read
their source's (``compressed[model.kv_source_of(layer)]``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adapters import kernels
from adapters.memory.formats import CacheFormat, RowLayout, bytes_per_row, write_rows
from adapters.model.model_config import ModelConfig
from shadowradix import CacheConfig


@dataclass(frozen=True)
class PoolBytes:
    swa: int
    compressed: int
    index: int
    rings: int
    #: the MTP layer's page hidden states and the tail-only validity flags
    other: int = 0

    @property
    def total(self) -> int:
        return self.swa + self.compressed + self.index + self.rings + self.other


def _row_width(model: ModelConfig, ratio: int, dim: int) -> int:
    """Floats per in-flight row: kv and score, each doubled by the overlap."""
    return 2 * dim * (2 if model.is_overlap(ratio) else 1)


@dataclass(frozen=True)
class TokenBytes:
    """Pool bytes one token costs, all layers together (`bytes_per_token`)."""

    compressed: float  # per cached token: compressed KV of every KV-source layer
    index: float  # per cached token: indexer keys of every C4 KV-source layer
    swa: float  # per SWA-resident token: the window latent of every layer
    rings: float  # per SWA-resident token: in-flight rows of every KV-source layer

    @property
    def per_cached_token(self) -> float:
        """What a cached prefix costs per token for as long as it stays cached."""
        return self.compressed + self.index

    @property
    def per_swa_token(self) -> float:
        """What a token costs while it is in a window (at most window + a page per request)."""
        return self.swa + self.rings


def bytes_per_token(
    model: ModelConfig,
    cache: CacheConfig,
    dtype: torch.dtype,
    index_format: CacheFormat = CacheFormat.BF16,
    swa_format: CacheFormat = CacheFormat.BF16,
) -> TokenBytes:
    """Pool bytes per token with KV in ``dtype`` (rings fp32, fp64 in exact mode), indexer keys
    in ``index_format`` and window KV in ``swa_format`` (values and scales;
    `formats.bytes_per_row`), sentinel rows ignored.
    V4.1 sharing saves the compressed KV and indexer keys of every consumer layer (and its
    rings); window KV stays per layer."""
    elem = torch.tensor([], dtype=dtype).element_size()

    def row(fmt: CacheFormat, width: int) -> int:
        return width * elem if fmt is CacheFormat.BF16 else bytes_per_row(fmt, width, dtype)

    index_row = row(index_format, model.index_dim)
    state = 8 if dtype == torch.float64 else 4
    p = cache.page_size
    compressed = index = rings = 0.0
    for layer in model.kv_source_layers:
        ratio = model.compress_ratios[layer]
        spec = cache.stream(ratio)
        entries, rows = spec.slots_per_page / p, spec.ring_len / p
        compressed += entries * model.head_dim * elem
        rings += rows * _row_width(model, ratio, model.head_dim) * state
        if model.is_sparse(ratio):
            index += entries * index_row
            rings += rows * _row_width(model, ratio, model.index_dim) * state
    swa = model.num_layers * row(swa_format, model.head_dim)
    return TokenBytes(compressed=compressed, index=index, swa=swa, rings=rings)


def check_cache_matches(model: ModelConfig, cache: CacheConfig) -> None:
    """Raises `ValueError` unless ``cache`` has the model's window and compress ratios."""
    if cache.window != model.window or cache.compress_ratios != model.compress_ratios:
        raise ValueError("cache config does not match the model (window / compress_ratios)")


def pool_bytes(
    model: ModelConfig,
    cache: CacheConfig,
    dtype: torch.dtype,
    index_format: CacheFormat = CacheFormat.BF16,
    swa_format: CacheFormat = CacheFormat.BF16,
) -> int:
    """What `KVPools` will allocate for these pools, to within their sentinel rows and the MTP
    layer (known before anything is allocated: `device.check_pools_fit`). Raises `ValueError`
    for a cache config that does not match the model."""
    check_cache_matches(model, cache)
    per = bytes_per_token(model, cache, dtype, index_format, swa_format)
    return int(cache.full_capacity * per.per_cached_token + cache.swa_capacity * per.per_swa_token)


class KVPools:
    """Every pool tensor of one model. ``state_dtype`` (the rings) is fp32 unless the model runs
    in fp64 (exact tests). ``offload_c4``: no device C4 KV pool (`C4Offload` holds it).

    ``track_late_swa`` (tail-only prefill): ``late_swa_valid[slot]`` says whether the layers
    after the last KV source hold the latent of SWA ``slot``. Tail-only prefill writes those
    layers' SWA only for the last W tokens of each chunk; reads of the others are masked.
    ``mtp``: also the MTP layer's state (docs/speculative.md): its SWA KV as one more SWA
    layer (``swa[model.num_layers]``, the same slots as every layer), and ``page_hidden``: per
    SWA page, the main model's last hidden state at the page's last position, which a request
    resuming at that page boundary feeds to the MTP row of its first new token.

    ``index_format`` / ``swa_format``: the cache format (`formats.CacheFormat`) of the indexer
    keys / of the main layers' window KV: ``BF16`` keeps them in ``dtype``; ``FP8`` stores e4m3
    values in the pool tensor (``index_keys[layer]``, ``swa[layer]``) and one fp32 scale per row
    beside it (`scale_of`); ``FP4`` (indexer keys only, V4.1) packs e2m1 codes two per byte
    with one fp32 scale per 32 channels. Writers go through `store`, which quantises (the same
    rounding in prefill, decode and verify); the kernels dequantise as they read. The MTP
    layer's window stays in ``dtype``."""

    def __init__(
        self,
        model: ModelConfig,
        cache: CacheConfig,
        device: torch.device | str,
        dtype: torch.dtype,
        offload_c4: bool = False,
        track_late_swa: bool = False,
        mtp: bool = False,
        index_format: CacheFormat = CacheFormat.BF16,
        swa_format: CacheFormat = CacheFormat.BF16,
    ) -> None:
        if swa_format is CacheFormat.FP4:
            raise ValueError("FP4 window KV is not supported (FP4 is a V4.1 indexer-key format)")
        check_cache_matches(model, cache)
        self.model, self.cache = model, cache
        self.device, self.dtype = torch.device(device), dtype
        self.state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        #: live capacities in pages (`apply_rebalance` moves them); bumped on every resize
        self.full_pages, self.swa_pages = cache.num_full_pages, cache.num_swa_pages
        self.generation = 0
        swa_slots = cache.num_swa_pages * cache.page_size
        self.index_format, self.swa_format = index_format, swa_format
        self._scales: list[tuple[torch.Tensor, torch.Tensor, CacheFormat]] = []
        self.swa = [
            self._rows(swa_slots, model.head_dim, swa_format) for _ in model.compress_ratios
        ]
        self.page_hidden: torch.Tensor | None = None
        if mtp:
            self.swa.append(self._zeros(swa_slots, model.head_dim))
            self.page_hidden = self._zeros(cache.num_swa_pages, model.hidden)
        self.compressed: dict[int, torch.Tensor] = {}
        self.ring: dict[int, torch.Tensor] = {}
        self.index_keys: dict[int, torch.Tensor] = {}
        self.index_ring: dict[int, torch.Tensor] = {}
        for layer in model.kv_source_layers:
            ratio = model.compress_ratios[layer]
            spec = cache.stream(ratio)
            slots = cache.num_full_pages * spec.slots_per_page
            rows = cache.num_swa_pages * spec.ring_len
            if not (offload_c4 and ratio == 4):  # HiSparse keeps C4 KV in its host mirror
                self.compressed[layer] = self._zeros(slots, model.head_dim)
            self.ring[layer] = self._state(rows, _row_width(model, ratio, model.head_dim))
            if model.is_sparse(ratio):
                self.index_keys[layer] = self._rows(slots, model.index_dim, index_format)
                self.index_ring[layer] = self._state(
                    rows, _row_width(model, ratio, model.index_dim)
                )
        self.late_swa_valid: torch.Tensor | None = None
        if track_late_swa:
            self.late_swa_valid = torch.zeros(swa_slots + 1, device=self.device, dtype=torch.bool)

    def _rows(self, slots: int, width: int, fmt: CacheFormat) -> torch.Tensor:
        """A pool of ``slots`` rows (+ the sentinel) in ``fmt``; a quantised one registers its
        scales (`scale_of`)."""
        if fmt is CacheFormat.BF16:
            return self._zeros(slots, width)
        native = self.dtype if self.dtype != torch.float16 else torch.float32
        rows = RowLayout(fmt, width, native).zeros(slots + 1, self.device)
        self._scales.append((rows.values, rows.scales, fmt))
        return rows.values

    def store(self, pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Writes ``rows`` at ``slots`` of ``pool`` (one of this object's tensors), quantised
        when ``pool`` is kept in a quantised format."""
        for values, scales, fmt in self._scales:
            if values is pool:
                rows = rows.to(self.state_dtype)
                if _fused_fp8(fmt, pool, slots, rows):  # pragma: no cover - needs a GPU
                    from adapters.kernels.quantize import fp8_store

                    fp8_store(pool, scales, slots, rows)
                else:
                    write_rows(pool, scales, slots, rows, fmt)
                return
        pool[slots] = rows.to(pool.dtype)

    def scale_of(self, pool: torch.Tensor) -> torch.Tensor | None:
        """The row scales of ``pool`` if it is kept in a quantised format, else None."""
        return next((scales for values, scales, _ in self._scales if values is pool), None)

    def _zeros(self, rows: int, width: int) -> torch.Tensor:
        return torch.zeros(rows + 1, width, device=self.device, dtype=self.dtype)

    def _state(self, rows: int, width: int) -> torch.Tensor:
        return torch.zeros(rows + 1, width, device=self.device, dtype=self.state_dtype)

    @staticmethod
    def sentinel(pool: torch.Tensor) -> int:
        """The write-only row of ``pool``."""
        return pool.shape[0] - 1

    def nbytes(self) -> PoolBytes:
        def size(ts: list[torch.Tensor]) -> int:
            scales = [self.scale_of(t) for t in ts]
            extra = [sc for sc in scales if sc is not None]
            return sum(t.numel() * t.element_size() for t in ts + extra)

        return PoolBytes(
            swa=size(self.swa),
            compressed=size(list(self.compressed.values())),
            index=size(list(self.index_keys.values())),
            rings=size(list(self.ring.values()) + list(self.index_ring.values())),
            other=size([t for t in (self.page_hidden, self.late_swa_valid) if t is not None]),
        )


def _fused_fp8(fmt: CacheFormat, pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor):
    """FP8 rows of a CUDA pool go through one fused launch (`kernels.quantize`), the same bytes
    as `write_rows`; ``kernels.QUANTIZE_KERNEL = False`` keeps the torch chain."""
    return (
        fmt is CacheFormat.FP8
        and kernels.QUANTIZE_KERNEL
        and kernels.use_triton(pool)
        and slots.dim() == 1
        and rows.dim() == 2
    )
