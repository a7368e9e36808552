"""Who runs, a role of `Runner`: a request's checks at submission, admission in the waiting
queue's order (`waiting.WaitingQueue`: priority, then longest prefix first or arrival) with
admission control (room for the whole request in both pools), preemption (the lowest priority,
then the most recently admitted) when an extend runs out of pages or a higher-priority request
waits for room, and how many tokens fit the HiSparse device buffer. With a `PoolBalance`
(``pool_balance``), a pool that starves while the other has room is first given the other's
memory (`_rebalance`); only then are requests preempted."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np

from adapters.engine.runner_base import RunnerBase
from adapters.engine.sampling import SamplingParams
from adapters.engine.sequence import _Seq
from adapters.memory.pool_balance import PoolBalance
from adapters.memory.pool_resize import apply_rebalance
from shadowradix import CapacityError, ConfigError, InvalidRequestError, MatchResult


def _token(t: object) -> int:
    """An int token id; floats, strings and bools are refused, not coerced."""
    if isinstance(t, (bool, np.bool_)):
        raise TypeError(f"{t!r} is a bool")
    return operator.index(t)  # type: ignore[arg-type]


def check_priority(priority: object) -> int:
    """A request's priority: an int (higher runs first); `InvalidRequestError` otherwise."""
    if isinstance(priority, (bool, np.bool_)):
        raise InvalidRequestError(f"priority must be an int, got {priority!r}")
    try:
        return operator.index(priority)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidRequestError(f"priority must be an int, got {priority!r}") from None


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    differ = a[:n] != b[:n]
    return int(differ.argmax()) if differ.any() else n


class UnsupportedRequestError(InvalidRequestError):
    """The request asks for something the runner's mode cannot give: prompt logprobs under
    tail-only prefill (the later layers never see most prompt positions)."""


class Admission(RunnerBase):
    """Submission checks, admission, preemption and the HiSparse fit of the runner."""

    def _validate(self, prompt: Sequence[int], params: SamplingParams) -> list[int]:
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be SamplingParams")
        if params.prompt_logprobs and self.tail_only:
            raise UnsupportedRequestError(
                "prompt_logprobs is not supported with tail-only prefill: the layers after the "
                "last KV source compute only the last window of each chunk"
            )
        if isinstance(prompt, (str, bytes)):
            raise InvalidRequestError("prompt must be a sequence of token ids (encode text first)")
        try:
            tokens = [_token(t) for t in prompt]
        except TypeError as exc:
            raise InvalidRequestError(f"prompt must be a sequence of ints: {exc}") from None
        if not tokens:
            raise InvalidRequestError("empty prompt")
        vocab = self.model.vocab_size
        if min(tokens) < 0 or max(tokens) >= vocab:
            raise InvalidRequestError(f"prompt tokens must be in [0, {vocab})")
        total = len(tokens) + params.max_new_tokens + self.spec_tokens
        if total > self.cache.config.full_capacity:
            raise InvalidRequestError(
                f"prompt + max_new_tokens (+ {self.spec_tokens} draft tokens) = {total} tokens "
                f"exceeds the full pool ({self.cache.config.full_capacity} tokens): "
                "it could never run"
            )
        self.memory.check(total, 1 + self.spec_tokens)
        return tokens

    #: In-batch prefix sharing: a waiting request whose prompt shares at least a page and 32
    #: tokens (SGLang's in-batch check threshold) beyond its cached hit with a running
    #: request's prompt that is still being prefilled waits
    #: (`_waits_for_a_prefill`); the running request publishes every chunk, so it is then
    #: admitted onto the whole shared prefix instead of computing it a second time.
    share_prefills: bool = True

    def _admit(self) -> None:
        """One scheduling round: the waiting requests in the queue's order (priority, then the
        schedule policy), each admitted while it has room (`_make_room`); the first that has
        none ends the round, so nothing behind it takes the room it waits for. A request that
        shares a prefix with a running prefill waits for it (`_waits_for_a_prefill`), keeping
        its place, and the round goes on."""
        self._observe_pools()
        top = self._waiting.top_priority
        if top is None or not self._may_admit(top):
            return  # no round: nothing would be admitted, nothing need be matched
        admitted: list[_Seq] = []
        for seq in self._waiting.order():
            match = self._waiting.match(seq)  # re-taken if an admission changed the tree
            if match.query_len and self._waits_for_a_prefill(seq, match.hit_len):
                self.stats.shared_prefill_waits += 1
                continue
            if not self._make_room(seq):
                break
            self._start(seq, self._waiting.match(seq))  # preemption may have changed the tree
            admitted.append(seq)
        self._waiting.end_round(admitted)

    def _start(self, seq: _Seq, match: MatchResult) -> None:
        """Admits ``seq`` on ``match``: off the queue, into the running set."""
        # cannot raise CapacityError for a replayed window: `_fits` (or, with nothing
        # running, an all-evictable SWA pool) leaves room for a window and a chunk
        seq.request = self.cache.admit(seq.tokens, match)
        seq.result.cached_tokens = max(seq.result.cached_tokens, match.hit_len)
        if match.hit_len and self.stats.tail_skipped_tokens:  # the prefix may hold holes
            seq.result.approximate = True
        seq.admitted_at = self._clock
        if seq.request.replay_allocation is not None:
            seq.replay_at = seq.request.replay_allocation.starts[0]
            self.stats.replayed_hits += 1
        self._waiting.remove(seq)
        self._running.append(seq)

    def _may_admit(self, priority: int) -> bool:
        """Whether a request of ``priority`` could get a running slot now (a free one, or a
        lower-priority request's)."""
        return len(self._running) < self.max_running or any(
            s.priority < priority for s in self._running
        )

    def _make_room(self, seq: _Seq) -> bool:
        """Whether ``seq`` can be admitted now: a free running slot and, unless nothing runs,
        room for the whole request (`_fits`). Running requests of a lower priority are
        preempted for it (the youngest of the lowest first); one of its own priority or higher
        never is. False if it still lacks room."""
        while len(self._running) >= self.max_running or (self._running and not self._fits(seq)):
            if len(self._running) < self.max_running and self._rebalance_for(seq):
                continue
            victim = self._victim(below=seq.priority)
            if victim is None:
                return False
            self._requeue(victim)
        return True

    def _waits_for_a_prefill(self, seq: _Seq, hit_len: int) -> bool:
        """Whether a running request, still prefilling, has yet to compute at least a page and
        32 tokens of ``seq``'s prompt beyond its cached ``hit_len`` (of their prompts' common
        prefix)."""
        if not self.share_prefills:
            return False
        page = max(self.cache.config.page_size, 32)
        for other in self._running:
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
        st, p = self.cache.stats(), self.cache.config.page_size
        need = -(-(seq.num_tokens + seq.params.max_new_tokens + self.spec_tokens) // p)
        full_room = st.full.free_pages + st.full.evictable_pages
        swa_room = st.swa.free_pages + st.swa.evictable_pages
        window_pages = -(-(self.cache.config.window + min(self.chunk_tokens, seq.num_tokens)) // p)
        return max(0, need - full_room), max(0, window_pages + 1 - swa_room)

    #: run-time SWA / full re-balancing (`pool_balance.PoolBalance`; None: the split is fixed)
    pool_balance: PoolBalance | None = None

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
        balance = self.pool_balance
        if balance is None or not self._can_rebalance():
            return
        seen = balance.observe(self.cache.stats(), self.cache.eviction_ages(), self._clock)
        if seen is not None:
            self._apply_plan(seen[0], seen[1])

    def _can_rebalance(self) -> bool:
        return self.offload is None and getattr(self, "_inflight", None) is None

    def _rebalance(self, short_pool: str, shortfall_pages: int, force: bool = False) -> bool:
        """Give ``short_pool`` at least ``shortfall_pages`` more pages of the other pool's
        memory (`PoolBalance.plan`): the cache evicts and relocates, the pools copy the moved
        pages and resize, the device tables get the deltas. Whether it did. Never with HiSparse
        (its host mirror and device buffer are keyed by page) nor with a step in flight
        (overlap scheduling: that step reads the pools as they are). ``force``: even right
        after the opposite move (`PoolBalance.plan`)."""
        balance = self.pool_balance
        if balance is None or shortfall_pages <= 0 or not self._can_rebalance():
            return False
        stats = self.cache.stats()
        plan = balance.plan(stats, short_pool, shortfall_pages, self._clock, force)
        return plan is not None and self._apply_plan(short_pool, plan)

    def _apply_plan(self, short_pool: str, plan: tuple[int, int]) -> bool:
        """`ShadowRadixCache.rebalance` to ``plan``, applied to the pools and device tables."""
        balance = self.pool_balance
        assert balance is not None
        try:
            report = self.cache.rebalance(full_capacity=plan[0], swa_capacity=plan[1])
        except (CapacityError, ConfigError):
            return False
        apply_rebalance(self.pools, report)
        if self.spec is not None:
            self.spec._note(report.deltas)
        elif self.decoder is not None:
            self._table_deltas += report.deltas
        balance.applied(self._clock, short_pool)
        self.stats.rebalances += 1
        self.stats.rebalance_moved_pages += len(report.full_moves) + len(report.swa_moves)
        return True

    def _preempt(self) -> bool:
        """Requeues a running request to free its pages (`_victim`); False if none can yield
        (fewer than two run)."""
        victim = self._victim()
        if victim is None or len(self._running) <= 1:
            return False
        self._requeue(victim)
        return True

    def _victim(self, below: int | None = None) -> _Seq | None:
        """The running request to preempt: of the lowest priority, the most recently admitted
        (of one step's admissions, the last); with ``below``, only among those of a priority
        lower than it. None if none is."""
        ranked = [
            (-s.priority, s.admitted_at, i, s)
            for i, s in enumerate(self._running)
            if below is None or s.priority < below
        ]
        return max(ranked, key=lambda r: r[:3])[3] if ranked else None

    def _requeue(self, victim: _Seq) -> None:
        """Preempts ``victim``: its cache request aborted (pages it published stay cached), its
        prompt and output back in the queue at its rank."""
        self._running.remove(victim)
        assert victim.request is not None
        self.cache.abort(victim.request)
        victim.request = None
        victim.replay_at = None
        victim.result.preemptions += 1
        self.stats.preemptions += 1
        self._waiting.push(victim)

    def _extend(self, seqs: list[_Seq], chunks: list[list[int]], draft: bool = False):
        """``extend_batch`` (``extend_draft_batch`` for a ``draft``) that preempts other requests
        until it fits. Returns the surviving (seqs, chunks) and the allocation, or raises
        `CapacityError` if nothing can yield."""
        while True:
            live = [(s, c) for s, c in zip(seqs, chunks) if s.request is not None]
            if not live:
                return [], [], None
            seqs, chunks = [s for s, _ in live], [c for _, c in live]
            try:
                extend = self.cache.extend_draft_batch if draft else self.cache.extend_batch
                alloc = extend([s.req for s in seqs], chunks)
                return seqs, chunks, alloc
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

    def _working_set(self, seq: _Seq, num_tokens: int) -> int:
        """Upper bound of the C4 pages one request's ``num_tokens`` new queries read (HiSparse):
        each reads top-k entries, and no request reads more pages than it has."""
        pages = -(-(seq.req.length + num_tokens) // self.cache.config.page_size)
        return min(num_tokens * self.model.index_topk, pages)

    def _fit_tokens(self, seq: _Seq, wanted: int, pages_left: int) -> int:
        """How many of ``wanted`` tokens fit in the HiSparse device buffer's remaining pages."""
        if self.offload is None or self._working_set(seq, wanted) <= pages_left:
            return wanted
        return min(wanted, pages_left // self.model.index_topk)
