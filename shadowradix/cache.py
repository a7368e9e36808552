"""`ShadowRadixCache`: the request lifecycle over one radix tree and its per-pool shadows.

Every public mutating call validates first, then checks capacity (free + evictable pages), and
only then changes anything: a call that raises leaves the cache exactly as it was. Costs are
O(pages) in Python; per-token work is vectorised in `shadows`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Hashable, Sequence
from itertools import compress

import numpy as np

from .allocator import PageAllocator
from .config import CacheConfig
from .embedding import EmbedderVerbs
from .errors import (
    CapacityError,
    ConfigError,
    InvalidRequestError,
    StaleMatchError,
)
from .events import EventLog
from .locks import LockTable, PinReceipt
from .lru import LruIndex
from .node import Node
from .page_table import PageTable, page_array
from .radix_tree import RadixTree, Walk
from .request import Request, RequestState
from .results import (
    Allocation,
    CacheStats,
    EvictionReport,
    MatchResult,
    PoolStats,
    ReadPlan,
    WindowSource,
)
from .shadows import Run, Shadows

TokenInput = Sequence[int] | np.ndarray
_NO_EVICTION = EvictionReport()
_log = logging.getLogger("shadowradix")
#: admissions per window of the zero-hit watchdog (see `_watch_hit_rate`)
HIT_WATCH_WINDOW = 256
_MAX_TOKEN = 2**63 - 1


def _as_count(value: object) -> int | None:
    """``value`` as a plain non-negative int, or ``None`` if it is not a count (bools, floats,
    strings, negatives; NumPy integers are converted so that no unsigned arithmetic wraps)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        return None
    return int(value)


class ShadowRadixCache(EmbedderVerbs):
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
        self._prompt_tokens = self._hit_tokens = self._replayed_tokens = 0
        self._replayed_hits = self._approximate_hits = 0
        self._admissions = self._matched_tokens = 0
        self._watch = [0, 0]  # admissions and hit tokens in the current watchdog window
        self._evicted = EvictionReport()
        self._metrics_mark = (self.stats(), time.monotonic())

    # -- matching and admission ------------------------------------------------------------------

    def match_prefix(
        self, tokens: TokenInput, max_len: int | None = None, *, namespace: Hashable = None
    ) -> MatchResult:
        """Longest reusable prefix of ``tokens`` in ``namespace`` (a LoRA id, a cache salt, a
        tenant: any hashable; ``None`` is the default one). Prefixes never match across
        namespaces. Pure: changes nothing (not even LRU order).

        The match ends on a page boundary whose preceding ``window`` tokens are live SWA; with
        ``bounded_replay`` it may instead end at the deepest cached boundary and ask for the
        window to be replayed, when that skips more tokens.

        ``max_len`` bounds the match (``len(tokens) - 1`` leaves one token to compute, also for
        a one-token prompt: ``max_len=0`` gives the empty match, which ``admit`` accepts for
        any prompt). Raises `InvalidRequestError` for bad tokens or a negative ``max_len``.
        """
        arr = self._as_tokens(tokens, "tokens")
        if max_len is not None:
            if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)):
                raise InvalidRequestError(f"max_len must be an int, got {max_len!r}")
            if max_len < 0:
                raise InvalidRequestError(f"max_len must be >= 0, got {max_len}")
            arr = arr[:max_len]
        return self._match(arr, self._hashable(namespace))

    @staticmethod
    def _hashable(namespace: Hashable) -> Hashable:
        try:
            hash(namespace)
        except TypeError:
            raise InvalidRequestError(f"namespace must be hashable, got {namespace!r}") from None
        return namespace

    def _match(self, arr: np.ndarray, namespace: Hashable) -> MatchResult:
        """`match_prefix` of validated tokens."""
        root = self._tree.root_of(namespace)
        walk = self._tree.walk(arr, start=root)
        cached_len = walk.num_pages * self.config.page_size
        node, node_pages = self._deepest_live(walk, root)
        prefix_len = (node.start_page + node_pages) * self.config.page_size
        replay_gain = cached_len - self.config.window
        if self.config.bounded_replay and replay_gain > prefix_len:
            return self._sealed(
                MatchResult(
                    len(arr),
                    cached_len,
                    cached_len,
                    replay_gain,
                    WindowSource.REPLAY,
                    replay_gain,
                    walk.nodes[-1],
                    walk.last_pages,
                    self._tree.version,
                    arr,
                    True,
                    self,
                    namespace,
                )
            )
        source = WindowSource.LIVE if prefix_len else WindowSource.NONE
        return self._sealed(
            MatchResult(
                len(arr),
                cached_len,
                prefix_len,
                prefix_len,
                source,
                None,
                node,
                node_pages,
                self._tree.version,
                arr,
                self._any_approximate(walk, node),
                self,
                namespace,
            )
        )

    def _sealed(self, match: MatchResult) -> MatchResult:
        object.__setattr__(match, "_seal", self)
        return match

    @staticmethod
    def _any_approximate(walk: Walk, end: Node) -> bool:
        """Whether the matched path down to ``end`` holds replay-derived state."""
        if end.is_root:
            return False
        for n in walk.nodes:
            if n.approximate:
                return True
            if n is end:
                break
        return False

    def _deepest_live(self, walk: Walk, root: Node) -> tuple[Node, int]:
        """Deepest boundary of ``walk`` whose window is live SWA, as (node, pages into it).

        ``run_start[i]``: first page of the live run that ends at node ``i``'s end (live SWA is
        a suffix of each node, so runs chain through fully-live nodes).
        """
        p, w = self.config.page_size, self.config.window
        run_start, prev = [], 0
        for n in walk.nodes:
            live_from = n.start_page + n.live_from
            prev = live_from if live_from > n.start_page else prev
            run_start.append(prev)
        for i in range(len(walk.nodes) - 1, -1, -1):
            n = walk.nodes[i]
            used = walk.last_pages if i == len(walk.nodes) - 1 else n.num_pages
            end_page = n.start_page + used
            if (
                end_page > n.start_page + n.live_from
                and max(0, end_page * p - w) >= run_start[i] * p
            ):
                return n, used
        return root, 0

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
        arr = self._as_tokens(tokens, "prompt")
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
        prefix_pages = match.prefix_len // p
        window_first = max(0, match.prefix_len - w) // p
        replay_pages = prefix_pages - window_first if match.is_replay else 0
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

    def _current_match(self, arr: np.ndarray, match: MatchResult) -> MatchResult:
        """``match`` checked, and re-taken against the current tree if that changed."""
        self._check_match(arr, match)
        if match.version == self._tree.version:
            return match
        if len(match.tokens):
            fresh = self.match_prefix(match.tokens, namespace=match.namespace)
        else:  # an empty match (max_len=0) stays empty: re-take it on the admitted tokens
            fresh = self.match_prefix(arr, max_len=0, namespace=match.namespace)
        same = (fresh.prefix_len, fresh.hit_len, fresh.window, fresh.replay_start,
                fresh.approximate) == (match.prefix_len, match.hit_len, match.window,
                                       match.replay_start, match.approximate)  # fmt: skip
        if not same:
            raise StaleMatchError(
                "the tree changed since this match was taken and the prefix it found is no "
                f"longer the same (resume at {fresh.prefix_len}, not {match.prefix_len}); "
                "match again"
            )
        return fresh

    def _check_match(self, arr: np.ndarray, match: MatchResult) -> None:
        if not isinstance(match, MatchResult):
            raise InvalidRequestError(f"expected a MatchResult, got {type(match).__name__}")
        if match.owner is not self:
            raise InvalidRequestError("this MatchResult was taken from another cache")
        if match._seal is not self:
            raise InvalidRequestError(
                "this MatchResult was not made by this cache's match_prefix (an altered copy?)"
            )
        n = match.prefix_len
        if len(arr) < n or not (arr[:n] == match.tokens[:n]).all():
            raise InvalidRequestError("tokens do not start with the matched prefix")

    def _tree_swa_pages(self, node: Node, first_page: int, end_page: int) -> list[int]:
        """Live tree SWA pages for ``[first_page, end_page)`` along the path ending at ``node``."""
        parts = []
        n: Node | None = node
        while n is not None and not n.is_root and n.end_page > first_page:
            lo = max(first_page, n.start_page) - n.start_page
            assert lo >= n.live_from, "window pages must be live SWA"
            parts.append(n.swa_pages[lo - n.live_from :])
            n = n.parent
        return np.concatenate(parts[::-1]).tolist() if parts else []

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

    def extend(self, request: Request, tokens: TokenInput) -> Allocation:
        """Append committed tokens (a prefill chunk or decoded tokens) to one request."""
        return self.extend_batch([request], [tokens])

    def extend_batch(
        self, requests: Sequence[Request], tokens: Sequence[TokenInput] | np.ndarray
    ) -> Allocation:
        """Append committed tokens to several requests at once: one `Allocation` for the step.

        All or nothing: on any error no request changes. Window pages that every request's
        window has left are released *after* allocating (the current forward still reads them).
        A step where every request gets exactly one token (batched decode: a list of one-token
        lists, or an int array of shape ``(len(requests), 1)``) takes a fast path.
        """
        self._check_batch(requests, tokens)
        singles = self._single_tokens(tokens)
        if singles is not None:
            return self._extend_decode(requests, singles)
        arrays = [self._as_tokens(t, "tokens") for t in tokens]
        return self._extend(requests, arrays, draft=False)

    def extend_draft(self, request: Request, tokens: TokenInput) -> Allocation:
        """Append speculative draft tokens; `rollback` must settle them before anything else.

        Needs ``speculative=True`` (doubled rings) and at most ``config.max_draft_len`` tokens.
        """
        return self.extend_draft_batch([request], [tokens])

    def extend_draft_batch(
        self, requests: Sequence[Request], tokens: Sequence[TokenInput] | np.ndarray
    ) -> Allocation:
        """Append draft tokens to several requests at once: one `Allocation` for the verify step.

        Each request gets its own pending draft, settled by its own `rollback`. All or nothing:
        every check (the errors of `extend_draft` for each request) and the capacity check run
        before anything changes. Pages are allocated request by request, in batch order; rolling
        the requests back in reverse order after rejecting every draft restores the exact free
        stacks. A partial acceptance equals never drafting up to a renaming of page ids (see
        docs/speculative.md).
        """
        self._check_batch(requests, tokens)
        arrays = [self._as_tokens(t, "tokens") for t in tokens]
        if not self.config.speculative:
            raise InvalidRequestError("extend_draft needs CacheConfig(speculative=True)")
        limit = self.config.max_draft_len
        longest = max(len(a) for a in arrays)
        if limit is not None and longest > limit:
            raise InvalidRequestError(f"draft of {longest} tokens exceeds max_draft_len={limit}")
        return self._extend(requests, arrays, draft=True)

    def _check_batch(
        self, requests: Sequence[Request], tokens: Sequence[TokenInput] | np.ndarray
    ) -> None:
        for name, value in (("requests", requests), ("tokens", tokens)):
            if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
                raise InvalidRequestError(f"{name} must be a sequence, got {type(value).__name__}")
        if len(requests) != len(tokens) or not requests:
            raise InvalidRequestError("need one token list per request, and at least one request")
        if len({id(r) for r in requests}) != len(requests):
            raise InvalidRequestError("a request appears twice in one batch")
        active = RequestState.ACTIVE
        for r in requests:
            if (
                type(r) is not Request
                or r.owner is not self
                or r.state is not active
                or r.num_draft
            ):
                self._check_active(r)
                raise InvalidRequestError(f"request {r.id} has unverified drafts: rollback first")

    def _extend(
        self, requests: Sequence[Request], arrays: list[np.ndarray], draft: bool
    ) -> Allocation:
        p = self.config.page_size
        needs = [self._pages_needed(r, len(a)) for r, a in zip(requests, arrays)]
        evicted = self._reserve(sum(n[0] for n in needs), sum(n[1] for n in needs))
        pages = self._take_pages(needs)  # before any request changes: all or nothing
        runs = []
        for r, a, (vp, sp) in zip(requests, arrays, pages):
            start = r.length
            self._grow(r, vp, sp)
            first = max(r.swa_base, (start - self.config.window) // p)
            runs.append(
                Run(
                    start,
                    start + len(a),
                    r.vpages.slice(start // p),
                    first,
                    r.swa_pages[first - r.swa_base :],
                )
            )
            r._append(a)
            if draft:
                r.num_draft = len(a)
            else:
                self._release_window(r, start)
        allocation = self._shadows.allocation(tuple(r.id for r in requests), runs, evicted)
        self._debug_check()
        return allocation

    def _extend_decode(self, requests: Sequence[Request], tokens: list[int]) -> Allocation:
        """One token per request: same contract as `_extend`, with O(1) Python per request."""
        p, w = self.config.page_size, self.config.window
        group_mask = self._shadows.group_mask
        starts = [r._len for r in requests]
        crossing = sum(1 for start in starts if start % p == 0)
        evicted = self._reserve(crossing, crossing) if crossing else _NO_EVICTION
        fresh = iter(self._take_pages([(1, 1)] * crossing))
        vpages: list[int] = []
        spages: list[int] = []
        carry_tables: dict[int, tuple[int, list[int]]] = {}
        for i, (r, t, start) in enumerate(zip(requests, tokens, starts)):
            page = start // p
            if start % p == 0:
                self._grow(r, *next(fresh))
            table = r.vpages
            vpages.append(table.own[page - table.base])  # a new token's page is never shared
            spages.append(r.swa_pages[page - r.swa_base])
            if not (start + 1) & group_mask:
                first = max(r.swa_base, (start - w) // p)
                carry_tables[i] = (first, r.swa_pages[first - r.swa_base : page + 1 - r.swa_base])
            r._append_one(t)
            if page != r.released_at // p:
                self._release_window(r, start)
        ids = tuple(r.id for r in requests)
        allocation = self._shadows.decode_allocation(
            ids, starts, vpages, spages, carry_tables, evicted
        )
        self._debug_check()
        return allocation

    def _reserve(self, full_pages: int, swa_pages: int) -> EvictionReport:
        """Make sure the pages can be had (else raise, changing nothing), evicting if needed."""
        if full_pages > self._full.num_free or swa_pages > self._swa.num_free:
            self._ensure_capacity(full_pages, swa_pages)
            return self._make_room(full_pages, swa_pages)
        return _NO_EVICTION

    def _take_pages(self, needs: list[tuple[int, int]]) -> list[tuple[list[int], list[int]]]:
        """Allocate every request's (virtual, SWA) pages of a step before any request changes.
        If an allocation fails anyway (the pre-check passed: a device allocator's refusal, an
        injected fault), the pages already taken go back, the free stacks end exactly as
        before, and the error propagates: no request was touched."""
        taken: list[tuple[list[int], list[int]]] = []
        try:
            for nv, ns in needs:
                vp = self._full.allocate(nv)
                taken.append((vp, []))
                taken[-1] = (vp, self._swa.allocate(ns))
        except BaseException:
            for vp, sp in reversed(taken):
                self._swa.give_back(sp)
                self._full.give_back(vp)
            raise
        return taken

    @staticmethod
    def _grow(request: Request, vpages: list[int], swa_pages: list[int]) -> None:
        request.vpages.extend(vpages)
        if swa_pages:
            request.swa_pages.extend(swa_pages)
            request.swa_owned.extend([True] * len(swa_pages))

    def _pages_needed(self, request: Request, num_tokens: int) -> tuple[int, int]:
        p = self.config.page_size
        end = request.length + num_tokens
        last_page = (end - 1) // p
        num_v = last_page + 1 - len(request.vpages)
        num_s = last_page + 1 - (request.swa_base + len(request.swa_pages))
        return num_v, num_s

    def _release_window(self, request: Request, computed_len: int) -> None:
        """Drop the window pages no step after ``computed_len`` tokens can read, and re-lock."""
        if self._trim_window(request, computed_len):
            self._relock_swa(request)

    def _trim_window(self, request: Request, computed_len: int) -> bool:
        """Forget window pages before ``F - window`` (``F``: the last page boundary at or before
        ``computed_len``); free the private ones. Keeping ``[F - window, F)`` means inserting
        the request later leaves a live window before ``F`` (a full aligned hit). Returns
        whether any page was dropped (the SWA lock then needs re-taking)."""
        p = self.config.page_size
        request.released_at = max(request.released_at, computed_len)
        new_base = max(0, request.released_at // p * p - self.config.window) // p
        drop = new_base - request.swa_base
        if drop <= 0:
            return False
        self._swa.free(list(compress(request.swa_pages[:drop], request.swa_owned[:drop])))
        del request.swa_pages[:drop], request.swa_owned[:drop]
        request.swa_base = new_base
        return True

    def _relock_swa(self, request: Request) -> None:
        """Re-take the SWA lock so it covers exactly the tree pages in the request's window."""
        old = request.swa_receipt
        tree_part = request.swa_owned[: max(0, request.tree_pages - request.swa_base)]
        request.swa_receipt = None
        if not all(tree_part):
            request.swa_receipt = self._locks.lock_swa(request.terminal, request.swa_base)
        if old is not None:
            self._locks.unlock(old)

    def rollback(self, request: Request, num_tokens: int) -> None:
        """Reject the last ``num_tokens`` draft tokens and commit the rest of the draft.

        Afterwards tree and pools equal a run that extended only the accepted tokens (unless
        the draft's allocation had to evict): rejected pages go back on top of the free stacks.
        """
        self._check_active(request)
        count = _as_count(num_tokens)
        if count is None or count > request.num_draft:
            raise InvalidRequestError(
                f"can roll back 0..{request.num_draft} draft tokens, not {num_tokens!r}"
            )
        num_tokens = count
        p = self.config.page_size
        start = request.length - request.num_draft
        accepted = request.num_draft - num_tokens
        end = start + accepted
        keep_pages = -(-end // p)
        self._swa.give_back(request.swa_pages[keep_pages - request.swa_base :])
        del (
            request.swa_pages[keep_pages - request.swa_base :],
            request.swa_owned[keep_pages - request.swa_base :],
        )
        self._full.give_back(request.vpages.slice(keep_pages))
        request.vpages.truncate(keep_pages)
        request._truncate(end)
        request.num_draft = 0
        if accepted:
            self._release_window(request, start)
        self._debug_check()

    # -- caching and completion ----------------------------------------------------------------

    def cache_unfinished(self, request: Request) -> None:
        """Insert the request's committed full pages into the tree; the request keeps running.

        Pages the tree already holds (another request inserted the same prefix) replace the
        request's duplicates. Call it after the forward of the request's last chunk: its window
        is trimmed to the committed length, so pages it no longer needs stop being protected
        (they stay in the tree as evictable SWA, tombstoned only by SWA eviction).
        """
        self._check_active(request)
        if self._insert(request) | self._trim_window(request, request.num_committed):
            self._relock_swa(request)
        self._debug_check()

    def finish(self, request: Request) -> None:
        """Insert the committed full pages, then release every lock and private page."""
        self._check_active(request)
        if request.num_draft:
            raise InvalidRequestError("finish: rollback the pending draft first")
        self._insert(request)  # the SWA lock is dropped right after: no need to re-take it
        self._release(request, RequestState.FINISHED)
        self._debug_check()

    def abort(self, request: Request) -> None:
        """Release the request without caching anything it computed."""
        self._check_active(request)
        self._release(request, RequestState.ABORTED)
        self._debug_check()

    def _insert(self, request: Request) -> bool:
        """Move the committed full pages into the tree and re-take the FULL lock. Returns
        whether anything was inserted (the SWA lock must then be re-taken by the caller)."""
        p = self.config.page_size
        full_pages = request.num_committed // p
        if full_pages <= request.tree_pages:
            return False
        first = request.terminal.end_page * p  # the tokens before it are the tree's already
        tokens = request.tokens_from(first)[: full_pages * p - first]
        walk = self._tree.walk(tokens, request.terminal, full_pages, first)
        node = request.terminal
        for child in walk.nodes:
            node = child
            if walk.last_pages < child.num_pages and child is walk.nodes[-1]:
                node = self._tree.split(child, walk.last_pages)
            self._adopt_tree_pages(request, node)
        if node.end_page < full_pages:
            node = self._grow_tree(request, node, tokens[node.end_page * p - first :], full_pages)
        request.tree_pages = full_pages
        old_full, request.terminal = request.full_receipt, node
        request.full_receipt = self._locks.lock_full(node)
        if old_full is not None:
            self._locks.unlock(old_full)
        return True

    def _adopt_tree_pages(self, request: Request, node: Node) -> None:
        """The tree already holds ``node``'s pages: drop the request's duplicates of them.

        Window pages the tree still has live replace the request's copies; window pages the
        tree had tombstoned are revived with the request's copies (computed exactly, never by
        replay: replayed pages lie before the request's first insert point).
        """
        lo, hi, base = node.start_page, node.end_page, request.swa_base
        request.approximate |= node.approximate  # it now reads that node's state
        self._full.free(request.vpages.slice(lo, hi))
        request.vpages.replace(lo, hi, node.vpages.tolist())
        live_abs = hi - len(node.swa_pages)
        for k in range(max(lo, base, live_abs), hi):
            i = k - base
            if request.swa_owned[i]:
                self._swa.free([request.swa_pages[i]])
                request.swa_pages[i] = int(node.swa_pages[k - live_abs])
                request.swa_owned[i] = False
        first = max(lo, base)
        if first < live_abs and (node.approximate or not request.approximate):
            revived = request.swa_pages[first - base : live_abs - base]
            assert all(request.swa_owned[first - base : live_abs - base])
            request.swa_owned[first - base : live_abs - base] = [False] * len(revived)
            self._tree.revive(node, np.asarray(revived, dtype=np.int64))

    def _grow_tree(
        self, request: Request, parent: Node, tokens: np.ndarray, full_pages: int
    ) -> Node:
        """Hand the request's private pages ``[parent.end_page, full_pages)`` (their tokens:
        ``tokens``) to the tree: as a new leaf, or appended to ``parent`` when that is a leaf
        this request inserted itself and alone holds (a request's successive inserts make one
        node, not a chain; another request's node is never extended, so its end stays a node
        boundary for LRU tiers)."""
        lo = parent.end_page
        live_lo = max(lo, request.swa_base)
        i0, i1 = live_lo - request.swa_base, full_pages - request.swa_base
        swa = np.zeros(0, dtype=np.int64)
        if live_lo < full_pages:
            swa = page_array(request.swa_pages[i0:i1])
            assert all(request.swa_owned[i0:i1]), "private pages beyond the tree must be owned"
            request.swa_owned[i0:i1] = [False] * (i1 - i0)
        vpages = page_array(request.vpages.slice(lo, full_pages))
        new_tokens = tokens.copy()
        if self._can_extend_own_leaf(request, parent, live_lo == lo):
            self._tree.extend_leaf(parent, new_tokens, vpages, swa)
            return parent
        request.own_leaf = self._tree.add_leaf(
            parent, new_tokens, vpages, swa, approximate=request.approximate
        )
        return request.own_leaf

    def _can_extend_own_leaf(self, request: Request, leaf: Node, new_pages_live: bool) -> bool:
        """Append to ``leaf`` only if this request inserted it, alone holds it, its end is past
        the prompt (the prompt's end stays a node boundary, so its window keeps the tail-window
        eviction tier for branches such as regenerations), it has the same replay lineage, and
        live SWA stays a suffix."""
        return (
            leaf is request.own_leaf
            and not leaf.children
            and leaf.full_lock_ref == 1
            and leaf.end_page * self.config.page_size > len(request.prompt)
            and leaf.approximate == request.approximate
            and (new_pages_live or len(leaf.swa_pages) == 0)
        )

    def _release(self, request: Request, state: RequestState) -> None:
        for receipt in (request.swa_receipt, request.full_receipt):
            if receipt is not None:
                self._locks.unlock(receipt)
        request.swa_receipt = request.full_receipt = None
        self._full.free(request.vpages.slice(request.tree_pages))
        self._swa.free(list(compress(request.swa_pages, request.swa_owned)))
        request.swa_pages, request.swa_owned = [], []
        request.vpages.truncate(request.tree_pages)  # O(private pages), not O(prefix)
        request.state = state
        del self._requests[request.id]
        self._tree.touch(request.terminal.path_from_root())

    # -- eviction and capacity ------------------------------------------------------------------

    def evict(self, full_tokens: int = 0, swa_tokens: int = 0) -> EvictionReport:
        """Free at least this many tokens' pages per pool, if that many are evictable.

        Full eviction removes LRU unlocked leaves; SWA eviction tombstones the oldest
        unprotected pages, heads of nodes before any branch's tail window.
        """
        full, swa = _as_count(full_tokens), _as_count(swa_tokens)
        if full is None or swa is None:
            raise InvalidRequestError("eviction sizes must be non-negative ints (tokens)")
        p = self.config.page_size
        report = self._evict_full(-(-full // p)) + self._evict_swa(-(-swa // p))
        self._debug_check()
        return report

    def _ensure_capacity(self, full_pages: int, swa_pages: int) -> None:
        if full_pages > self._full.num_free:
            available = self._full.num_free + self._index.full_evictable
            if full_pages > available:
                raise CapacityError("full", full_pages, available)
        if swa_pages > self._swa.num_free:
            available = self._swa.num_free + self._index.swa_evictable
            if swa_pages > available:
                raise CapacityError("swa", swa_pages, available)

    def _make_room(self, full_pages: int, swa_pages: int) -> EvictionReport:
        """Evict from each pool only what it lacks (the pool that failed is the one evicted)."""
        report = self._evict_full(full_pages - self._full.num_free)
        return report + self._evict_swa(swa_pages - self._swa.num_free)

    def _evict_full(self, num_pages: int) -> EvictionReport:
        if num_pages <= 0:
            return _NO_EVICTION
        freed = swa = removed = 0
        index, tree, vparts, sparts = self._index, self._tree, [], []
        while freed < num_pages:
            leaf = index.oldest_full_leaf()
            if leaf is None:
                break
            vpages, swa_pages = tree.remove_leaf(leaf)
            vparts.append(vpages)
            sparts.append(swa_pages)
            freed, swa, removed = freed + len(vpages), swa + len(swa_pages), removed + 1
        if removed:  # in eviction order, as if one by one (nothing reads the stacks meanwhile)
            self._full.free(np.concatenate(vparts).tolist())
            self._swa.free(np.concatenate(sparts).tolist())
        report = EvictionReport(freed, swa, removed, 0)
        self._evicted += report
        return report

    def _evict_swa(self, num_pages: int) -> EvictionReport:
        if num_pages <= 0:
            return _NO_EVICTION
        freed = tombstoned = 0
        index, tree, parts = self._index, self._tree, []
        while freed < num_pages:
            node = index.oldest_swa()  # its tiers are up to date
            if node is None:
                break
            tier0_end, tier1_end, live_from = node.lru_tiers
            avail = (tier0_end if tier0_end > live_from else tier1_end) - live_from
            parts.append(tree.tombstone(node, min(avail, num_pages - freed)))
            freed, tombstoned = freed + len(parts[-1]), tombstoned + 1
        if parts:
            self._swa.free(np.concatenate(parts).tolist())
        report = EvictionReport(0, freed, 0, tombstoned)
        self._evicted += report
        return report

    def rebalance(
        self, full_capacity: int | None = None, swa_capacity: int | None = None
    ) -> EvictionReport:
        """Move the live pool capacities (tokens) within their configured maxima at run time.

        Shrinking evicts what no longer fits; raises `CapacityError` (changing nothing) when
        locked or request-held pages exceed the new size.
        """
        p = self.config.page_size
        targets = []
        for name, alloc, value in (
            ("full", self._full, full_capacity),
            ("swa", self._swa, swa_capacity),
        ):
            if value is None:
                targets.append(alloc.capacity)
                continue
            count = _as_count(value)
            if count is None:
                raise ConfigError(f"{name} capacity must be an int number of tokens, got {value!r}")
            if count == 0 or count % p or count // p > alloc.max_pages:
                raise ConfigError(
                    f"{name} capacity must be a multiple of {p} in (0, {alloc.max_pages * p}]"
                )
            targets.append(count // p)
        if targets[1] < self.config.window_pages + 1:
            raise ConfigError("swa capacity must hold at least one request's window")
        excess = [max(0, a.num_used - t) for a, t in zip((self._full, self._swa), targets)]
        self._ensure_capacity(excess[0] + self._full.num_free, excess[1] + self._swa.num_free)
        report = self._evict_full(excess[0]) + self._evict_swa(
            max(0, self._swa.num_used - targets[1])
        )
        self._full.set_capacity(targets[0])
        self._swa.set_capacity(targets[1])
        self._debug_check()
        return report

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
        return self._shadows.read_plan(
            request.length,
            request.length if start is None else start,
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
            evicted=self._evicted,
            min_hit_granularity=self.config.min_hit_granularity,
            admissions=self._admissions,
            matched_tokens=self._matched_tokens,
        )

    @property
    def requests(self) -> tuple[Request, ...]:
        return tuple(self._requests.values())

    # -- validation ----------------------------------------------------------------------------

    def _check_active(self, request: Request) -> None:
        if not isinstance(request, Request) or request.owner is not self:
            raise InvalidRequestError("not a request of this cache")
        if not request.is_active:
            raise InvalidRequestError(f"request {request.id} is {request.state.value}")

    @staticmethod
    def _single_tokens(tokens: Sequence[TokenInput] | np.ndarray) -> list[int] | None:
        """The tokens of a decode step (one valid token per request), else ``None``."""
        if isinstance(tokens, np.ndarray):
            if tokens.ndim == 2 and tokens.shape[1] == 1 and tokens.dtype.kind in "iu":
                if len(tokens) and (tokens.min() < 0 or tokens.max() > _MAX_TOKEN):
                    raise InvalidRequestError("token ids must be in [0, 2**63)")
                return tokens[:, 0].tolist()  # type: ignore[no-any-return]
            return None
        out = []
        for t in tokens:
            if type(t) not in (list, tuple) or len(t) != 1:
                return None
            x = t[0]
            if type(x) is not int:  # NumPy ints too (sampled ids often are): same fast path
                if not isinstance(x, np.integer):
                    return None
                x = int(x)
            if not 0 <= x <= _MAX_TOKEN:
                raise InvalidRequestError(f"token ids must be in [0, 2**63), got {x}")
            out.append(x)
        return out

    @staticmethod
    def _as_tokens(tokens: TokenInput, what: str) -> np.ndarray:
        try:
            arr = np.asarray(tokens)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"{what} must be a 1-D sequence of ints") from exc
        if arr.ndim != 1 or len(arr) == 0:
            raise InvalidRequestError(f"{what} must be a non-empty 1-D sequence of ints")
        if arr.dtype.kind not in "iu":
            raise InvalidRequestError(f"{what} must be integers, got dtype {arr.dtype}")
        if arr.min() < 0 or (arr.dtype.kind == "u" and arr.max() > _MAX_TOKEN):
            raise InvalidRequestError(f"{what} must be token ids in [0, 2**63)")
        return arr.astype(np.int64, copy=False)

    def _debug_check(self) -> None:
        if self.config.debug:
            self.check_invariants()

    def check_invariants(self) -> None:
        """Assert every structural invariant of tree, locks, LRU index, allocators and requests."""
        from .invariants import check_cache

        check_cache(self)
