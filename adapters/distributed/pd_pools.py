"""The rows of whole pages in `KVPools`: gathered by the sender's page ids into one byte buffer,
scattered by the receiver's page ids (PD transfer, `pd`).

Every pool tensor's rows are page-local (`shadowradix.transfer`): a tensor that follows the
virtual pages keeps ``rows_per_page`` rows per page (compressed KV and indexer keys of every
KV-source layer: ``slots_per_page``), one that follows the SWA pages likewise (window latents:
``page_size``; in-flight rings: ``ring_len``; the MTP layer's ``page_hidden``: 1; tail-only's
``late_swa_valid``: ``page_size``). Quantised tensors travel with their scales. The buffer is
the tensors' rows in `pool_tensors` order, each as raw bytes: both sides must have the same
pool tensors (`signature`), which `pd` checks before any byte moves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from adapters.memory.pools import KVPools
from shadowradix import Pool
from shadowradix.transfer_layout import page_rows


@dataclass(frozen=True)
class PoolTensor:
    """One tensor of the pools, the page id its rows follow, and its rows per page."""

    name: str
    tensor: torch.Tensor
    pool: Pool
    rows_per_page: int

    @property
    def page_bytes(self) -> int:
        """Bytes of one page's rows."""
        row = self.tensor[0]
        return self.rows_per_page * row.numel() * row.element_size()

    def describe(self) -> tuple[str, str, tuple[int, ...], str, int]:
        t = self.tensor
        return (self.name, str(t.dtype), tuple(t.shape[1:]), self.pool.value, self.rows_per_page)


def pool_tensors(pools: KVPools) -> list[PoolTensor]:
    """Every tensor of ``pools`` (scales right after their values), in a fixed order. Raises
    `ValueError` for pools whose C4 KV lives in a HiSparse host mirror (not transferable)."""
    cfg, model = pools.cache, pools.model
    if any(layer not in pools.compressed for layer in pools.ring):
        raise ValueError("PD transfer of HiSparse-offloaded C4 KV is not supported")
    out: list[PoolTensor] = []

    def add(name: str, t: torch.Tensor, pool: Pool, per_page: int) -> None:
        out.append(PoolTensor(name, t, pool, per_page))
        scales = pools.scale_of(t)
        if scales is not None:
            out.append(PoolTensor(name + ".scale", scales, pool, per_page))

    for i, t in enumerate(pools.swa):
        add(f"swa{i}", t, Pool.SWA, cfg.page_size)
    for kind, full, ring in (
        ("kv", pools.compressed, pools.ring),
        ("index", pools.index_keys, pools.index_ring),
    ):
        for layer in sorted(ring):
            spec = cfg.stream(model.compress_ratios[layer])
            add(f"{kind}{layer}", full[layer], Pool.FULL, spec.slots_per_page)
            add(f"{kind}_ring{layer}", ring[layer], Pool.SWA, spec.ring_len)
    if pools.page_hidden is not None:
        add("page_hidden", pools.page_hidden, Pool.SWA, 1)
    if pools.late_swa_valid is not None:
        add("late_swa_valid", pools.late_swa_valid, Pool.SWA, cfg.page_size)
    return out


def signature(pools: KVPools) -> tuple[tuple[str, str, tuple[int, ...], str, int], ...]:
    """What two pools must share for their page bytes to be interchangeable."""
    return tuple(t.describe() for t in pool_tensors(pools))


def transfer_bytes(pools: KVPools, num_full_pages: int, num_swa_pages: int) -> int:
    """The bytes of that many virtual and SWA pages' rows, every tensor together."""
    n = {Pool.FULL: num_full_pages, Pool.SWA: num_swa_pages}
    return sum(t.page_bytes * n[t.pool] for t in pool_tensors(pools))


def _rows(pages: np.ndarray, per_page: int, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(page_rows(pages, per_page)).to(device)


def gather_pages(pools: KVPools, full_src: np.ndarray, swa_src: np.ndarray) -> torch.Tensor:
    """The rows of those pages as one flat uint8 tensor on the pools' device."""
    src = {Pool.FULL: full_src, Pool.SWA: swa_src}
    parts = []
    for t in pool_tensors(pools):
        rows = t.tensor[_rows(src[t.pool], t.rows_per_page, t.tensor.device)]
        parts.append(rows.contiguous().view(torch.uint8).reshape(-1))
    if not parts:
        return torch.zeros(0, dtype=torch.uint8, device=pools.device)
    return torch.cat(parts)


def scatter_pages(
    pools: KVPools, buf: torch.Tensor, full_dst: np.ndarray, swa_dst: np.ndarray
) -> None:
    """Write `gather_pages`' buffer (of the same pages' count) at those pages. Raises
    `ValueError`, writing nothing, if its size is not theirs."""
    dst = {Pool.FULL: full_dst, Pool.SWA: swa_dst}
    tensors = pool_tensors(pools)
    sizes = [t.page_bytes * len(dst[t.pool]) for t in tensors]
    if sum(sizes) != buf.numel():
        raise ValueError(f"page buffer of {buf.numel()} bytes, the pages hold {sum(sizes)}")
    buf = buf.to(pools.device)
    for t, chunk in zip(tensors, torch.split(buf, sizes)):
        rows = _rows(dst[t.pool], t.rows_per_page, t.tensor.device)
        if chunk.storage_offset() % t.tensor.element_size():
            chunk = chunk.clone()  # a dtype view needs an aligned start
        t.tensor[rows] = chunk.view(t.tensor.dtype).view(-1, *t.tensor.shape[1:])
