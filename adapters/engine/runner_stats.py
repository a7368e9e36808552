"""The runner's counters (`RunnerStats`), read by callers and bumped by the runner's roles and
by speculative decoding."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RunnerStats:
    """Counters. Tail-only: ``tail_only_forwards`` prefill forwards skipped some tokens past
    the last KV-source layer, ``tail_skipped_tokens`` of them in all."""

    steps: int = 0
    #: prompt tokens computed, tokens decode forwards computed, output tokens generated (a
    #: request's first comes from its last prefill chunk; a speculative step emits several)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    tail_only_forwards: int = 0
    tail_skipped_tokens: int = 0
    forward_s: float = 0.0
    schedule_s: float = 0.0
    #: admissions served by bounded replay, and the window tokens their replays recomputed
    replayed_hits: int = 0
    replayed_tokens: int = 0
    #: finished results flagged ``approximate``
    approximate_results: int = 0
    #: admissions deferred a step because a running prefill was computing their prefix
    shared_prefill_waits: int = 0
    #: requests finished with an error because a forward over them raised
    failed_requests: int = 0
    #: run-time SWA / full re-balances (`Runner.pool_balance`), and the pages they moved
    rebalances: int = 0
    rebalance_moved_pages: int = 0
    #: overlap scheduling: decode steps launched overlapped, decode steps of an overlapping
    #: runner that ran serialised (a non-greedy request, ``on_logits``), and pending tokens
    #: dropped because their request had stopped one step earlier (computed, never kept)
    overlapped_steps: int = 0
    serialised_steps: int = 0
    late_stop_tokens: int = 0


@dataclass(frozen=True)
class ExecutionPaths:
    """Which code ran, so that no fallback is silent (`Runner.paths`, the run summary):
    ``kernels``: ``triton`` (the fused kernels) or ``torch`` (their references: a CPU run, or
    no Triton); ``decode``: ``cuda graphs``, ``eager`` (the graph decoder without capture),
    ``paged`` (the paged path: HiSparse, or graphs off) or ``speculative``; ``hisparse_copies``:
    `C4Offload.copy_path` (None without HiSparse); ``scheduling``: ``overlapped`` (the host
    schedules decode step N+1 while the device runs step N) or ``serialised``."""

    kernels: str
    decode: str
    hisparse_copies: str | None = None
    scheduling: str = "serialised"
