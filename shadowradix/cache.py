"""`ShadowRadixCache`: the request lifecycle over one radix tree and its per-pool shadows.

Every public mutating call validates first, then checks capacity (free + evictable pages), and
only then changes anything: a call that raises leaves the cache exactly as it was. Costs are
O(pages) in Python; per-token work is vectorised in `shadows`. The parts of the lifecycle live
in modules named after them and are mixed in: `matching`, `extension`, `drafts`, `pending`,
`window`, `insertion`, `eviction`, `embedding` (the embedder verbs).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Hashable, Sequence
from itertools import compress

import numpy as np

from . import slots
from .allocator import PageAllocator
from .config import CacheConfig
from .deltas import TableChanges
from .drafts import DraftVerbs
from .embedding import EmbedderVerbs
from .errors import ConfigError, InvalidRequestError
from .events import EventLog, EventSubscription
from .eviction import EvictionPolicy
from .extension import StepExtension
from .insertion import TreeInsertion
from .locks import LockTable, PinReceipt
from .lru import LruIndex
from .matching import PrefixMatching
from .page_table import PageTable
from .pending import PendingVerbs
from .radix_tree import RadixTree
from .request import Request, RequestState
from .results import (
    CacheStats,
    EvictionReport,
    MatchResult,
    PoolStats,
    ReadPlan,
    StepPlan,
)
from .shadows import Run, Shadows
from .table_edits import TableEdits
from .validation import TokenInput, as_tokens, single_tokens
from .window import WindowTrim

_log = logging.getLogger("shadowradix")
#: admissions per window of the zero-hit watchdog (see `_watch_hit_rate`)
HIT_WATCH_WINDOW = 256


class ShadowRadixCache(
    PrefixMatching,
    StepExtension,
    DraftVerbs,
    PendingVerbs,
    WindowTrim,
    TreeInsertion,
    EvictionPolicy,
    EmbedderVerbs,
):
    """Prefix cache for DeepSeek-V4-style hybrid attention. See docs/design.md and docs/api.md.

    Lifecycle: ``match_prefix`` → ``admit`` → ``extend`` / ``extend_draft`` + ``rollback`` →
    ``cache_unfinished`` (any time) → ``finish`` or ``abort``.
    """

    def __init__(self, config: CacheConfig, *, kv_events: bool = False) -> None:
        """``kv_events``: record what enters and leaves the tree for `take_events` (off by
        default: the page hashes cost a blake2b per inserted page)."""
        if not isinstance(config, CacheConfig):
            raise ConfigError(f"ShadowRadixCache needs a CacheConfig, got {type(config).__name__}")
        self.config = config
        p = config.page_size
        self._full = PageAllocator("full", config.num_full_pages, config.max_full_pages)
        self._swa = PageAllocator("swa", config.num_swa_pages, config.max_swa_pages)
        self._index = LruIndex(p, config.window)
        self._tree = RadixTree(p, self._index)
        if not isinstance(kv_events, bool):
            raise ConfigError(f"kv_events must be a bool, got {kv_events!r}")
        self._tree.events = EventLog(p) if kv_events else None
        self._locks = LockTable(self._index.update)
        self._shadows = Shadows(config)
        self._requests: dict[int, Request] = {}
        self._pins: dict[int, PinReceipt] = {}
        self._pin_ids = itertools.count()
        self._step_stamps = itertools.count()
        self._prompt_tokens = self._hit_tokens = self._replayed_tokens = 0
        self._replayed_hits = self._approximate_hits = 0
        self._admissions = self._matched_tokens = 0
        self._watch = [0, 0]  # admissions and hit tokens in the current watchdog window
        #: pages and nodes evicted so far: full pages, SWA pages, nodes removed, tombstoned
        self._evicted_pages = [0, 0, 0, 0]
        self._metrics_mark = (self.stats(), time.monotonic())

    # -- matching and admission ------------------------------------------------------------------

    def admit(
        self, tokens: TokenInput, match: MatchResult | None = None, *, namespace: Hashable = None
    ) -> Request:
        """Start a request whose prompt is ``tokens``, resuming after ``match`` (matched now in
        ``namespace`` if omitted; a given match carries its own namespace, and a different
        ``namespace`` beside it raises `InvalidRequestError`). Locks the matched path; a
        replayed match also gets private SWA pages for its window, returned in
        ``request.replay_allocation`` for the adapter to recompute.

        A match stays usable while the tree changes elsewhere (another admission's split, an
        insert, an eviction off its path): if the tree moved on since ``match``, the prefix is
        matched again, and the admission goes ahead when that gives the same resume point,
        hits, window source and lineage. Raises `StaleMatchError` when it does not (match
        again), `InvalidRequestError` if ``tokens`` do not start with the matched prefix,
        `CapacityError` if the replay window cannot be allocated.
        """
        arr = as_tokens(tokens, "prompt")
        if match is None:
            match = self._match(arr, self._hashable(namespace))  # of ``arr`` itself: current
        else:
            if namespace is not None and isinstance(match, MatchResult):
                if namespace != match.namespace:
                    raise InvalidRequestError(
                        f"namespace {namespace!r} differs from the match's ({match.namespace!r})"
                    )
            match = self._current_match(arr, match)
        p, w = self.config.page_size, self.config.window
        prefix_pages = slots.page_of(match.prefix_len, p)
        window_first = slots.window_first_page(match.prefix_len, w, p)
        replay_pages = slots.window_num_pages(match.prefix_len, w, p) if match.is_replay else 0
        self._ensure_capacity(0, replay_pages)
        node = match.node
        if 0 < match.node_pages < node.num_pages:
            node = self._tree.split(node, match.node_pages)
        path = node.path_from_root()
        request = Request(self, arr, match, path)
        request.terminal = node
        self._requests[request.id] = request
        request.vpages = PageTable([n.vpages for n in path])
        request.tree_pages = prefix_pages
        if not node.is_root:
            request.full_receipt = self._locks.lock_full(node)
        self._tree.touch(path)
        request.swa_base = window_first
        if match.is_replay:
            self._attach_replayed_window(request, replay_pages)
        else:
            request.swa_pages = self._tree_swa_pages(node, window_first, prefix_pages)
            request.swa_owned = [False] * len(request.swa_pages)
            if request.swa_pages:
                request.swa_receipt = self._locks.lock_swa(node, window_first)
        self._account_admission(arr, match)
        self._debug_check()
        return request

    def _attach_replayed_window(self, request: Request, num_pages: int) -> None:
        """Private SWA pages for a replayed window, and the `Allocation` that rebuilds it."""
        evicted = self._make_room(0, num_pages)
        request.swa_pages = self._swa.allocate(num_pages)
        request.swa_owned = [True] * num_pages
        match, first = request.match, request.swa_base
        run = Run(
            match.replay_start or 0,
            match.prefix_len,
            request.vpages[first:],
            first,
            list(request.swa_pages),
        )
        request.replay_allocation = self._shadows.allocation(
            (request.id,), [run], evicted, replay=True
        )

    def _account_admission(self, arr: np.ndarray, match: MatchResult) -> None:
        self._prompt_tokens += len(arr)
        self._hit_tokens += match.hit_len
        self._admissions += 1
        self._matched_tokens += match.cached_len
        self._replayed_tokens += match.replayed_len
        self._replayed_hits += int(match.is_replay)
        self._approximate_hits += int(match.approximate and match.hit_len > 0)
        self._watch_hit_rate(match.hit_len)

    def _watch_hit_rate(self, hit_len: int) -> None:
        """Warn when a whole window of admissions reused nothing while the tree holds prefixes:
        a silent 0 % hit rate is a bug peers shipped twice (vllm#42258, vllm#48435)."""
        self._watch[0] += 1
        self._watch[1] += hit_len
        if self._watch[0] < HIT_WATCH_WINDOW:
            return
        cached = self._index.full_evictable + self._index.full_protected
        if self._watch[1] == 0 and cached:
            _log.warning(
                "prefix-cache hit rate is 0 over the last %d admissions although the tree holds "
                "%d tokens (page size %d: prompts shorter than a page can never hit)",
                self._watch[0],
                cached * self.config.page_size,
                self.config.page_size,
            )
        self._watch = [0, 0]

    # -- extension ---------------------------------------------------------------------------

    def extend(self, request: Request, tokens: TokenInput) -> StepPlan:
        """Append committed tokens (a prefill chunk or decoded tokens) to one request."""
        return self.extend_batch([request], [tokens])

    def extend_batch(
        self, requests: Sequence[Request], tokens: Sequence[TokenInput] | np.ndarray
    ) -> StepPlan:
        """Append committed tokens to several requests at once: one `StepPlan` for the step
        (its writes, each request's reads, the page-table deltas).

        All or nothing: on any error no request changes. Window pages that every request's
        window has left are released *after* allocating (the current forward still reads them).
        A step where every request gets exactly one token (batched decode: a list of one-token
        lists, or an int array of shape ``(len(requests), 1)``) takes a fast path.
        """
        self._check_batch(requests, tokens)
        singles = single_tokens(tokens)
        if singles is not None:
            return self._extend_decode(requests, singles)
        arrays = [as_tokens(t, "tokens") for t in tokens]
        return self._extend(requests, arrays, draft=False)

    # -- caching and completion ----------------------------------------------------------------

    def cache_unfinished(self, request: Request) -> TableChanges:
        """Insert the request's committed full pages into the tree; the request keeps running.

        Pages the tree already holds (another request inserted the same prefix) replace the
        request's duplicates, which go back to the free lists: the returned deltas name the
        entries that changed. Call it after the forward of the request's last chunk: its window
        is trimmed to the committed length, so pages it no longer needs stop being protected
        (they stay in the tree as evictable SWA, tombstoned only by SWA eviction).
        """
        self._check_active(request)
        edits = TableEdits(request)
        if self._insert(request, edits) | self._trim_window(request, request.num_committed):
            self._relock_swa(request)
        request._step_stamp = None
        self._debug_check()
        return edits.changes()

    def finish(self, request: Request) -> TableChanges:
        """Insert the committed full pages, then release every lock and private page. The
        deltas leave the virtual table holding the tree's pages and the SWA table empty."""
        self._check_active(request)
        if request.num_draft:
            raise InvalidRequestError("finish: rollback the pending draft first")
        edits = TableEdits(request)
        self._insert(request, edits)  # the SWA lock is dropped right after: no need to re-take it
        self._release(request, RequestState.FINISHED)
        self._debug_check()
        return edits.changes()

    def abort(self, request: Request) -> TableChanges:
        """Release the request without caching anything it computed (deltas as `finish`)."""
        self._check_active(request)
        edits = TableEdits(request)
        self._release(request, RequestState.ABORTED)
        self._debug_check()
        return edits.changes()

    def _release(self, request: Request, state: RequestState) -> None:
        for receipt in (request.swa_receipt, request.full_receipt):
            if receipt is not None:
                self._locks.unlock(receipt)
        request.swa_receipt = request.full_receipt = None
        private_v = request.vpages.slice(request.tree_pages)
        owned = request.swa_owned
        private_s = list(compress(request.swa_pages, owned)) if any(owned) else []
        self._full.free(private_v)
        self._swa.free(private_s)
        if self._tree.events is not None:
            self._tree.events.freed(private_v, private_s)
        request.swa_pages, request.swa_owned = [], []
        request.vpages.truncate(request.tree_pages)  # O(private pages), not O(prefix)
        request.state = state
        request._step_stamp = None
        del self._requests[request.id]
        self._tree.touch(request.terminal.path_from_root())

    # -- eviction and capacity ------------------------------------------------------------------

    # -- reads and observability ---------------------------------------------------------------

    def read_plan(self, request: Request, start: int | None = None) -> ReadPlan:
        """Slots a forward at the request's current length reads: window SWA, every complete
        compressed entry, and the in-flight ring rows of each stream.

        ``start``: the first position of the chunk just extended. The window then begins at
        ``start - window`` instead of ``length - window``, so every query of the chunk finds
        its own window (the trim after ``extend`` keeps exactly those pages). Raises
        `InvalidRequestError` unless ``released_at <= start <= length``."""
        self._check_active(request)
        if start is not None and not request.released_at <= start <= request.length:
            raise InvalidRequestError(
                f"read_plan start {start} outside [{request.released_at}, {request.length}]: "
                "the window before it is no longer held"
            )
        return self._read_plan(request, request.length if start is None else start)

    def _read_plan(self, request: Request, start: int) -> ReadPlan:
        return self._shadows.read_plan(
            request.length,
            start,
            request.vpages,
            request.swa_base,
            request.swa_pages,
            request.match.replay_start,
        )

    def stats(self) -> CacheStats:
        idx = self._index
        held_v = sum(len(r.vpages) - r.tree_pages for r in self._requests.values())
        held_s = sum(sum(r.swa_owned) for r in self._requests.values())
        return CacheStats(
            page_size=self.config.page_size,
            full=PoolStats(
                self._full.capacity,
                self._full.num_free,
                idx.full_evictable,
                idx.full_protected,
                held_v,
            ),
            swa=PoolStats(
                self._swa.capacity, self._swa.num_free, idx.swa_evictable, idx.swa_protected, held_s
            ),
            num_nodes=len(idx.nodes),
            num_requests=len(self._requests),
            prompt_tokens=self._prompt_tokens,
            hit_tokens=self._hit_tokens,
            replayed_tokens=self._replayed_tokens,
            replayed_hits=self._replayed_hits,
            approximate_hits=self._approximate_hits,
            evicted=EvictionReport(*self._evicted_pages),
            min_hit_granularity=self.config.min_hit_granularity,
            admissions=self._admissions,
            matched_tokens=self._matched_tokens,
        )

    def subscribe_events(self) -> EventSubscription:
        """A new, independent consumer of the KV events (`shadowradix.events`): its queue gets
        every event from now on, whoever else takes events (`take_events`, other subscribers).
        Made with ``kv_events=True``: full events. Without: allowed only while the tree holds
        no page (else `ConfigError`), and its events name page ids only (no hashes, no tokens),
        which is all an offload executor needs to learn when a page id is freed."""
        log = self._tree.events
        if log is None:
            if self._tree.nodes():
                raise ConfigError(
                    "subscribe to a cache made without kv_events before it caches anything "
                    "(or make it with kv_events=True)"
                )
            log = self._tree.events = EventLog(self.config.page_size, hashes=False,
                                               default_queue=False)  # fmt: skip
        return log.subscribe()

    @property
    def requests(self) -> tuple[Request, ...]:
        return tuple(self._requests.values())

    # -- validation ----------------------------------------------------------------------------

    def _check_active(self, request: Request) -> None:
        if not isinstance(request, Request) or request.owner is not self:
            raise InvalidRequestError("not a request of this cache")
        if not request.is_active:
            raise InvalidRequestError(f"request {request.id} is {request.state.value}")

    def _debug_check(self) -> None:
        if self.config.debug:
            self.check_invariants()

    def check_invariants(self) -> None:
        """Assert every structural invariant of tree, locks, LRU index, allocators and requests."""
        from .invariants import check_cache

        check_cache(self)
