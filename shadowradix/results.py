"""Typed records the cache returns. Slot arrays are int64 numpy arrays, one entry per row."""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .deltas import PageTableDelta, step_deltas
from .errors import InvalidRequestError
from .node import Node


class WindowSource(enum.Enum):
    """Where the SWA window (and in-flight rows) before a match's end comes from."""

    #: The match is empty: nothing to attend to.
    NONE = "none"
    #: The last ``window`` tokens before the end are live SWA in the tree.
    LIVE = "live"
    #: Bounded replay recomputes them (an approximation; counted as misses).
    REPLAY = "replay"


@dataclass(frozen=True, eq=False)
class MatchResult:
    """Outcome of `ShadowRadixCache.match_prefix`.

    ``cached_len``: the page-aligned prefix whose compressed KV the tree holds.
    ``prefix_len``: where the request resumes (``cached_len`` with replay, else the deepest
    boundary whose window is live). ``hit_len``: tokens whose computation is skipped; replayed
    tokens are not hits. ``replay_start``: first replayed position (``None`` without replay).
    """

    query_len: int
    cached_len: int
    prefix_len: int
    hit_len: int
    window: WindowSource
    replay_start: int | None
    node: Node
    node_pages: int
    version: int
    tokens: np.ndarray = field(repr=False)
    #: the reused prefix holds state derived from a bounded replay (this one or an earlier
    #: request's): reuse is then not bit-identical to recomputation
    approximate: bool = False
    #: the cache that produced the match (`admit` refuses another cache's match)
    owner: object = field(repr=False, default=None)
    #: the namespace it was matched in (`match_prefix`'s ``namespace``)
    namespace: Hashable = None
    #: set by `match_prefix` only, never by ``__init__``: a copy made with
    #: ``dataclasses.replace`` (or built by hand) has none, and `admit` refuses it
    _seal: object = field(init=False, repr=False, default=None)
    #: the deepest node the match walked into (the root when none), set with ``_seal``: from
    #: it `admit` re-checks the path instead of walking the tokens again
    _walk_end: Node | None = field(init=False, repr=False, default=None, compare=False)
    #: the validated array ``tokens`` was cut from (``max_len``), set with ``_seal``: `admit`
    #: given that very array skips comparing the prefix with itself
    _source: object = field(init=False, repr=False, default=None, compare=False)

    @property
    def replayed_len(self) -> int:
        return 0 if self.replay_start is None else self.prefix_len - self.replay_start

    @property
    def is_replay(self) -> bool:
        return self.window is WindowSource.REPLAY


@dataclass(frozen=True)
class StreamWrites:
    """One compressed stream's part of an `Allocation` (all its layers share these slots).

    ``ring_request`` / ``ring_positions`` / ``ring_rows``: in-flight rows to store (only those a
    later step or a match can still need, so no two collide). ``carry_positions`` / ``carry_rows`` /
    ``carry_request``: in-flight rows from earlier steps that the groups completing now read.
    ``entry_groups`` / ``entry_slots`` / ``entry_request``: compressed entries completed now
    (group index within its request, pool slot, index into ``Allocation.request_ids``).
    """

    ratio: int
    ring_request: np.ndarray
    ring_positions: np.ndarray
    ring_rows: np.ndarray
    carry_request: np.ndarray
    carry_positions: np.ndarray
    carry_rows: np.ndarray
    entry_request: np.ndarray
    entry_groups: np.ndarray
    entry_slots: np.ndarray

    def __post_init__(self) -> None:
        _read_only((self.ring_request, self.ring_positions, self.ring_rows, self.carry_request,
                    self.carry_positions, self.carry_rows, self.entry_request, self.entry_groups,
                    self.entry_slots))  # fmt: skip


@dataclass(frozen=True)
class EvictionReport:
    full_pages: int = 0
    swa_pages: int = 0
    nodes_removed: int = 0
    nodes_tombstoned: int = 0

    def __add__(self, other: EvictionReport) -> EvictionReport:
        return EvictionReport(
            self.full_pages + other.full_pages,
            self.swa_pages + other.swa_pages,
            self.nodes_removed + other.nodes_removed,
            self.nodes_tombstoned + other.nodes_tombstoned,
        )


@dataclass(frozen=True)
class StepArrays:
    """The per-token arrays of an `Allocation` (see there)."""

    token_offsets: np.ndarray
    positions: np.ndarray
    virtual_slots: np.ndarray
    swa_slots: np.ndarray
    streams: tuple[StreamWrites, ...]

    def __post_init__(self) -> None:
        _read_only((self.token_offsets, self.positions, self.virtual_slots, self.swa_slots))


class Allocation:
    """What each pool must write for the new tokens of one step (one or many requests).

    Per request ``i`` of ``request_ids``: new positions ``[starts[i], ends[i])``. Per token
    (concatenated over requests, ``token_offsets[i]:token_offsets[i+1]`` for request ``i``):
    ``positions``, ``virtual_slots``, ``swa_slots``; per compressed stream a `StreamWrites`.
    ``replay`` marks the window rebuild of a replayed hit: it writes SWA and rings only.

    The per-token arrays are derived on first access from a compact copy of the page tables
    taken at allocation time, then cached: an engine that derives slots on the device from raw
    batch state (as DeepSeek-V4 serving does for CUDA graphs) never pays for them on the CPU.
    The allocation stays valid after later cache operations.
    """

    __slots__ = ("request_ids", "starts", "ends", "evicted", "replay", "_expand", "_arrays")

    def __init__(
        self,
        request_ids: tuple[int, ...],
        starts: Sequence[int],
        ends: Sequence[int],
        evicted: EvictionReport,
        replay: bool,
        expand: Callable[[], StepArrays],
    ) -> None:
        self.request_ids = request_ids
        self.starts = starts
        self.ends = ends
        self.evicted = evicted
        self.replay = replay
        self._expand = expand
        self._arrays: StepArrays | None = None

    @property
    def arrays(self) -> StepArrays:
        if self._arrays is None:
            self._arrays = self._expand()
        return self._arrays

    @property
    def token_offsets(self) -> np.ndarray:
        return self.arrays.token_offsets

    @property
    def positions(self) -> np.ndarray:
        return self.arrays.positions

    @property
    def virtual_slots(self) -> np.ndarray:
        return self.arrays.virtual_slots

    @property
    def swa_slots(self) -> np.ndarray:
        return self.arrays.swa_slots

    @property
    def streams(self) -> tuple[StreamWrites, ...]:
        return self.arrays.streams

    @property
    def num_tokens(self) -> int:
        return sum(self.ends) - sum(self.starts)

    def stream(self, ratio: int) -> StreamWrites:
        for s in self.streams:
            if s.ratio == ratio:
                return s
        raise KeyError(ratio)

    def __repr__(self) -> str:
        return (
            f"Allocation(requests={self.request_ids}, tokens={self.num_tokens}, "
            f"replay={self.replay}, evicted={self.evicted})"
        )


#: what a `StepPlan` calls for its reads: (the step's requests, their starts, the step's stamp)
ReadStep = Callable[[tuple[Any, ...], Sequence[int], int], "tuple[ReadPlan, ...]"]


class StepPlan(Allocation):
    """What one extend step does (`extend`, `extend_batch`, `extend_draft`,
    `extend_draft_batch`): the writes (every attribute of `Allocation`), the reads of each
    request's forward, and what the step changed in the requests' page tables.

    ``reads[i]``: the `ReadPlan` of ``request_ids[i]``, ``read_plan(request, start=starts[i])``
    (the window of every query of its new tokens). Built on first access from the requests as
    the step left them, so read it before the next call that changes one of them: afterwards it
    raises `StalePlanError`. ``deltas``: the `PageTableDelta`s of the step, in batch order
    (virtual table, then SWA table, of each request that changed); built on first access from
    a record taken during the step, valid forever. Both cost nothing unless read.
    """

    __slots__ = ("_read", "_reads", "_records", "_deltas")

    def __init__(
        self,
        request_ids: tuple[int, ...],
        starts: Sequence[int],
        ends: Sequence[int],
        evicted: EvictionReport,
        replay: bool,
        expand: Callable[[], StepArrays],
        read: tuple[ReadStep, tuple[Any, ...], int] | None = None,
        records: Sequence[tuple[int, int, list[int], int, list[int], int, int]] = (),
    ) -> None:
        """`Allocation`'s arguments, then where the reads come from (the cache's reader, the
        step's requests, its stamp) and the step's record of table changes; without them (a
        plan made by hand) there are no deltas and ``reads`` raises `InvalidRequestError`."""
        self.request_ids = request_ids
        self.starts = starts
        self.ends = ends
        self.evicted = evicted
        self.replay = replay
        self._expand = expand
        self._arrays = None
        self._read = read
        self._reads: tuple[ReadPlan, ...] | None = None
        self._records = records
        self._deltas: tuple[PageTableDelta, ...] | None = None

    @property
    def reads(self) -> tuple[ReadPlan, ...]:
        if self._reads is None:
            if self._read is None:
                raise InvalidRequestError("this StepPlan was not made by an extend: no reads")
            reader, requests, stamp = self._read  # called now, not bound in a closure: cheaper
            self._reads = reader(requests, self.starts, stamp)
        return self._reads

    @property
    def deltas(self) -> tuple[PageTableDelta, ...]:
        if self._deltas is None:
            self._deltas = step_deltas(self._records)
        return self._deltas

    def __repr__(self) -> str:
        return (
            f"StepPlan(requests={self.request_ids}, tokens={self.num_tokens}, "
            f"evicted={self.evicted})"
        )


@dataclass(frozen=True)
class StreamReads:
    ratio: int
    #: slots of every complete entry ``0 .. length // ratio - 1``
    entry_slots: np.ndarray
    #: positions and ring rows of the in-flight state at ``length``
    inflight_positions: np.ndarray
    inflight_rows: np.ndarray

    def __post_init__(self) -> None:
        _read_only((self.entry_slots, self.inflight_positions, self.inflight_rows))


@dataclass(frozen=True)
class ReadPlan:
    """Every physical slot a forward at ``length`` reads for one request."""

    length: int
    swa_positions: np.ndarray
    swa_slots: np.ndarray
    streams: tuple[StreamReads, ...]
    #: positions whose window KV came from bounded replay (never bit-identical)
    replay_start: int | None

    def __post_init__(self) -> None:
        _read_only((self.swa_positions, self.swa_slots))

    def stream(self, ratio: int) -> StreamReads:
        for s in self.streams:
            if s.ratio == ratio:
                return s
        raise KeyError(ratio)


@dataclass(frozen=True)
class PoolStats:
    capacity_pages: int
    free_pages: int
    evictable_pages: int
    protected_pages: int
    held_pages: int

    @property
    def used_fraction(self) -> float:
        return 1.0 - self.free_pages / self.capacity_pages


@dataclass(frozen=True)
class ExtendCheck:
    """`ShadowRadixCache.can_extend`'s answer: the pages a step would need per pool and what each
    pool can give now (free plus evictable). ``ok`` (also the truth value) is exactly whether
    `extend_batch` with those token counts would go through instead of raising `CapacityError`;
    ``short_pool`` names the first pool that falls short (``"full"`` or ``"swa"``)."""

    full_pages: int
    swa_pages: int
    full_available: int
    swa_available: int

    @property
    def short_pool(self) -> str | None:
        if self.full_pages > self.full_available:
            return "full"
        if self.swa_pages > self.swa_available:
            return "swa"
        return None

    @property
    def ok(self) -> bool:
        return self.short_pool is None

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True)
class CacheStats:
    page_size: int
    full: PoolStats
    swa: PoolStats
    num_nodes: int
    num_requests: int
    prompt_tokens: int
    hit_tokens: int
    replayed_tokens: int
    replayed_hits: int
    #: admissions whose reused prefix was derived from a replay (includes ``replayed_hits``)
    approximate_hits: int
    evicted: EvictionReport
    min_hit_granularity: int
    #: admissions so far, and the sum of their matches' ``cached_len`` (what the tree held)
    admissions: int = 0
    matched_tokens: int = 0

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def cached_tokens(self) -> int:
        """Tokens the tree holds (compressed KV reusable), in raw tokens."""
        return (self.full.evictable_pages + self.full.protected_pages) * self.page_size

    @property
    def cached_window_tokens(self) -> int:
        """Tokens of the tree whose SWA is still live (the rest are tombstones)."""
        return (self.swa.evictable_pages + self.swa.protected_pages) * self.page_size


def _read_only(arrays: Iterable[np.ndarray]) -> None:
    """Make the result's arrays read-only: one cached `Allocation` or `ReadPlan` is read by
    several consumers (and may view the cache's own arrays), so none may write to it."""
    for a in arrays:
        a.setflags(write=False)  # half the cost of ``a.flags.writeable = False``
