"""Runs a function on ``world_size`` freshly spawned gloo ranks of this machine (tests, CPU
benchmarks); `torchrun` does the same job for NCCL runs (bench/launch/)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.multiprocessing as mp

#: imported once by the fork server, so that each rank starts as a fork of a process that has
#: torch and the model loaded (a fresh interpreter per rank costs seconds of CPU) and has run
#: no parallel region (forking after one is not safe)
PRELOAD = (
    "torch",
    "adapters.distributed.cp",
    "adapters.distributed.tp",
    "adapters.model.reference",
)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the rendezvous of one spawned group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_gloo(
    fn: Callable[..., None], world_size: int, args: tuple = (), timeout_s: float = 120.0
) -> None:
    """``fn(rank, *args)`` on each of ``world_size`` new processes (forked from one fork
    server), inside an initialised gloo default group (one intra-op thread each); returns when
    all have finished. ``fn`` must be importable (module level). A rank's exception is
    re-raised here (`torch.multiprocessing.ProcessRaisedException`)."""
    mp.set_forkserver_preload(list(PRELOAD))
    mp.start_processes(
        _entry,
        args=(fn, world_size, free_port(), args, timeout_s),
        nprocs=world_size,
        start_method="forkserver",
        join=True,
    )


def _entry(  # pragma: no cover - runs in the spawned ranks
    rank: int, fn: Callable[..., None], world_size: int, port: int, args: tuple, timeout_s: float
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()
