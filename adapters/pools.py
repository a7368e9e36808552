"""KV pools as torch tensors, sized from a `CacheConfig` and addressed only by its slot numbers.

Every tensor has one extra *sentinel* row at the end (index ``capacity``): fixed-shape code (the
CUDA-graph decode) sends the writes of padding rows and of groups that did not complete there,
and never reads it unmasked. The core never hands out that index.

Per layer: an SWA pool (one latent per SWA slot). Per compressed layer: its compressed KV pool
(one entry per compressed slot of its stream) and its in-flight ring (one fp32 row per ring row:
``[kv | score]`` of one token, both halves doubled under the C4 overlap). Per C4 layer also the
indexer's own compressed keys and ring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shadowradix import CacheConfig

from .model_config import ModelConfig


@dataclass(frozen=True)
class PoolBytes:
    swa: int
    compressed: int
    index: int
    rings: int

    @property
    def total(self) -> int:
        return self.swa + self.compressed + self.index + self.rings


def _row_width(model: ModelConfig, ratio: int, dim: int) -> int:
    """Floats per in-flight row: kv and score, each doubled by the overlap."""
    return 2 * dim * (2 if model.is_overlap(ratio) else 1)


class KVPools:
    """Every pool tensor of one model. ``state_dtype`` (the rings) is fp32 unless the model runs
    in fp64 (exact tests). ``offload_c4``: no device C4 KV pool (`C4Offload` holds it).

    ``mtp``: also the MTP layer's state (docs/speculative.md): its SWA KV as one more SWA
    layer (``swa[model.num_layers]``, the same slots as every layer), and ``page_hidden``: per
    SWA page, the main model's last hidden state at the page's last position, which a request
    resuming at that page boundary feeds to the MTP row of its first new token."""

    def __init__(
        self,
        model: ModelConfig,
        cache: CacheConfig,
        device: torch.device | str,
        dtype: torch.dtype,
        offload_c4: bool = False,
        mtp: bool = False,
    ) -> None:
        if cache.window != model.window or cache.compress_ratios != model.compress_ratios:
            raise ValueError("cache config does not match the model (window / compress_ratios)")
        self.model, self.cache = model, cache
        self.device, self.dtype = torch.device(device), dtype
        self.state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        swa_slots = cache.max_swa_pages * cache.page_size
        self.swa = [self._zeros(swa_slots, model.head_dim) for _ in model.compress_ratios]
        self.page_hidden: torch.Tensor | None = None
        if mtp:
            self.swa.append(self._zeros(swa_slots, model.head_dim))
            self.page_hidden = self._zeros(cache.max_swa_pages, model.hidden)
        self.compressed: dict[int, torch.Tensor] = {}
        self.ring: dict[int, torch.Tensor] = {}
        self.index_keys: dict[int, torch.Tensor] = {}
        self.index_ring: dict[int, torch.Tensor] = {}
        for layer, ratio in enumerate(model.compress_ratios):
            if not ratio:
                continue
            slots, rows = cache.compressed_capacity(ratio), cache.ring_capacity(ratio)
            if not (offload_c4 and ratio == 4):  # HiSparse keeps C4 KV in its host mirror
                self.compressed[layer] = self._zeros(slots, model.head_dim)
            self.ring[layer] = self._state(rows, _row_width(model, ratio, model.head_dim))
            if model.is_sparse(ratio):
                self.index_keys[layer] = self._zeros(slots, model.index_dim)
                self.index_ring[layer] = self._state(
                    rows, _row_width(model, ratio, model.index_dim)
                )

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
            return sum(t.numel() * t.element_size() for t in ts)

        return PoolBytes(
            swa=size(self.swa),
            compressed=size(list(self.compressed.values())),
            index=size(list(self.index_keys.values())),
            rings=size(list(self.ring.values()) + list(self.index_ring.values())),
        )
