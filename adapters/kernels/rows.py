"""`PoolRows`: which rows of a pool each query reads, addressed through a table, in place.

The sparse kernels (the fused indexer, the sparse attention) never receive gathered keys: they
receive the pool and a `PoolRows`, and load row ``g`` of query ``n`` from
``pool[slot(qrow[n], g)]`` themselves. Queries of one request share one table row (prefill: a
chunk's queries of one request read that request's entries once, each with its own causal
length); in decode every query has its own row (``qrow`` None).

::

    table   (R, P)   int64: slots (slots_per_page == 1) or pages of R row sets
    slot(r, g) = table[r, g // spp] * spp + g % spp        spp = slots_per_page
    query n reads g in [0, lengths[n])                      lengths (N,) int, <= width
    row set of query n: qrow[n]                             qrow (N,) int64, or None: r = n

With ``slots_per_page > 1`` a virtual page's entries are ``spp`` consecutive slots (the core's
shadow arithmetic), so the table is a page table: ``spp`` times smaller than a slot table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PoolRows:
    """Rows ``[0, lengths[n])`` of row set ``qrow[n]`` for every query ``n`` (see the module
    docstring). ``width``: the logical number of rows per set (None: ``P * slots_per_page``).
    Raises `ValueError` for inconsistent shapes."""

    table: torch.Tensor
    lengths: torch.Tensor
    qrow: torch.Tensor | None = None
    slots_per_page: int = 1
    width: int | None = None

    def __post_init__(self) -> None:
        if self.table.dim() != 2 or self.lengths.dim() != 1:
            raise ValueError("table must be (R, P) and lengths (N,)")
        if self.slots_per_page < 1:
            raise ValueError("slots_per_page must be positive")
        if self.width is not None and not 0 <= self.width <= self.capacity:
            raise ValueError(f"width {self.width} exceeds the table's {self.capacity} rows")
        n = self.lengths.shape[0]
        if self.qrow is None and self.table.shape[0] != n:
            raise ValueError(f"without qrow the table needs one row per query ({n})")
        if self.qrow is not None and self.qrow.shape != (n,):
            raise ValueError("qrow must be (N,) like lengths")

    @classmethod
    def of_tables(
        cls,
        read_pages: torch.Tensor | None,
        read_slots: torch.Tensor | None,
        lengths: torch.Tensor,
        width: int,
        slots_per_page: int,
        qrow: torch.Tensor | None,
    ) -> PoolRows:
        """A graph step's stream as rows: its page table (``read_pages``, when page_size >=
        ratio) or else its slot table, each query row's visible prefix ``lengths`` ``(N,)``
        and ``width`` rows per set (the step's entry columns)."""
        if read_pages is None:
            if read_slots is None:
                raise ValueError("a page table or a slot table is needed")
            return cls(read_slots, lengths, qrow, 1, width)
        return cls(read_pages, lengths, qrow, slots_per_page, width)

    @property
    def capacity(self) -> int:
        return self.table.shape[1] * self.slots_per_page

    @property
    def num_rows(self) -> int:
        """``G``: rows per set as the kernels lay out their outputs."""
        return self.capacity if self.width is None else self.width

    @property
    def num_queries(self) -> int:
        return self.lengths.shape[0]

    def select(self, queries: slice) -> PoolRows:
        """The same rows for a contiguous range of queries."""
        if self.qrow is None:
            return PoolRows(self.table[queries], self.lengths[queries], None,
                            self.slots_per_page, self.width)  # fmt: skip
        return PoolRows(self.table, self.lengths[queries], self.qrow[queries],
                        self.slots_per_page, self.width)  # fmt: skip

    def slots(self) -> torch.Tensor:
        """``(N, G)`` pool slots of every query's rows (also past its length: those are read
        from valid table entries but masked). The references gather with it."""
        g = torch.arange(self.num_rows, device=self.table.device)
        table = self.table if self.qrow is None else self.table[self.qrow]
        spp = self.slots_per_page
        if spp == 1:
            return table[:, : self.num_rows]
        return table[:, g // spp] * spp + g % spp

    def slots_of(self, indices: torch.Tensor) -> torch.Tensor:
        """Pool slots ``(N, k)`` of row indices ``(N, k)`` (a top-k selection): only the
        selected entries are looked up, never the ``(N, G)`` slot table."""
        table = self.table if self.qrow is None else self.table[self.qrow]
        spp = self.slots_per_page
        if spp == 1:
            return torch.gather(table, 1, indices)
        return torch.gather(table, 1, indices // spp) * spp + indices % spp

    def mask(self) -> torch.Tensor:
        """``(N, G)``: row ``g`` is read by query ``n``."""
        g = torch.arange(self.num_rows, device=self.lengths.device)
        return g[None, :] < self.lengths[:, None]


def shared_prefix_rows(table: torch.Tensor, slots_per_page: int) -> torch.Tensor:
    """``(1,)`` int32 on the table's device: rows ``[0, that)`` of every row set are row set 0's
    (their leading table entries are equal). No host sync: capturable in a CUDA graph."""
    same = (table == table[:1]).all(0).to(torch.int32)
    return (same.cumprod(0).sum() * slots_per_page).to(torch.int32).reshape(1)
