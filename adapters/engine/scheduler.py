"""Who runs and what each forward computes: the runner's scheduler. Torch-free (a test imports
it with torch blocked): it decides and allocates through the pure core, the model runner
executes what it hands out (`batch.ScheduledBatch`).

It owns the waiting queue (`waiting.WaitingQueue`: priority, then longest prefix first or
arrival) and the running set. One admission round (`admit`) admits in the queue's order while
a request has room for the whole of itself in both pools (admission control); a request that
shares a prefix with a running prefill waits for it (in-batch prefix sharing); a waiting request
preempts running ones of a lower priority for room. Every extend is `allocate`: the core's
`extend_batch` (or ``extend_draft_batch``) retried after making room when a pool runs out: the
starving pool first given the other's memory (``balance``, a `PoolBalance`), else a running
request preempted (the lowest priority, then the most recently admitted), else the re-balance
forced. Chunk budgeting (which replay slices, prompt chunks and decode rows fit this step) is
`chunks.StepBudget`.

Two ports connect it to the torch side, both set by the runner: ``on_rebalance`` applies a
`RebalanceReport` to the pools and device tables, and ``settle`` reads the decode step in flight
back (overlap scheduling) before one of its rows is preempted."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from adapters.engine.batch import BatchKind, ScheduledBatch, with_logit_rows
from adapters.engine.runner_stats import RunnerStats
from adapters.engine.sequence import _Seq
from adapters.engine.waiting import SchedulePolicy, WaitingQueue
from shadowradix import (
    CapacityError,
    ConfigError,
    MatchResult,
    RebalanceReport,
    ShadowRadixCache,
    StepPlan,
)

if TYPE_CHECKING:
    from adapters.memory.pool_balance import PoolBalance


@dataclass(frozen=True)
class SchedulerConfig:
    """The runner's limits the scheduler applies: prefill tokens per step, running requests,
    draft tokens a request may hold beyond its output (speculation), and the HiSparse device
    buffer's pages per C4 layer (0: no HiSparse) with the indexer's top-k. ``graph_reads``:
    graph decode / verify steps read the C4 KV through a `GraphResidency`, which reads
    non-resident pages from the host mirror, so only the pages they write must fit."""

    chunk_tokens: int
    max_running: int
    spec_tokens: int = 0
    device_pages: int = 0
    index_topk: int = 0
    graph_reads: bool = False

    @property
    def hisparse(self) -> bool:
        return self.device_pages > 0


class InFlight(Protocol):
    """The decode step in flight (overlap scheduling), as the scheduler sees it."""

    def row_of(self, seq: _Seq) -> int | None: ...


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    differ = a[:n] != b[:n]
    return int(differ.argmax()) if differ.any() else n


class Scheduler:
    """The waiting queue, the running set, admission, preemption and every extend."""

    #: In-batch prefix sharing: a waiting request whose prompt shares at least a page and 32
    #: tokens (SGLang's in-batch check threshold) beyond its cached hit with a running
    #: request's prompt that is still being prefilled waits (`_waits_for_a_prefill`); the
    #: running request publishes every chunk, so it is then admitted onto the whole shared
    #: prefix instead of computing it a second time.
    share_prefills: bool = True

    def __init__(
        self,
        cache: ShadowRadixCache,
        config: SchedulerConfig,
        stats: RunnerStats,
        schedule: SchedulePolicy = SchedulePolicy.LPM,
    ) -> None:
        self.cache, self.config, self.stats = cache, config, stats
        self.waiting = WaitingQueue(cache, schedule)
        self.running: list[_Seq] = []
        #: steps taken (admission order, the HiSparse decode rotation, re-balance cooldowns)
        self.clock = 0
        #: run-time SWA / full re-balancing (None: the split is fixed)
        self.balance: PoolBalance | None = None
        self.on_rebalance: Callable[[RebalanceReport], None] = lambda report: None
        #: overlap scheduling: the decode step in flight, and how to read it back
        self.inflight: InFlight | None = None
        self.settle: Callable[[], None] = lambda: None
        #: which rows' logits a batch asks for (`batch.with_logit_rows`; a benchmark may ask
        #: for more: `batch.with_every_row`)
        self.logit_rows: Callable[[ScheduledBatch], ScheduledBatch] = with_logit_rows

    # -- admission -------------------------------------------------------------------------

    def admit(self) -> None:
        """One scheduling round: the waiting requests in the queue's order (priority, then the
        schedule policy), each admitted while it has room (`_make_room`); the first that has
        none ends the round, so nothing behind it takes the room it waits for. A request that
        shares a prefix with a running prefill waits for it (`_waits_for_a_prefill`), keeping
        its place, and the round goes on."""
        self._observe_pools()
        top = self.waiting.top_priority
        if top is None or not self._may_admit(top):
            return  # no round: nothing would be admitted, nothing need be matched
        admitted: list[_Seq] = []
        for seq in self.waiting.order():
            match = self.waiting.match(seq)  # re-taken if an admission changed the tree
            if match.query_len and self._waits_for_a_prefill(seq, match.hit_len):
                self.stats.shared_prefill_waits += 1
                continue
            if not self._make_room(seq):
                break
            self._start(seq, self.waiting.match(seq))  # preemption may have changed the tree
            admitted.append(seq)
        self.waiting.end_round(admitted)

    def _start(self, seq: _Seq, match: MatchResult) -> None:
        """Admits ``seq`` on ``match``: off the queue, into the running set."""
        # cannot raise CapacityError for a replayed window: `_fits` (or, with nothing
        # running, an all-evictable SWA pool) leaves room for a window and a chunk
        seq.request = self.cache.admit(seq.tokens, match)
        seq.result.cached_tokens = max(seq.result.cached_tokens, match.hit_len)
        if match.hit_len and self.stats.tail_skipped_tokens:  # the prefix may hold holes
            seq.result.approximate = True
        seq.admitted_at = self.clock
        if seq.request.replay_allocation is not None:
            seq.replay_at = seq.request.replay_allocation.starts[0]
            self.stats.replayed_hits += 1
        self.waiting.remove(seq)
        self.running.append(seq)

    def _may_admit(self, priority: int) -> bool:
        """Whether a request of ``priority`` could get a running slot now (a free one, or a
        lower-priority request's)."""
        return len(self.running) < self.config.max_running or any(
            s.priority < priority for s in self.running
        )

    def _make_room(self, seq: _Seq) -> bool:
        """Whether ``seq`` can be admitted now: a free running slot and, unless nothing runs,
        room for the whole request (`_fits`). Running requests of a lower priority are
        preempted for it (the youngest of the lowest first); one of its own priority or higher
        never is. False if it still lacks room."""
        limit = self.config.max_running
        while len(self.running) >= limit or (self.running and not self._fits(seq)):
            if len(self.running) < limit and self._rebalance_for(seq):
                continue
            victim = self._victim(below=seq.priority)
            if victim is None:
                return False
            self.requeue(victim)
        return True

    def _waits_for_a_prefill(self, seq: _Seq, hit_len: int) -> bool:
        """Whether a running request, still prefilling, has yet to compute at least a page and
        32 tokens of ``seq``'s prompt beyond its cached ``hit_len`` (of their prompts' common
        prefix)."""
        if not self.share_prefills:
            return False
        page = max(self.cache.config.page_size, 32)
        for other in self.running:
            if other.decoding or other.req.length >= len(other.result.prompt):
                continue
            shared = _common_prefix(seq.prompt_array(), other.prompt_array())
            if shared >= hit_len + page and other.req.length < shared:
                return True
        return False

    def _fits(self, seq: _Seq) -> bool:
        """Admission control: room for the whole request in both pools right now."""
        return self._shortfall(seq) == (0, 0)

    def _shortfall(self, seq: _Seq) -> tuple[int, int]:
        """Pages (full, SWA) ``seq`` lacks for admission: the whole request in the full pool, a
        chunk and its window in the SWA pool, beyond what is free or evictable now."""
        st, p, cfg = self.cache.stats(), self.cache.config.page_size, self.config
        need = -(-(seq.num_tokens + seq.params.max_new_tokens + cfg.spec_tokens) // p)
        full_room = st.full.free_pages + st.full.evictable_pages
        swa_room = st.swa.free_pages + st.swa.evictable_pages
        window = self.cache.config.window + min(cfg.chunk_tokens, seq.num_tokens)
        return max(0, need - full_room), max(0, -(-window // p) + 1 - swa_room)

    # -- pool re-balancing -----------------------------------------------------------------

    def _rebalance_for(self, seq: _Seq) -> bool:
        """Whether a re-balance now gives ``seq`` the room it lacks in one pool (only one may
        starve: the other gives)."""
        full, swa = self._shortfall(seq)
        if full and swa:
            return False
        return self._rebalance("full" if full else "swa", max(full, swa))

    def _observe_pools(self) -> None:
        """Once a round: a pool that evicts what it still needs while the other holds slack
        gets the other's memory (`PoolBalance.observe`)."""
        if self.balance is None or not self._can_rebalance():
            return
        seen = self.balance.observe(self.cache.stats(), self.cache.eviction_ages(), self.clock)
        if seen is not None:
            self._apply_plan(seen[0], seen[1])

    def _can_rebalance(self) -> bool:
        return not self.config.hisparse and self.inflight is None

    def _rebalance(self, short_pool: str, shortfall_pages: int, force: bool = False) -> bool:
        """Give ``short_pool`` at least ``shortfall_pages`` more pages of the other pool's
        memory (`PoolBalance.plan`): the cache evicts and relocates, ``on_rebalance`` moves
        the rows and updates the device tables. Whether it did. Never with HiSparse (its host
        mirror and device buffer are keyed by page) nor with a step in flight (that step reads
        the pools as they are). ``force``: even right after the opposite move."""
        if self.balance is None or shortfall_pages <= 0 or not self._can_rebalance():
            return False
        stats = self.cache.stats()
        plan = self.balance.plan(stats, short_pool, shortfall_pages, self.clock, force)
        return plan is not None and self._apply_plan(short_pool, plan)

    def _apply_plan(self, short_pool: str, plan: tuple[int, int]) -> bool:
        """`ShadowRadixCache.rebalance` to ``plan``, then ``on_rebalance`` of its report."""
        assert self.balance is not None
        try:
            report = self.cache.rebalance(full_capacity=plan[0], swa_capacity=plan[1])
        except (CapacityError, ConfigError):
            return False
        self.on_rebalance(report)
        self.balance.applied(self.clock, short_pool)
        self.stats.rebalances += 1
        self.stats.rebalance_moved_pages += len(report.full_moves) + len(report.swa_moves)
        return True

    # -- preemption ------------------------------------------------------------------------

    def _preempt(self) -> bool:
        """Requeues a running request to free its pages (`_victim`); False if none can yield
        (fewer than two run)."""
        victim = self._victim()
        if victim is None or len(self.running) <= 1:
            return False
        self.requeue(victim)
        return True

    def _victim(self, below: int | None = None) -> _Seq | None:
        """The running request to preempt: of the lowest priority, the most recently admitted
        (of one step's admissions, the last); with ``below``, only among those of a priority
        lower than it. None if none is."""
        ranked = [
            (-s.priority, s.admitted_at, i, s)
            for i, s in enumerate(self.running)
            if below is None or s.priority < below
        ]
        return max(ranked, key=lambda r: r[:3])[3] if ranked else None

    def requeue(self, victim: _Seq) -> None:
        """Preempts ``victim``: its cache request aborted (pages it published stay cached), its
        prompt and output back in the queue at its rank. A row of the step in flight is read
        back first (``settle``), so that it requeues with its last token, or is left alone if
        that token finished it."""
        if self.inflight is not None and self.inflight.row_of(victim) is not None:
            self.settle()
            if victim.request is None:
                return
        self.running.remove(victim)
        assert victim.request is not None
        self.cache.abort(victim.request)
        victim.request = None
        victim.replay_at = None
        victim.result.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.push(victim)

    # -- extends ---------------------------------------------------------------------------

    def allocate(
        self, kind: BatchKind, seqs: Sequence[_Seq], chunks: Sequence[list[int]]
    ) -> ScheduledBatch | None:
        """The batch of ``seqs`` computing ``chunks``: ``extend_batch`` (``extend_draft_batch``
        for a verify batch) that makes room (`_yield_room`) until it fits; requests preempted
        on the way leave the batch. None if none is left; `CapacityError` if nothing can
        yield."""
        draft = kind is BatchKind.VERIFY
        while True:
            live = [(s, c) for s, c in zip(seqs, chunks) if s.request is not None]
            if not live:
                return None
            seqs, chunks = [s for s, _ in live], [c for _, c in live]
            try:
                extend = self.cache.extend_draft_batch if draft else self.cache.extend_batch
                plan = extend([s.req for s in seqs], chunks)
            except CapacityError as err:
                self._yield_room(err)
                continue
            return self.logit_rows(ScheduledBatch(kind, tuple(seqs), tuple(chunks), plan))

    def extend_pending(self, seqs: list[_Seq]) -> tuple[list[_Seq], StepPlan | None]:
        """`extend_pending_batch` (overlap scheduling: one token each whose value is not known
        yet) that makes room as `allocate` does until it fits."""
        while True:
            live = [s for s in seqs if s.request is not None]
            if not live:
                return [], None
            try:
                return live, self.cache.extend_pending_batch([s.req for s in live])
            except CapacityError as err:
                self._yield_room(err)

    def _yield_room(self, err: CapacityError) -> None:
        """After an extend failed with ``err``: the starving pool given the other's memory, else
        a request preempted, else the re-balance forced; re-raises ``err`` if none frees room."""
        short = err.needed_pages - err.available_pages
        if self._rebalance(err.pool, short) or self._preempt():
            return
        if not self._rebalance(err.pool, short, force=True):
            raise err

    # -- leaving the running set -----------------------------------------------------------

    def finish(self, seq: _Seq) -> None:
        """Finishes the running ``seq`` in the cache (its committed pages inserted) and takes
        it off the running set."""
        assert seq.request is not None
        self.cache.finish(seq.request)
        seq.request = None
        self.running.remove(seq)
        self.stats.approximate_results += seq.result.approximate

    def release(self, seq: _Seq) -> None:
        """Takes the running ``seq`` off the running set with its cache request aborted (what
        it had published stays cached): a request whose forward failed."""
        assert seq.request is not None
        self.cache.abort(seq.request)
        seq.request = None
        seq.replay_at = None
        self.running.remove(seq)
