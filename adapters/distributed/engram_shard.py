"""Host-sharded Engram tables (the seeds' per-rank layout), and the placement a runner uses.

Each of ``world`` ranks holds, in its host memory, the flat table rows ``flat % world ==
rank`` (`engram_table.init_table`). Every rank of a tensor-parallel group sees the same tokens,
so each looks up the same ids: a rank gathers the rows it owns (the others read as zero rows),
dequantises them on its device, and one all-reduce (sum) gives every rank all rows. The sum is
exact: each element has one non-zero term. This keeps the seeds' lookup all-reduce; what it
saves is host memory per rank (1 / world of the table each).

`place_engram` builds the placement a model's ``engram_placement`` names (docs/engram.md).
"""

from __future__ import annotations

import torch

from adapters.memory.engram_table import (
    DeviceRows,
    EngramTable,
    HostRows,
    flat_ids,
    init_table,
    unpack,
)
from adapters.model.engram import EngramRows
from adapters.model.model_config import EngramPlacement, ModelConfig


class EngramPlacementError(ValueError):
    """A placement that cannot run here (sharded without a process group)."""


class ShardedRows(EngramRows):
    """This rank's shard in host memory (``table.rank`` of ``table.world``); ``group``: the
    ranks that share the lookup (default: the default group). Each lookup is one CPU gather,
    one copy and one all-reduce, on the device (NCCL) or on the host (gloo)."""

    def __init__(
        self, table: EngramTable, device: torch.device, dtype: torch.dtype, group=None
    ) -> None:
        import torch.distributed as dist

        self.dist, self.group, self.table, self.dtype = dist, group, table, dtype
        # gloo reduces host tensors: gather and reduce there, then move the rows
        on_host = dist.get_backend(group) == "gloo"
        self.host = HostRows(table, torch.device("cpu") if on_host else device, torch.float32)
        self.device = device

    def lookup(self, row_ids: torch.Tensor) -> torch.Tensor:
        t = self.table
        ids = flat_ids(row_ids.cpu(), t.rows_per_layer)
        mine = ids % t.world == t.rank
        local = torch.where(mine, ids // t.world, 0)
        rows = unpack(self.host.gather(local), t.dim, torch.float32)  # (L, N, K, dim)
        rows = rows * mine.to(rows.device)[..., None]
        self.dist.all_reduce(rows, group=self.group)
        return rows.to(self.device, self.dtype).flatten(-2)

    @property
    def device_bytes(self) -> int:
        return 0


def place_engram(
    cfg: ModelConfig, device: torch.device, dtype: torch.dtype, group=None
) -> EngramRows | None:
    """The tables of ``cfg`` where ``cfg.engram_placement`` says (None without Engram layers):
    DEVICE and HOST build the whole seeded table, SHARDED this rank's rows of it. Raises
    `EngramPlacementError` for SHARDED without an initialised process group."""
    if not cfg.engram_layers:
        return None
    placement = cfg.engram_placement
    if placement is EngramPlacement.SHARDED:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise EngramPlacementError(
                "engram_placement=SHARDED needs an initialised torch.distributed process group"
            )
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        return ShardedRows(init_table(cfg, "cpu", rank, world), device, dtype, group)
    if placement is EngramPlacement.HOST:
        return HostRows(init_table(cfg, "cpu"), device, dtype)
    return DeviceRows(init_table(cfg, device), device, dtype)
