"""The waiting queue of `Runner`: requests not yet admitted, ranked by priority (higher first),
then by arrival; and the order a scheduling round tries them in under a `SchedulePolicy`.

Longest-prefix-first (`SchedulePolicy.LPM`, SGLang's "lpm") tries first, within a priority, the
request with the longest cached prefix: it is admitted before a prompt that would evict that
prefix, and it costs the least to compute. Its cost is bounded two ways: a round examines only
the first ``window`` requests of the queue (the rest follow in arrival order), and a request's
match is kept until the radix tree changes (every `MatchResult` records the tree's version).
A head of the queue passed over ``max_overtakes`` times goes first, so no request starves
behind a stream of better-matching ones."""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from enum import Enum

import numpy as np

from adapters.engine.sequence import _Seq
from shadowradix import MatchResult, ShadowRadixCache

#: an empty match reports the tree's current version in O(1)
_PROBE = np.zeros(1, dtype=np.int64)


class SchedulePolicy(Enum):
    """Which waiting request a round admits first, after priority."""

    #: the longest cached prefix first (ties: arrival order)
    LPM = "lpm"
    #: arrival order (first come, first served)
    FCFS = "fcfs"


def _rank(seq: _Seq) -> tuple[int, int]:
    return (-seq.priority, seq.result.request_id)


class WaitingQueue:
    """Requests waiting for admission, kept sorted by (priority descending, request id)."""

    #: LPM matches at most this many requests a round: the first ones in (priority, arrival)
    #: order; the others keep that order behind them
    window: int = 128
    #: LPM admits the head of the queue first once this many requests overtook it
    max_overtakes: int = 16

    def __init__(self, cache: ShadowRadixCache, policy: SchedulePolicy) -> None:
        if not isinstance(policy, SchedulePolicy):
            raise ValueError(f"schedule must be a SchedulePolicy, got {policy!r}")
        self.cache, self.policy = cache, policy
        self._seqs: list[_Seq] = []
        self._head: _Seq | None = None

    def __len__(self) -> int:
        return len(self._seqs)

    def __iter__(self) -> Iterator[_Seq]:
        return iter(list(self._seqs))

    @property
    def top_priority(self) -> int | None:
        """The highest priority waiting (None: nothing waits)."""
        return self._seqs[0].priority if self._seqs else None

    def push(self, seq: _Seq) -> None:
        """Queues ``seq`` at its rank (a preempted request keeps its place by arrival). Its
        tokens may have grown since it was last matched: the match is dropped."""
        seq.match = None
        bisect.insort(self._seqs, seq, key=_rank)

    def remove(self, seq: _Seq) -> None:
        """Takes ``seq`` (an admitted request) off the queue."""
        index = next(i for i, s in enumerate(self._seqs) if s is seq)
        del self._seqs[index]

    def order(self) -> list[_Seq]:
        """This round's admission order: by priority, then the policy (see the module)."""
        self._head = self._seqs[0] if self._seqs else None
        if self.policy is SchedulePolicy.FCFS or len(self._seqs) <= 1:
            return list(self._seqs)
        version = self._version()
        head = self._seqs[: self.window]

        def key(item: tuple[int, _Seq]) -> tuple[int, bool, int, int]:
            i, seq = item
            starved = seq.overtaken >= self.max_overtakes
            return (-seq.priority, not starved, -self.match(seq, version).hit_len, i)

        ranked = [seq for _, seq in sorted(enumerate(head), key=key)]
        return ranked + self._seqs[self.window :]

    def match(self, seq: _Seq, version: int | None = None) -> MatchResult:
        """``seq``'s current cached prefix (one token is always left to compute, none with
        prompt logprobs); re-matched only when the tree changed since the kept one."""
        if version is None:
            version = self._version()
        if seq.match is not None and seq.match.version == version:
            return seq.match
        tokens = seq.tokens
        keep = 0 if seq.params.prompt_logprobs else len(tokens) - 1
        namespace = seq.params.cache_namespace  # a forced replay's own (SamplingParams)
        seq.match = self.cache.match_prefix(tokens, max_len=keep, namespace=namespace)
        return seq.match

    def end_round(self, admitted: list[_Seq]) -> None:
        """Counts an overtake of the round's head when a request of its priority went first."""
        head = self._head
        if head is None or any(s is head for s in admitted):
            return
        if any(s.priority == head.priority for s in admitted):
            head.overtaken += 1

    def _version(self) -> int:
        return self.cache.match_prefix(_PROBE, max_len=0).version
