"""An SGLang-shaped prefix cache with the call shapes of sglang 0.5.23's ``BasePrefixCache``
as a FULL + SWA scheduler (no HiCache, no mamba) drives it, over the 0.5.18 shim
(`ShadowRadixSGLangCache`, ``._tree``: its pins, eviction, sizes and printing) and the core.
Records: `sglang0523_types`; the scheduler-side helpers of sglang's ``mem_cache/common.py``
(``match_kv_cache``, ``checkpoint_kv_cache``, ``release_kv_cache``): `sglang0523_common`.

A request's life, as 0.5.23's scheduler runs it::

    match_kv_cache(req, tree)            match_prefix(RadixKey(fill, extra_key, limit=len - 1,
                                         cache_salt)): req.prefix_len, req.last_node (pure)
    req.lock = tree.lock(req.last_node)  PrefillAdder: a pin, and sets req.extend_end
    tree.alloc_for_extend(req)           computes [prefix_len, extend_end); the first call
                                         admits, and req.lock passes to the request (its own
                                         locks hold the path: the pin is released)
    checkpoint_kv_cache(req, tree)       after each prefill forward: checkpoint(req,
                                         up_to=extend_end) inserts, moves req.lock and
                                         req.last_node, returns the row's `RowRewrite`
    tree.alloc_for_decode(reqs)          one token each (the last output)
    release_kv_cache(req, tree, checkpoint=True)    finished: insert, release, unlock
    release_kv_cache(req, tree, checkpoint=False)   retracted / aborted: release, unlock

Every call that raises a `shadowradix.errors` type leaves the cache as it was (an admission
check may split the node its match ends in: see `admission`). Capacity failure raises
`CapacityError`, as the 0.5.18 shim does (0.5.23's allocation raises ``RuntimeError`` after
evicting; the core evicts by itself), and ``can_alloc_for_extend`` / ``check_decode_mem``
answer first without raising.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..config import CacheConfig
from ..deltas import TableChanges
from ..errors import InvalidRequestError
from ..events import KvEvent
from ..locks import Pool
from ..request import Request
from ..results import Allocation, ExtendCheck
from ..results import MatchResult as CoreMatch
from .admission import admission_check, admit_and_extend
from .paths import slots_of
from .sglang import ShadowRadixSGLangCache, tree_node_of
from .sglang0523_locks import TreeLocks, tree_node
from .sglang0523_types import MatchPrefixParams, MatchResult, RadixKey, Req, RowRewrite, TreeLock
from .sglang_types import (
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    TreeNode,
)
from .sglang_types import MatchPrefixParams as LegacyParams
from .sglang_types import RadixKey as LegacyKey

__all__ = ["ShadowRadixSGLang0523Cache"]


class ShadowRadixSGLang0523Cache:
    """sglang 0.5.23's ``BasePrefixCache`` calls over a `ShadowRadixCache` made from
    ``config`` (``.cache``)."""

    def __init__(self, config: CacheConfig, *, kv_events: bool = False) -> None:
        self._tree = ShadowRadixSGLangCache(config, kv_events=kv_events)
        self.cache = self._tree.cache
        self.page_size = config.page_size
        self.disable = False
        self._locks = TreeLocks(self._tree)

    @property
    def sliding_window_size(self) -> int:
        return self.cache.config.window

    @property
    def swa_retain_window(self) -> int:
        return self.cache.config.window

    # -- lookup ----------------------------------------------------------------------------

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """Longest reusable prefix of ``params.key`` (its first ``limit`` tokens) in its
        ``(extra_key, cache_salt)`` namespace. Pure."""
        key = _key_of(params)
        legacy_key = LegacyKey(key.raw_token_ids(), key.namespace)
        legacy = self._tree.match_prefix(LegacyParams(legacy_key))
        node = legacy.last_device_node
        return MatchResult(
            node.prefix_len, node, node, node,
            swa_branching_seqlen=legacy.swa_branching_seqlen,
            full_kv_hit_length=legacy.full_kv_hit_length,
        )  # fmt: skip

    def path_device_indices(self, node: TreeNode) -> np.ndarray:
        """KV indices (virtual slots, read-only) of the path to ``node``, as the tree held
        them when ``node`` was made: valid while the path is locked."""
        return tree_node(node).device_indices

    def prefix_device_indices(self, req: Req) -> np.ndarray:
        """KV indices of ``req``'s matched prefix: ``path_device_indices(req.last_node)``'s
        first ``req.prefix_len``."""
        node = _checked(req).last_node
        if node is None or node.prefix_len < req.prefix_len:
            raise InvalidRequestError(f"{req.rid}: prefix_len {req.prefix_len} past its last_node")
        return self.path_device_indices(node)[: req.prefix_len]

    def row_device_indices(self, req: Req) -> np.ndarray:
        """A running request's row (sglang's ``req_to_token[req_pool_idx, :kv_allocated_len]``):
        the KV index of every allocated token."""
        kv = _running(req)
        return slots_of(kv.vpages, kv.length, self.page_size)

    # -- locks (sglang0523_locks) ---------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> IncLockRefResult:
        """Pin ``node``'s prefix (and its live window) until `dec_lock_ref` with this result's
        ``to_dec_params()``; ``delta``: the change of `evictable_size` (<= 0)."""
        return self._locks.inc_lock_ref(node)

    def dec_lock_ref(
        self, node: TreeNode, params: DecLockRefParams | None = None
    ) -> DecLockRefResult:
        """Release the pin of ``params`` (`inc_lock_ref`'s result, ``to_dec_params()``): exactly
        that one. `LockError` for one released already, one a `TreeLock` holds, or none given
        (but for the root: nothing to release)."""
        return self._locks.dec_lock_ref(node, params)

    def lock(self, node: TreeNode) -> TreeLock:
        """Take a tree lock on ``node`` for one holder: `unlock` releases it, once."""
        return self._locks.lock(node)

    def unlock(self, lock: TreeLock | None) -> None:
        """Release ``lock`` (``None``: nothing, as SGLang). `LockError` if released already."""
        self._locks.unlock(lock)

    def release_swa(self, lock: TreeLock) -> None:
        """0.5.23's early release of a lock's SWA part once the window has passed the prefix:
        nothing to do (the core moves a running request's SWA locks with its window; a pin
        keeps its SWA until `unlock`). `LockError` if ``lock`` is not held."""
        self._locks.check_held(lock)

    # -- allocation (sglang's mem_cache/allocation.py, per request) ------------------------

    def can_alloc_for_extend(self, req: Req) -> ExtendCheck:
        """Whether `alloc_for_extend(req)` would go through now (changes nothing but, for a
        request not running yet, possibly a node split where its match ends)."""
        start, end = self._span(req)
        if req.kv.holds_kv:
            return self.cache.can_extend([_running(req)], [end - start])
        return admission_check(self.cache, self._match_of(req), end - start)

    def alloc_for_extend(self, req: Req) -> Allocation:
        """Compute ``req``'s tokens ``[prefix_len, extend_end)``. A request not running is
        admitted first, at ``req.last_node``'s match (``prefix_len`` must be its length), and
        ``req.lock`` passes to it. An admission whose match replays its window leaves the
        rebuild in ``req.kv.request.replay_allocation``: run it first.

        Raises `CapacityError` or `InvalidRequestError` changing nothing (for an admission,
        but a node split), `StaleMatchError` if an unpinned match lost pages since: match
        again. `LockError` if ``req.lock`` is not held."""
        start, end = self._span(req)
        fill = req.full_untruncated_fill_ids
        if req.kv.holds_kv:
            return self.cache.extend(_running(req), fill[start:end])
        match = self._match_of(req)
        if req.lock is not None:
            self._locks.check_held(req.lock)
        kv, allocation = admit_and_extend(self.cache, fill, match, fill[start:end])
        req.kv.request, req.kv.cache_protected_len = kv, kv.tree_pages * self.page_size
        if req.lock is not None:
            self._locks.pass_to_request(req.lock)
        return allocation

    def check_decode_mem(self, reqs: Sequence[Req]) -> ExtendCheck:
        """Whether `alloc_for_decode(reqs)` would go through now (else retract some)."""
        return self.cache.can_extend([_running(r) for r in reqs], [1] * len(reqs))

    def alloc_for_decode(self, reqs: Sequence[Req], token_per_req: int = 1) -> Allocation:
        """One decode step: each request computes its last output token. ``token_per_req``
        other than 1 (speculative decoding) is refused: use the core's ``extend_draft``.
        Raises `CapacityError` changing nothing."""
        if token_per_req != 1 or isinstance(token_per_req, bool):
            raise InvalidRequestError(f"token_per_req={token_per_req!r} is not supported: 1 only")
        kvs = [_running(r) for r in reqs]
        for r, kv in zip(reqs, kvs):
            pending = len(r.full_untruncated_fill_ids) - kv.length
            if pending != 1:
                raise InvalidRequestError(f"{r.rid}: decode computes one token, {pending} pending")
        return self.cache.extend_batch(kvs, [[r.full_untruncated_fill_ids[-1]] for r in reqs])

    # -- checkpoint and release -------------------------------------------------------------

    def checkpoint(self, req: Req, *, up_to: int) -> RowRewrite:
        """Insert the running request's computed whole pages (``up_to`` must be its computed
        length: the core inserts exactly that), re-anchor ``req.last_node`` on its tree
        prefix, move ``req.lock`` there and advance ``req.kv.cache_protected_len``. Returns
        what moved in the row (pages the tree already held replace the request's copies)."""
        kv = _running(req)
        if isinstance(up_to, bool) or not isinstance(up_to, (int, np.integer)):
            raise InvalidRequestError(f"up_to must be an int, got {up_to!r}")
        if up_to != kv.num_committed:
            raise InvalidRequestError(
                f"{req.rid}: checkpoint up_to={up_to} with {kv.num_committed} tokens computed: "
                "only the computed length is supported"
            )
        if req.lock is not None:
            self._locks.check_held(req.lock)
        changes = self.cache.cache_unfinished(kv)
        node = tree_node_of(kv, req.namespace, self.page_size)
        self._locks.unlock(req.lock)
        req.lock = self._locks.request_lock(node)
        req.last_node, req.kv.cache_protected_len = node, node.prefix_len
        return self._rewrite(kv, changes)

    def release_kv_cache(self, req: Req, *, checkpoint: bool) -> None:
        """Give the request's KV back: with ``checkpoint`` (and not
        ``req.skip_radix_cache_insert``) its computed whole pages join the tree first; what
        earlier checkpoints inserted stays either way. Unlocks ``req.lock``. A request that
        holds no KV only unlocks ``req.lock``; with none either, `InvalidRequestError`."""
        _checked(req)
        if not isinstance(checkpoint, bool):
            raise InvalidRequestError(f"checkpoint must be a bool, got {checkpoint!r}")
        if req.lock is not None:
            self._locks.check_held(req.lock)
        elif not req.kv.holds_kv:
            raise InvalidRequestError(f"{req.rid} holds no KV and no lock: released already?")
        if req.kv.holds_kv:
            kv = _running(req)
            if checkpoint and not req.skip_radix_cache_insert:
                self.cache.finish(kv)
            else:
                self.cache.abort(kv)
        self._locks.unlock(req.lock)
        req.lock = None

    def _rewrite(self, kv: Request, changes: TableChanges) -> RowRewrite:
        full = [d for d in changes.deltas if d.pool is Pool.FULL and d.pages]
        if not full:
            return RowRewrite(kv.length, np.zeros(0, dtype=np.int64))
        p, first = self.page_size, full[0].first_page
        end = min((first + len(full[0].pages)) * p, kv.length)
        return RowRewrite(first * p, slots_of(kv.vpages, kv.length, p)[first * p : end])

    def _span(self, req: Req) -> tuple[int, int]:
        """``[prefix_len, extend_end)``, checked against the request's tokens and state."""
        start, end = _checked(req).prefix_len, req.extend_end
        fill_len = len(req.full_untruncated_fill_ids)
        if not isinstance(end, int) or isinstance(end, bool) or not start < end <= fill_len:
            raise InvalidRequestError(
                f"{req.rid}: extend_end {end!r} must be past prefix_len {start} and within its "
                f"{fill_len} tokens"
            )
        if req.kv.holds_kv and start != _running(req).length:
            raise InvalidRequestError(
                f"{req.rid}: prefix_len {start} but {_running(req).length} tokens computed: "
                "checkpoint_kv_cache after each chunk"
            )
        return start, end

    def _match_of(self, req: Req) -> CoreMatch:
        node = req.last_node
        if node is None or node.match is None:
            raise InvalidRequestError(f"{req.rid}: no match to admit at: match_kv_cache first")
        if node.match.namespace != req.namespace:  # another adapter's / salt's prefix
            raise InvalidRequestError(
                f"{req.rid}: its last_node was matched in namespace {node.match.namespace!r}, "
                f"the request's is {req.namespace!r}"
            )
        if node.prefix_len != req.prefix_len:
            raise InvalidRequestError(
                f"{req.rid}: prefix_len {req.prefix_len} differs from its match's {node.prefix_len}"
            )
        return node.match

    # -- eviction, sizes, capabilities -----------------------------------------------------

    def evict(self, params: EvictParams) -> EvictResult:
        return self._tree.evict(params)

    def evict_sliding_windows(self, req: Req, pre_len: int, *, eviction_interval: int = 1) -> None:
        """Nothing to do: the core releases a running request's SWA pages behind its window
        inside every extend and checkpoint."""
        _running(req)

    def evictable_size(self) -> int:
        return self._tree.evictable_size()

    def full_evictable_size(self) -> int:
        return self._tree.full_evictable_size()

    def swa_evictable_size(self) -> int:
        return self._tree.swa_evictable_size()

    def protected_size(self) -> int:
        return self._tree.protected_size()

    def full_protected_size(self) -> int:
        return self._tree.full_protected_size()

    def swa_protected_size(self) -> int:
        return self._tree.swa_protected_size()

    def total_size(self) -> int:
        return self._tree.total_size()

    def full_available_size(self) -> int:
        return self._tree.full_available_size()

    def swa_available_size(self) -> int:
        return self._tree.swa_available_size()

    def supports_swa(self) -> bool:
        return True

    def supports_prefix_sharing(self) -> bool:
        return True

    def supports_mamba(self) -> bool:
        return False

    def take_events(self) -> list[KvEvent]:
        return self._tree.take_events()

    def reset(self) -> None:
        """Drop every cached prefix; `InvalidRequestError` while requests run or locks or pins
        are held."""
        if self._locks:
            raise InvalidRequestError(f"{len(self._locks)} lock(s) or pin(s) held: unlock first")
        self._tree.reset()

    def pretty_print(self) -> None:
        print(self.format_tree())

    def format_tree(self) -> str:
        return self._tree.format_tree()

    def check_invariants(self) -> None:
        """The core's invariants, and every pin a lock or receipt stands for is held."""
        self.cache.check_invariants()
        self._locks.check_invariants()


def _key_of(params: MatchPrefixParams) -> RadixKey:
    key = params.key if isinstance(params, MatchPrefixParams) else None
    if not isinstance(key, RadixKey):
        raise InvalidRequestError("expected MatchPrefixParams(key=RadixKey(...))")
    if params.cow_mamba:
        raise InvalidRequestError("cow_mamba=True is not supported: no mamba state here")
    if key.is_bigram:
        raise InvalidRequestError("is_bigram keys (EAGLE) are not supported")
    limit = key.limit
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise InvalidRequestError(f"limit must be None or an int >= 0, got {limit!r}")
    return key


def _checked(req: object) -> Req:
    if not isinstance(req, Req):
        raise InvalidRequestError(f"expected a Req, got {type(req).__name__}")
    return req


def _running(req: object) -> Request:
    if not isinstance(req, Req) or not req.kv.holds_kv:
        raise InvalidRequestError(f"{getattr(req, 'rid', req)!r} is not running")
    assert req.kv.request is not None
    return req.kv.request
