"""The few collectives context and tensor parallelism need, behind one small interface.

`DistComm` runs them on a `torch.distributed` process group (gloo on CPU, NCCL on GPUs: the
same calls). `ThreadWorld` runs a group of ranks as threads of one process with the same
semantics, so the CP/TP maths is testable in-process (and under coverage); the spawned gloo
tests run `DistComm`. Every rank calls every collective in the same order; ``exchange`` is
point to point and every rank knows what it sends and receives (sizes are never sent).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

T = TypeVar("T")


class Comm(Protocol):
    rank: int
    size: int

    def exchange(
        self, sends: dict[int, torch.Tensor], recv_rows: dict[int, int], like: torch.Tensor
    ) -> dict[int, torch.Tensor]:
        """Sends ``sends[dst]`` to each ``dst`` and receives ``recv_rows[src]`` rows shaped
        like ``like``'s rows from each ``src``; returns the received tensors by source."""
        ...

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape on every rank), by rank."""
        ...

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``t``, the same bits on every rank."""
        ...

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """``src``'s ``t`` on every rank (``t`` gives the shape elsewhere)."""
        ...


class DistComm:
    """`Comm` over a `torch.distributed` group (the default group when ``None``); ranks are
    the group's. Construction is itself a collective (a barrier: NCCL's first P2P call must
    not be one that some ranks skip)."""

    def __init__(self, group: ProcessGroup | None = None) -> None:  # pragma: no cover
        import torch.distributed as dist

        self._dist, self.group = dist, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        dist.barrier(group)

    def _global(self, rank: int) -> int:  # pragma: no cover - spawned ranks
        return rank if self.group is None else self._dist.get_global_rank(self.group, rank)

    def exchange(self, sends, recv_rows, like):  # type: ignore[no-untyped-def]  # pragma: no cover
        d = self._dist
        out = {s: like.new_empty((n, *like.shape[1:])) for s, n in recv_rows.items() if n}
        ops = [d.P2POp(d.isend, t.contiguous(), self._global(r), self.group)
               for r, t in sends.items() if t.shape[0]]  # fmt: skip
        ops += [d.P2POp(d.irecv, t, self._global(s), self.group) for s, t in out.items()]
        for work in d.batch_isend_irecv(ops) if ops else []:
            work.wait()
        return out

    def all_gather(self, t):  # type: ignore[no-untyped-def]  # pragma: no cover - spawned ranks
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self._dist.all_gather(parts, t.contiguous(), group=self.group)
        return parts

    def all_reduce_sum(self, t):  # type: ignore[no-untyped-def]  # pragma: no cover
        t = t.clone()
        self._dist.all_reduce(t, group=self.group)
        return t

    def broadcast(self, t, src):  # type: ignore[no-untyped-def]  # pragma: no cover
        t = t.clone().contiguous()
        self._dist.broadcast(t, self._global(src), group=self.group)
        return t


class ThreadWorld:
    """A group of ``size`` ranks that are threads of this process (`run` starts them)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a group needs at least one rank, got {size}")
        self.size = size
        self.barrier = threading.Barrier(size)
        self.slots: dict[tuple[int, int, int], torch.Tensor] = {}

    def run(self, fn: Callable[[ThreadComm], T]) -> list[T]:
        """``fn(comm)`` on every rank at once; the results by rank. The first exception any
        rank raises is re-raised (the others are released from their barrier)."""
        results: list[T | None] = [None] * self.size
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            try:
                results[rank] = fn(ThreadComm(self, rank))
            except threading.BrokenBarrierError:
                pass
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results  # type: ignore[return-value]


class ThreadComm:
    """One rank of a `ThreadWorld`. Each collective posts, waits for every rank, reads copies,
    and waits again before the poster forgets its posts."""

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self.world, self.rank, self.size = world, rank, world.size
        self._seq = 0

    def _round(self, posts: dict[int, torch.Tensor], reads: list[int]) -> dict[int, torch.Tensor]:
        """Posts ``posts[dst]``, then reads what each ``src`` in ``reads`` posted to us."""
        w, seq = self.world, self._seq
        self._seq += 1
        for dst, t in posts.items():
            w.slots[(seq, self.rank, dst)] = t
        w.barrier.wait()
        got = {src: w.slots[(seq, src, self.rank)].clone() for src in reads}
        w.barrier.wait()
        for dst in posts:
            del w.slots[(seq, self.rank, dst)]
        return got

    def exchange(
        self, sends: dict[int, torch.Tensor], recv_rows: dict[int, int], like: torch.Tensor
    ) -> dict[int, torch.Tensor]:
        got = self._round(dict(sends), [s for s, n in recv_rows.items() if n])
        for s, t in got.items():
            if t.shape[0] != recv_rows[s]:
                raise RuntimeError(f"rank {self.rank} expected {recv_rows[s]} rows from {s}")
        return got

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        got = self._round({dst: t for dst in range(self.size)}, list(range(self.size)))
        return [got[r] for r in range(self.size)]

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        parts = self.all_gather(t)
        total = parts[0].clone()
        for p in parts[1:]:  # rank order: every rank sums the same way
            total += p
        return total

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        return self.all_gather(t)[src]
