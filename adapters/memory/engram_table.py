"""Where the Engram tables live: on the device, or in (pinned) host memory (docs/engram.md).

The tables of all ``L`` Engram layers are one array of ``L * E`` rows (layer ``l``'s row ``r``
is flat row ``l * E + r``), each ``dim`` fp8 e4m3 values and one fp32 power-of-two scale: the
FP8 row format of `adapters.memory.formats`, quantised by its `quantize` and read back by its
`dequantize`, so every placement returns the same bits. What a placement does per step::

    DeviceRows   values[ids], scales[ids] on the device           (no copy; graph-capturable)
    HostRows     one CPU gather of packed rows [fp8 values | scale bytes] into a pinned
                 buffer, one host-to-device copy, unpacked and dequantised on the device
    (sharded)    `adapters.distributed.engram_shard`: HostRows' gather of the rank's rows,
                 the partial rows all-reduced

Dequantisation, gating and the value projection stay on the device in every placement (the
seeds' host offload does the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adapters.memory.formats import CacheFormat, QuantizedRows, RowLayout, dequantize, quantize
from adapters.model.engram import EngramRows
from adapters.model.model_config import ModelConfig

#: offset of the tables' generator seed from the model's (their own stream of draws)
TABLE_SEED_OFFSET = 0x454E54
#: rows drawn per chunk while building a table (bounds the fp32 scratch)
_CHUNK_ROWS = 1 << 16


@dataclass(frozen=True)
class EngramTable:
    """Rows ``flat % world == rank`` of the flat table (all of it at ``world == 1``), in the
    order of their flat index: local row ``j`` is flat row ``j * world + rank``."""

    values: torch.Tensor  # (R, dim) float8_e4m3fn
    scales: torch.Tensor  # (R,) fp32
    rows_per_layer: int
    rank: int = 0
    world: int = 1

    @property
    def dim(self) -> int:
        return int(self.values.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes of values and scales (what the placement takes from its memory)."""
        return self.values.nbytes + self.scales.nbytes

    def packed(self) -> torch.Tensor:
        """``(R, dim + 4)`` uint8: each row's values then its scale's bytes (one gather)."""
        scale_bytes = self.scales.view(torch.uint8).view(-1, 4)
        return torch.cat((self.values.view(torch.uint8), scale_bytes), dim=1)


def table_rows(cfg: ModelConfig) -> int:
    """Rows of the flat table: ``L * E``."""
    return len(cfg.engram_layers) * cfg.engram_rows


def init_table(
    cfg: ModelConfig, device: torch.device | str = "cpu", rank: int = 0, world: int = 1
) -> EngramTable:
    """The seeded table of ``cfg`` (rows ``flat % world == rank``), the same on every device
    and for every split: rows ~ N(0, 1), drawn in flat order from one CPU generator, quantised
    to FP8. ``device="meta"`` allocates nothing (sizes only). Raises `ValueError` for a model
    without Engram layers or a bad ``rank`` / ``world``."""
    if not cfg.engram_layers:
        raise ValueError(f"{cfg.name} has no Engram layers")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    total, layout = table_rows(cfg), RowLayout(CacheFormat.FP8, cfg.engram_dim)
    local = len(range(rank, total, world))
    storage = layout.zeros(local, device) if str(device) != "meta" else _meta(layout, local)
    if str(device) != "meta":
        _fill(storage, cfg, total, rank, world)
    return EngramTable(storage.values, storage.scales, cfg.engram_rows, rank, world)


def _meta(layout: RowLayout, rows: int) -> QuantizedRows:
    values = torch.empty(layout.values_shape((rows,)), dtype=layout.value_dtype, device="meta")
    scales = torch.empty(layout.scales_shape((rows,)), dtype=layout.scale_dtype, device="meta")
    return QuantizedRows(CacheFormat.FP8, values, scales)


def _fill(storage: QuantizedRows, cfg: ModelConfig, total: int, rank: int, world: int) -> None:
    gen = torch.Generator().manual_seed(cfg.seed + TABLE_SEED_OFFSET)
    out = 0
    for start in range(0, total, _CHUNK_ROWS):
        n = min(_CHUNK_ROWS, total - start)
        rows = torch.randn(n, cfg.engram_dim, generator=gen)
        first = (rank - start) % world  # the chunk's first row this rank keeps
        q = quantize(rows[first::world], CacheFormat.FP8)
        k = q.values.shape[0]
        storage.values[out : out + k] = q.values.to(storage.values.device)
        storage.scales[out : out + k] = q.scales.to(storage.scales.device)
        out += k


def flat_ids(row_ids: torch.Tensor, rows_per_layer: int) -> torch.Tensor:
    """Flat table rows ``(L, N, K)`` of per-layer ``row_ids``."""
    offsets = torch.arange(row_ids.shape[0], device=row_ids.device) * rows_per_layer
    return row_ids + offsets[:, None, None]


def unpack(packed: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Dequantised ``(..., dim)`` rows of packed ``(..., dim + 4)`` uint8 rows."""
    values = packed[..., :dim].contiguous().view(torch.float8_e4m3fn)
    scales = packed[..., dim:].contiguous().view(torch.float32)[..., 0]
    return dequantize(QuantizedRows(CacheFormat.FP8, values, scales), dtype)


class DeviceRows(EngramRows):
    """The whole table on ``device`` (the lookup is two gathers there)."""

    def __init__(self, table: EngramTable, device: torch.device, dtype: torch.dtype) -> None:
        self.table, self.dtype = table, dtype
        self.values, self.scales = table.values.to(device), table.scales.to(device)

    def lookup(self, row_ids: torch.Tensor) -> torch.Tensor:
        ids = flat_ids(row_ids.to(self.values.device), self.table.rows_per_layer)
        q = QuantizedRows(CacheFormat.FP8, self.values[ids], self.scales[ids])
        return dequantize(q, self.dtype).flatten(-2)

    @property
    def device_bytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes


class HostRows(EngramRows):
    """The table packed in host memory (pinned when ``device`` is CUDA); each lookup gathers
    its rows on the CPU into a pinned buffer and copies them to ``device`` once. Ids on the
    device are first copied to the host (a synchronisation: overlap scheduling pays it)."""

    def __init__(self, table: EngramTable, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype, self.table = device, dtype, table
        self.pinned = device.type == "cuda"
        packed = table.packed()
        self.packed = packed.pin_memory() if self.pinned else packed

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Packed local rows ``local`` (host ids), copied to the device: ``(*local.shape, w)``."""
        flat = local.reshape(-1)
        buf = torch.empty((flat.shape[0], self.packed.shape[1]), dtype=torch.uint8,
                          pin_memory=self.pinned)  # fmt: skip
        torch.index_select(self.packed, 0, flat, out=buf)
        # the caching host allocator keeps `buf` until the copy has run: no reuse hazard
        return buf.to(self.device, non_blocking=self.pinned).view(*local.shape, -1)

    def lookup(self, row_ids: torch.Tensor) -> torch.Tensor:
        ids = flat_ids(row_ids.cpu(), self.table.rows_per_layer)
        return unpack(self.gather(ids), self.table.dim, self.dtype).flatten(-2)

    @property
    def device_bytes(self) -> int:
        return 0
