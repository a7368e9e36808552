"""Graph-safe HiSparse decode: the C4 KV read inside a captured step, with no host sync in it.

`C4Offload.exchange` (the eager path) plans each layer-step on the host from the step's own
top-k, so it syncs once per C4 layer. Here the plan comes from the *previous* step's selection
(temporal locality), and a page that is not resident is still read, exactly, from the host
mirror through a zero-copy view (`pinned_view.mapped_view`). Per C4 KV-source layer:

* ``table[layer]``: ``(host pages + 1,)`` int64 on the device, virtual page -> buffer slot or
  ``-1`` (the last entry is the mirror's sentinel page: never resident). A copy of the
  coordinator's page table, updated outside the graph by a small host -> device scatter of the
  pages whose residency changed (`sync_table`).

Inside the captured step (fixed shapes; one kernel each, `adapters.kernels.hisparse_step` on
CUDA, `adapters.kernels.hisparse_reference` elsewhere):

* `store` (a compressed entry completed this step): written to the mirror (zero-copy) **and**,
  when its page is resident, to the buffer slot — write-through, so a resident page's buffer
  copy always equals its mirror page and the mirror is always current (no backups to wait for);
* `gather` (the top-k of a query): each entry from the buffer when its page is resident, else
  from the mirror (masked loads: the bus carries the misses only); the result is a
  ``(N * k, d)`` pool the attention reads as before.
* the *window's records*, per source, in fixed device buffers: ``reads`` (``(host pages + 1,)``
  int32, each selected entry adds one to its page) and ``wrote`` (the pages an entry was
  written to), plus hit / read counters. They add up over the graph steps of a *window*
  (``commit_every`` steps), so the host plans once a window, not once a step.

Outside the graph, on the host:

* `after_step`: ends the window after its ``commit_every``-th step (`_flush`: a non-blocking
  copy of the records to pinned buffers, the device records zeroed behind it, an event), or
  when one more step could write more pages than the buffer holds. A
  window also ends early, before the step that would follow it, when the cache ended page lives
  (`before_step`: a freed page id may start a new life, whose writes must not merge with the
  old life's), and before an eager step (its `C4Offload.begin_step` commits first);
* `commit` (`after_launch`: right after the *next* graph step is launched, so the host plans
  while the device runs it; or an eager step's `C4Offload.begin_step`, first): waits for that
  event (long done), and per layer plans with the coordinator: reads = the window's resident
  pages (LRU stamps) plus at most ``max_swaps`` missed pages (most-read first), writes = the
  pages written (fresh when their life began in the window), both without the pages whose life
  ended since (released by the launched step's `begin_step`); copies the swapped-in pages and
  the newly placed written pages mirror -> buffer on the compute stream, queued behind the
  launched step (which read the tables as they were), and the device table's changes behind
  them (`sync_table`); completes both tickets at once (the mirror needed no backup);
* `sync_table` (the end of a commit, and `before_step` before each replay): uploads the slots
  of every page whose residency changed — by a commit, by eager steps (`C4Offload.touched`) or
  by releases. A plan thus reaches the device two steps after the window it came from ends.

``commit_every=1`` plans from the previous step alone. Larger windows divide the host's
planning cost (about half a millisecond a commit for two C4 sources on the H200's host,
bench/hisparse_commit.py) by the window length, for a plan up to ``commit_every`` steps older
(docs/hisparse.md, "Planning once a window, a stable decode order, fused row movers").

Exactness: every entry a step reads comes from the mirror, which holds every write (write-
through), or from a buffer slot that the table maps to the page, and a mapped slot holds the
mirror page's data (swap-ins and placements copy the mirror page; resident pages get every
write). A missed page costs a slower read, never a wrong one. Swap-ins per layer and commit
are at most ``max_swaps`` plus the pages written in the window, and those never exceed the
buffer (`after_step` ends a window before they could).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import torch

from adapters.kernels import PoolRows
from adapters.memory.pinned_view import mapped_view
from adapters.model.model_config import ModelConfig

if TYPE_CHECKING:
    from adapters.memory.offload import C4Offload


class ZeroCopyUnavailable(RuntimeError):
    """HiSparse graph decode needs a device view of the pinned host mirror, which failed."""


@dataclass
class GraphStats:
    steps: int = 0
    commits: int = 0  # windows planned (`GraphResidency.commit_every` steps or fewer each)
    swap_in_pages: int = 0  # pages copied mirror -> buffer after a step (misses + placements)
    missed_pages: int = 0  # distinct pages read from the mirror, summed over layers and commits
    dropped_misses: int = 0  # missed pages beyond max_swaps (read zero-copy, not swapped in)


#: graph steps per planning window by default (docs/hisparse.md, "Planning once a
#: window, a stable decode order, fused row movers")
COMMIT_EVERY = 8


@dataclass(frozen=True)
class _Pending:
    """An ended window whose records are on their way to the host buffers."""

    event: torch.cuda.Event | None


def _kernels(cuda: bool) -> ModuleType:
    if cuda:  # pragma: no cover - CUDA only (the kernels are tested interpreted)
        from adapters.kernels import hisparse_step

        return hisparse_step
    from adapters.kernels import hisparse_reference

    return hisparse_reference


class GraphResidency:
    """The device side of HiSparse graph decode over ``offload`` (see the module docstring).
    ``max_rows``: the most query rows of a step (batch x tokens per request); ``max_swaps``:
    the bound on missed pages swapped in per layer and commit (default: the top-k);
    ``commit_every``: graph steps per window (one plan each, `COMMIT_EVERY` by default)."""

    def __init__(
        self, offload: C4Offload, model: ModelConfig, max_rows: int, max_swaps: int | None = None,
        commit_every: int | None = None,
    ) -> None:  # fmt: skip
        self.offload, self.spp = offload, offload.spp
        self.max_swaps = model.index_topk if max_swaps is None else max_swaps
        self.commit_every = COMMIT_EVERY if commit_every is None else commit_every
        for name, value, least in (("max_swaps", self.max_swaps, 0),
                                   ("commit_every", self.commit_every, 1)):  # fmt: skip
            if type(value) is not int or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        dev, pages = offload.device, offload.coordinator.config.max_host_pages
        self.host_rows = pages * self.spp  # the mirror's sentinel page starts here
        self.table = {i: torch.full((pages + 1,), -1, dtype=torch.long, device=dev)
                      for i in offload.layers}  # fmt: skip
        self.mirror = {i: self._mirror(i) for i in offload.layers}
        self._mirror_pages = {i: m.view(offload.host[i].shape) for i, m in self.mirror.items()}
        self.rows = {i: offload.buffer[i].view(-1, offload.buffer[i].shape[-1])
                     for i in offload.layers}  # fmt: skip
        # the window's records (index `pages`: the sentinel page, for padding and no write)
        self.reads = {i: torch.zeros(pages + 1, dtype=torch.int32, device=dev)
                      for i in offload.layers}  # fmt: skip
        self.wrote = {i: torch.zeros(pages + 1, dtype=torch.bool, device=dev)
                      for i in offload.layers}  # fmt: skip
        self.counts = torch.zeros(2, dtype=torch.long, device=dev)  # entries hit, entries read
        self.max_rows, self.stats = max_rows, GraphStats()
        self._cuda = dev.type == "cuda"
        #: the graph step's row movers: Triton kernels on CUDA, their torch reference elsewhere
        self._kernels = _kernels(self._cuda)
        self._open = self._open_rows = 0  # graph steps (and their query rows) in the window
        self._pending: _Pending | None = None  # an ended window's records, to commit
        self._deferring, self._ended = False, list[np.ndarray]()
        # the records' host copies (pinned on CUDA), reused by every window: `commit` reads
        # them before the next `_flush` overwrites them
        self._host = {i: (torch.empty(pages + 1, dtype=torch.int32, pin_memory=self._cuda),
                          torch.empty(pages + 1, dtype=torch.bool, pin_memory=self._cuda))
                      for i in offload.layers}  # fmt: skip
        self._mark = np.zeros(pages, np.bool_)  # `sync_table`'s scratch: all False between calls
        offload.on_begin.append(self.commit)
        for j in range(len(offload.layers)):  # the table starts as the coordinator's
            offload.touched[j].append(np.arange(pages, dtype=np.int64))
        if self._cuda:  # pragma: no cover - CUDA only
            self._warm_copies()

    def _warm_copies(self) -> None:  # pragma: no cover - CUDA only
        """Loads the commit's copy kernels now (lazily loaded, the first commit paid ~10 ms
        for them in a decode step): each buffer's sentinel slot copied onto itself, once with
        one index and once with many (`index_select` has a kernel for each)."""
        for buffer in self.offload.buffer.values():
            for n in (1, 64):
                slots = torch.full((n,), self.offload.device_pages, device=buffer.device)
                buffer.index_copy_(0, slots, buffer.index_select(0, slots))

    def _mirror(self, layer: int) -> torch.Tensor:
        host = self.offload.host[layer]
        if self.offload.device.type != "cuda":
            return host.view(-1, host.shape[-1])
        view = self.offload._mapped.get(layer)  # pragma: no cover - CUDA only
        if view is None:  # pragma: no cover - CUDA only
            view = mapped_view(host, self.offload.device)
        if view is None:  # pragma: no cover - CUDA only
            raise ZeroCopyUnavailable(
                "HiSparse graph decode reads missing pages from the pinned host mirror through a "
                "device view, and mapping it failed: run HiSparse eager (graph_decode=False)"
            )
        return view.view(-1, host.shape[-1])  # pragma: no cover - CUDA only

    def holds(self, layer: int) -> bool:
        return layer in self.table

    # -- inside the graph ------------------------------------------------------------------

    def store(self, layer: int, entry_slot: torch.Tensor, entries: torch.Tensor) -> None:
        """Writes the step's completed entries (``entry_slot``: virtual compressed slots, the
        mirror's sentinel for none) to the mirror and, for resident pages, to the buffer."""
        self._kernels.store_written(self.rows[layer], self.mirror[layer], self.table[layer],
                                    entry_slot, entries, self.wrote[layer], self.spp)  # fmt: skip

    def gather(
        self, source: int, slots: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, PoolRows]:
        """The entries at ``slots`` ``(N, k)`` (``valid``: a prefix of each row) of ``source``
        as a pool of ``N * k`` rows, query ``n`` reading rows ``[n * k, n * k + count)``."""
        n, k = slots.shape
        out = self._kernels.gather_selected(
            self.rows[source], self.mirror[source], self.table[source], slots.reshape(-1),
            valid.reshape(-1), self.reads[source], self.counts, self.spp,
        )  # fmt: skip
        table = torch.arange(n * k, device=slots.device).view(n, k)
        return out, PoolRows(table, valid.sum(-1))

    # -- outside the graph -----------------------------------------------------------------

    def before_step(self) -> None:
        """Before a graph step is loaded: copies drained, the pages the cache freed released
        (`C4Offload.begin_step`), the device tables current. An ended window is committed after
        this step is launched (`after_launch`), so the host plans while the device runs; an
        eager step's `begin_step` commits it first instead. Releases end the open window: its
        records belong to the lives that just ended."""
        self.offload.drain()
        self._deferring = True
        try:
            self.offload.begin_step()
        finally:
            self._deferring = False
        ended = self.offload.last_ended
        if len(ended) and self._open:
            self._flush()
        if self._pending is not None:  # their lives ended after the records were taken
            self._ended.append(ended)
        self.sync_table()

    def after_launch(self, rows: int) -> None:
        """Right after a graph step of ``rows`` query rows was launched (before its
        `after_step`): its records belong to the open window from now on (counted first, so
        that a commit that raises leaves them accounted for), then the last ended window is
        committed. Its copies and table changes are queued behind the launched step, which
        reads the tables as they were (exact: a mapped slot holds its page, every write goes
        through to the mirror), and the next step sees them. The open window stays open: its
        records would wait for the launched step."""
        self.stats.steps += 1
        self._open += 1
        self._open_rows += rows
        self._commit_pending()

    def after_step(self) -> None:
        """After the launched step's `after_launch`: the window ends (its records to the host,
        without waiting) after its ``commit_every``-th step, or when the next step's writes
        could take the pages the window wrote past the device buffer (a commit places every
        page its window wrote; a step writes at most one page per query row)."""
        if (
            self._open >= self.commit_every
            or self._open_rows + self.max_rows > self.offload.device_pages
        ):
            self._flush()

    def _flush(self) -> None:
        """Ends the open window: its records queued to the host buffers (an event marks them),
        the device records zeroed behind the copies for the next window."""
        if self._pending is not None:  # never two windows in flight: the host buffers are one
            self._commit_pending()
        nb = self._cuda
        for layer, (reads, wrote) in self._host.items():
            reads.copy_(self.reads[layer], non_blocking=nb)
            wrote.copy_(self.wrote[layer], non_blocking=nb)
            self.reads[layer].zero_()
            self.wrote[layer].zero_()
        event = None
        if self._cuda:  # pragma: no cover - CUDA only
            event = torch.cuda.Event()
            event.record()
        self._pending, self._open, self._open_rows = _Pending(event), 0, 0

    def commit(self) -> None:
        """Ends the open window and plans it (an eager step's `C4Offload.begin_step`: the
        records must be planned before the pages it releases are forgotten)."""
        if self._deferring:
            return
        if self._open:
            self._flush()
        self._commit_pending()

    def _commit_pending(self) -> None:
        """Plans the ended window's reads and writes with the coordinator (bounded swap-ins of
        its missed pages, its written pages placed), copies them mirror -> buffer and queues the
        device table's changes behind the copies."""
        if self._pending is None or self._deferring:
            return
        event = self._pending.event
        self._pending = None
        ended = np.concatenate([np.zeros(0, np.int64), *self._ended])
        self._ended.clear()
        if event is not None:  # pragma: no cover - CUDA only
            event.synchronize()
        pages = len(self._mark)
        for j, source in enumerate(self.offload.layers):
            reads, wrote = self._host[source]
            writes = np.flatnonzero(wrote.numpy()[:pages])
            if len(ended):  # pages released since: nothing to plan for them
                writes = writes[~np.isin(writes, ended)]
            counts = reads.numpy()[:pages]
            self._commit_layer(j, source, window_reads(counts, writes, ended), counts, writes)
        self.offload.lives.settle()  # every layer planned: the next commit may come before a begin
        self.stats.commits += 1
        self.sync_table()  # queued behind the copies, while the launched step still runs

    def _commit_layer(
        self, j: int, layer: int, pages: np.ndarray, counts: np.ndarray, writes: np.ndarray
    ) -> None:
        """``pages``: the distinct pages read (ascending), without ``writes`` (placed anyway)
        or pages released since; ``counts``: reads by page (`window_reads`). The plan keeps the
        most-read misses, then the most-read hits, that fit."""
        off, coord = self.offload, self.offload.coordinator
        resident = coord.resident(j, pages)
        hits, misses = pages[resident], pages[~resident]
        room = max(0, off.device_pages - len(writes))
        take = min(self.max_swaps, room, len(misses))
        self.stats.missed_pages += len(misses)
        self.stats.dropped_misses += len(misses) - take
        misses, hits = most_read(misses, counts, take), most_read(hits, counts, room - take)
        fresh = off.lives.fresh(writes)
        plan = coord.plan_step(j, np.concatenate((hits, misses)), writes, fresh)
        off.lives.wrote(writes)
        placed = np.asarray(plan.write_slots, dtype=np.int64)[fresh]
        src = np.concatenate((np.asarray(plan.swap_in.host_pages), writes[fresh]))
        dst = np.concatenate((np.asarray(plan.swap_in.device_slots), placed))
        if len(src):
            self._copy_pages(layer, src.astype(np.int64), dst.astype(np.int64))
        self.stats.swap_in_pages += len(src)
        coord.complete(plan.swap_in.ticket)  # copies ordered on the compute stream
        coord.complete(plan.backup.ticket)  # the mirror has every write already
        off.touched[j] += [plan.swap_in.host_pages, plan.evicted_pages, writes]

    def _copy_pages(self, layer: int, pages: np.ndarray, slots: np.ndarray) -> None:
        """Mirror pages -> buffer slots, on the current stream (before the next replay)."""
        both = torch.from_numpy(np.stack((pages, slots))).to(self.offload.device,
                                                             non_blocking=self._cuda)  # fmt: skip
        src, dst = both[0], both[1]
        pages_view = self._mirror_pages[layer]
        self.offload.buffer[layer].index_copy_(0, dst, pages_view.index_select(0, src))

    def sync_table(self) -> None:
        """The device tables of every page whose residency changed since the last call."""
        coord, dev = self.offload.coordinator, self.offload.device
        for j, layer in enumerate(self.offload.layers):
            parts = self.offload.touched[j]
            if not parts:
                continue
            pages = parts[0] if len(parts) == 1 else np.concatenate(parts)
            if len(pages) > len(self._mark):  # many repeats: the distinct ones, by a mask
                mark = self._mark  # (the coordinator's pages and released ones: in range)
                mark[pages] = True
                pages = np.flatnonzero(mark)
                mark[pages] = False
            # repeats are harmless: each gets the same (current) slot
            pages = pages.astype(np.int64, copy=False)
            parts.clear()
            slots = coord.slots(j, pages)
            both = torch.from_numpy(np.stack((pages, slots))).to(dev, non_blocking=self._cuda)
            self.table[layer][both[0]] = both[1]

    def hit_rate(self) -> tuple[int, int]:
        """(entries read from the buffer, entries read) over every graph step so far."""
        hit, read = self.counts.tolist()
        return int(hit), int(read)


def window_reads(counts: np.ndarray, writes: np.ndarray, ended: np.ndarray) -> np.ndarray:
    """The pages a window read (``counts``: reads by page id, zeroed here for ``writes`` and
    ``ended``), ascending, without ``writes`` (placed anyway) or ``ended`` (released)."""
    for drop in (writes, ended):
        if len(drop):
            counts[drop] = 0
    return np.flatnonzero(counts.astype(np.bool_))  # (a bool mask: twice as fast)


def most_read(pages: np.ndarray, counts: np.ndarray, n: int) -> np.ndarray:
    """The ``n`` of the ascending ``pages`` read most (``counts`` by page; ties: the lower page),
    in no particular order (their order plans nothing); all of them when they are at most ``n``."""
    if len(pages) <= n:
        return pages
    if n <= 0:
        return pages[:0]
    # linear where a sort of every miss cost the commit: the n-th most reads by a partition,
    # the pages read more, then the lowest of those read exactly that often
    reads = counts[pages]
    least = np.partition(reads, len(reads) - n)[len(reads) - n]
    more = np.flatnonzero(reads > least)
    tied = np.flatnonzero(reads == least)[: n - len(more)]
    return pages[np.concatenate((more, tied))]
