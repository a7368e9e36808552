"""HiSparse adapter: the C4 KV of every C4 layer in a host mirror with a small device buffer.

The pure `hisparse.Coordinator` plans; this module executes. Per C4 KV-source layer (every C4
layer without V4.1 sharing; consumer C4 layers read their source's mirror and buffer):

* ``host[layer]``: ``(host pages, entries_per_page, d)`` — the whole C4 pool, indexed by virtual
  page (pinned CPU memory on CUDA). Requests sharing a cached prefix share virtual pages, hence
  host pages: one copy.
* ``buffer[layer]``: ``(device_slots + 1, entries_per_page, d)`` on the device, the working set
  (the last row is a sentinel for masked reads).

Page lives come from the cache's KV events (`hisparse.lifetimes.PageLives`, fed by the
executor's own `EventSubscription`, so the embedder's `take_events` is untouched): before each
step's forward, `begin_step` releases every virtual page the cache freed (FREED) or evicted
(EVICTED) since the last step, and a page's first write after that is fresh (no swap-in).

One `exchange` per C4 layer and step, in this order (the coordinator's contract):

1. complete the copy tickets whose events have fired (unpins their pages);
2. plan: the pages the step reads (top-k entries of every query) and writes (entries completed
   this step) -> swap-ins, evictions, translated slots;
3. swap-in host -> device on a side stream (pinned staging), the compute stream waits for it;
4. write the new entries into the device buffer;
5. back the written pages up device -> host on the side stream (completed later, so the host
   mirror is updated only once the copy landed);
6. gather the read entries through the translated slots.

A consumer layer (V4.1 sharing) runs a `read` of its source's buffer after the source's
exchange in the same step: a plan with no writes.

On the CPU every copy is synchronous and completes at once (the same code path CI tests).
The indexer keys stay resident in the ordinary pools: the indexer scores every entry each step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from adapters.memory.device import PoolMemoryError, free_bytes
from adapters.memory.pinned_view import mapped_view
from adapters.model.model_config import ModelConfig
from hisparse import Coordinator, CopyBatch, HiSparseConfig, PinnedPageError
from hisparse.lifetimes import PageLives
from shadowradix import CacheConfig
from shadowradix.events import EventSubscription


@dataclass
class OffloadStats:
    swap_in_pages: int = 0
    backup_pages: int = 0
    swap_in_bytes: int = 0
    exchanges: int = 0
    read_pages: int = 0  # distinct pages read, summed over exchanges (layer-steps)
    max_read_pages: int = 0  # the most distinct pages one exchange read: the smallest buffer


@dataclass
class _Inflight:
    ticket: int
    event: torch.cuda.Event | None
    layer: int = -1
    pages: np.ndarray | None = None  # backup: host pages to fill from ``staging``
    staging: torch.Tensor | None = None


class C4Offload:
    """Host mirror + device working set of the C4 KV, planned by `hisparse.Coordinator`.

    ``events``: a subscription to the cache's KV events (``cache.subscribe_events()``), the
    only way the executor learns that a virtual page was freed and may be reused.
    ``zero_copy`` (CUDA only; default: when the pinned mirror can be mapped,
    `pinned_view.mapped_view`): copies are GPU gathers reading and writing the mapped host
    memory directly; otherwise swap-ins gather on the CPU into pinned staging and backups land
    in staging that `poll` copies into the mirror.

    ``touched[j]``: pages of coordinator layer ``j`` whose residency may have changed since a
    graph decoder last read them (kept only while ``on_begin`` is not empty:
    `residency.GraphResidency` registers there and drains it);
    ``on_begin``: callbacks `begin_step` runs first (graph decode commits its last step there).
    """

    def __init__(
        self,
        model: ModelConfig,
        cache: CacheConfig,
        device: torch.device,
        dtype: torch.dtype,
        device_pages: int,
        debug: bool = False,
        zero_copy: bool | None = None,
        *,
        events: EventSubscription,
    ) -> None:
        if 4 not in model.ratios or cache.page_size < 4:
            raise ValueError("HiSparse needs C4 layers and a page size >= 4")
        self.layers = [i for i in model.kv_source_layers if model.compress_ratios[i] == 4]
        self.spp = cache.stream(4).slots_per_page
        self.device, self.dtype = device, dtype
        host_pages = cache.max_full_pages
        d, pin = model.head_dim, device.type == "cuda"
        row = self.spp * d * len(self.layers)
        _check_fits(device, device_pages + 1, host_pages + 1, row, dtype)
        # one sentinel page past the coordinator's: graph decode's masked writes land there
        self.host = {
            i: torch.zeros(host_pages + 1, self.spp, d, dtype=dtype, pin_memory=pin)
            for i in self.layers
        }
        self.buffer = {
            i: torch.zeros(device_pages + 1, self.spp, d, dtype=dtype, device=device)
            for i in self.layers
        }
        self.coordinator = Coordinator(
            HiSparseConfig(len(self.layers), device_pages, host_pages, self.spp, debug)
        )
        self.device_pages = device_pages
        self._index = {layer: j for j, layer in enumerate(self.layers)}
        self._stream = torch.cuda.Stream(device) if pin else None
        # GPU views of the pinned mirrors (unified addressing): copies become GPU gathers that
        # read / write host memory directly, with no CPU-side gather or staging.
        use = pin if zero_copy is None else zero_copy and pin
        self._mapped = {i: mapped_view(self.host[i], device) for i in self.layers} if use else {}
        self._inflight: list[_Inflight] = []
        self.stats = OffloadStats()
        if not isinstance(events, EventSubscription):
            raise TypeError(f"events must be an EventSubscription, got {type(events).__name__}")
        self.events = events
        self.lives = PageLives(host_pages)
        self.touched: dict[int, list[np.ndarray]] = {j: [] for j in range(len(self.layers))}
        self.on_begin: list[Callable[[], None]] = []
        #: the pages whose life the last `begin_step` ended
        self.last_ended = np.zeros(0, dtype=np.int64)

    @property
    def copy_path(self) -> str:
        """How swap-ins and backups move: ``zero-copy`` (GPU gathers over the mapped pinned
        mirror), ``staged`` (a CPU gather into pinned staging, then one copy: the mapping was
        not asked for or failed) or ``host`` (a CPU run: no device copies)."""
        if self._stream is None:
            return "host"
        mapped = self._mapped and all(v is not None for v in self._mapped.values())
        return "zero-copy" if mapped else "staged"  # pragma: no cover - CUDA only

    # -- copy bookkeeping ------------------------------------------------------------------

    def poll(self) -> None:
        """Completes every in-flight copy whose event has fired (in any order)."""
        still = []
        for job in self._inflight:
            if job.event is None or job.event.query():
                self._finish(job)
            else:
                still.append(job)
        self._inflight = still

    def drain(self) -> None:
        """Waits for and completes every in-flight copy."""
        for job in self._inflight:
            if job.event is not None:
                job.event.synchronize()
            self._finish(job)
        self._inflight = []

    def _finish(self, job: _Inflight) -> None:
        if job.pages is not None and job.staging is not None:  # a backup: fill the mirror
            pages = torch.from_numpy(job.pages)
            self.host[job.layer].index_copy_(0, pages, job.staging)
        self.coordinator.complete(job.ticket)

    def begin_step(self) -> None:
        """Before a step's forward (copies drained or not): the virtual pages the cache freed
        or evicted since the last step (its KV events) end their life here, so whatever the
        coordinator holds of them is released; their next write is fresh. The ``on_begin``
        callbacks run first (a graph step's writes belong to the life they were made in)."""
        for callback in self.on_begin:
            callback()
        ended = self.lives.begin(self.events.take())
        self.last_ended = ended
        if not len(ended):
            return
        try:
            self.coordinator.release(ended)
        except PinnedPageError:  # a copy of the old life is still in flight
            self.drain()
            self.coordinator.release(ended)
        for pages in self.touched.values() if self.on_begin else ():
            pages.append(ended)

    # -- one layer-step --------------------------------------------------------------------

    def exchange(
        self,
        layer: int,
        write_slots: np.ndarray,
        values: torch.Tensor,
        read_slots: torch.Tensor,
        read_valid: torch.Tensor,
    ) -> torch.Tensor:
        """Stores ``values`` at compressed ``write_slots`` and returns the entries at
        ``read_slots`` (``(N, k)`` compressed slots; ``read_valid`` masks padding), shape
        ``(N, k, d)``. Masked reads return the sentinel row."""
        self.poll()
        spp, j = self.spp, self._index[layer]
        valid_np = read_valid.cpu().numpy()
        read_np = read_slots.cpu().numpy()[valid_np]  # the one device -> host sync of the layer
        write_pages = _written_pages(write_slots, spp)
        fresh = self.lives.fresh(write_pages)
        plan = self.coordinator.plan_step(j, read_np // spp, write_pages, fresh)
        self.lives.wrote(write_pages)
        if self.on_begin:  # a graph decoder keeps a device copy of the page table
            self.touched[j] += [plan.swap_in.host_pages, plan.evicted_pages, write_pages]
        self._swap_in(layer, plan.swap_in)
        buf = self.buffer[layer].view(-1, self._width(layer))
        if len(write_slots):
            # write_pages is sorted and distinct: each entry's page slot by one searchsorted
            page_slot = np.asarray(plan.write_slots, dtype=np.int64)
            rows = page_slot[np.searchsorted(write_pages, write_slots // spp)]
            rows = rows * spp + write_slots % spp
            buf[torch.from_numpy(rows).to(self.device)] = values.to(buf.dtype)
        self._backup(layer, plan.backup)
        sentinel = self.device_pages * spp
        dev_rows = np.full(read_valid.shape, sentinel, dtype=np.int64)
        dev_rows[valid_np] = np.asarray(plan.read_slots, dtype=np.int64) * spp + read_np % spp
        self.stats.exchanges += 1
        distinct = len(np.unique(read_np // spp))
        self.stats.read_pages += distinct
        self.stats.max_read_pages = max(self.stats.max_read_pages, distinct)
        return buf[torch.from_numpy(dev_rows).to(self.device)]

    def read(self, layer: int, read_slots: torch.Tensor, read_valid: torch.Tensor) -> torch.Tensor:
        """`exchange` with nothing to write: a consumer layer's read of source ``layer``'s
        entries. The copies the source's exchange issued this step pin their pages, so they
        are completed first (on CUDA a wait; on the CPU there are none): the plan gets the
        whole buffer, which the runner sized for one layer-step's working set."""
        self.drain()
        empty = np.zeros(0, dtype=np.int64)
        return self.exchange(layer, empty, read_valid.new_zeros(0), read_slots, read_valid)

    def _width(self, layer: int) -> int:
        return self.buffer[layer].shape[-1]

    def _swap_in(self, layer: int, batch: CopyBatch) -> None:
        pages = np.array(batch.host_pages, dtype=np.int64)  # a writable copy
        if not len(pages):
            self.coordinator.complete(batch.ticket)
            return
        self.stats.swap_in_pages += len(pages)
        self.stats.swap_in_bytes += len(pages) * self.buffer[layer][0].numel() * 2
        if self._stream is not None:
            self._swap_in_cuda(layer, batch, pages)
            return
        host, slots = self.host[layer], _index(batch.device_slots)
        self.buffer[layer].index_copy_(0, slots, host.index_select(0, torch.from_numpy(pages)))
        self.coordinator.complete(batch.ticket)

    def _backup(self, layer: int, batch: CopyBatch) -> None:
        pages = np.array(batch.host_pages, dtype=np.int64)  # a writable copy
        if not len(pages):
            self.coordinator.complete(batch.ticket)
            return
        self.stats.backup_pages += len(pages)
        if self._stream is not None:
            self._backup_cuda(layer, batch, pages)
            return
        slots = _index(batch.device_slots)
        self.host[layer].index_copy_(0, torch.from_numpy(pages), self.buffer[layer][slots])
        self.coordinator.complete(batch.ticket)

    # CUDA only: CI has no GPU; bench/gpu_equivalence.py and bench/hisparse_decode.py run these
    # on the H200 (greedy outputs identical to all-resident, docs/benchmarks.md).

    def _swap_in_cuda(  # pragma: no cover
        self, layer: int, batch: CopyBatch, pages: np.ndarray
    ) -> None:
        """Host -> device on the side stream, after the compute queued so far (slots being
        refilled may still be read by it); the compute stream then waits for the copy."""
        assert self._stream is not None
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)
        mapped, staging = self._mapped.get(layer), None
        with torch.cuda.stream(self._stream):
            dst = _index(batch.device_slots).to(self.device, non_blocking=True)
            if mapped is not None:  # one GPU gather reading the mapped host mirror
                src = torch.from_numpy(pages).to(self.device, non_blocking=True)
                data = mapped.index_select(0, src)
            else:  # CPU gather into pinned staging, then one copy
                host = self.host[layer]
                staging = torch.empty(
                    (len(pages),) + tuple(host.shape[1:]), dtype=host.dtype, pin_memory=True
                )
                torch.index_select(host, 0, torch.from_numpy(pages), out=staging)
                data = staging.to(self.device, non_blocking=True)
            self.buffer[layer].index_copy_(0, dst, data)
            event = torch.cuda.Event()
            event.record(self._stream)
        compute.wait_event(event)  # the step's reads and writes wait for the swap-in
        self._inflight.append(_Inflight(batch.ticket, event, staging=staging))

    def _backup_cuda(  # pragma: no cover
        self, layer: int, batch: CopyBatch, pages: np.ndarray
    ) -> None:
        """Device -> host on the side stream after the step's writes; one stream, so two
        backups of a page land in issue order. Staged backups fill the mirror in `poll`."""
        assert self._stream is not None
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        mapped, staging = self._mapped.get(layer), None
        with torch.cuda.stream(self._stream):
            src = _index(batch.device_slots).to(self.device, non_blocking=True)
            rows = self.buffer[layer].index_select(0, src)
            if mapped is not None:
                mapped.index_copy_(0, torch.from_numpy(pages).to(self.device), rows)
            else:
                staging = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
                staging.copy_(rows, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        job_pages = None if mapped is not None else pages
        self._inflight.append(_Inflight(batch.ticket, event, layer, job_pages, staging))

    def nbytes(self) -> tuple[int, int]:
        """(device buffer bytes, host mirror bytes) over all C4 layers."""
        dev = sum(t.numel() * t.element_size() for t in self.buffer.values())
        host = sum(t.numel() * t.element_size() for t in self.host.values())
        return dev, host


def _index(ids: np.ndarray) -> torch.Tensor:
    """An int64 CPU index tensor (a copy: the coordinator's arrays are read-only)."""
    return torch.from_numpy(np.array(ids, dtype=np.int64))


def _written_pages(write_slots: np.ndarray, spp: int) -> np.ndarray:
    """The sorted distinct pages receiving entries."""
    if not len(write_slots):
        return np.zeros(0, dtype=np.int64)
    return np.unique(write_slots // spp)


def _check_fits(
    device: torch.device, device_pages: int, host_pages: int, row: int, dtype: torch.dtype
) -> None:
    """Raises `PoolMemoryError` before allocating a device buffer or host mirror (``row``
    elements per page over every C4 layer) larger than the memory free for it."""
    per_page = row * torch.empty((), dtype=dtype).element_size()
    need = {device: device_pages * per_page}
    cpu = torch.device("cpu")
    need[cpu] = need.get(cpu, 0) + host_pages * per_page
    for dev, nbytes in need.items():
        free = free_bytes(dev)
        if nbytes > free:
            raise PoolMemoryError(
                f"HiSparse needs {nbytes / 2**30:.2f} GiB on {dev} (device buffer of "
                f"{device_pages - 1} pages per C4 layer, host mirror of {host_pages}) but "
                f"{free / 2**30:.2f} GiB are free: lower --hisparse-pages or the full pool"
            )
