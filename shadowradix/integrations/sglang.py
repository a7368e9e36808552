"""An SGLang-shaped prefix cache over `ShadowRadixCache`: the method names and semantics of
sglang 0.5.18's ``BasePrefixCache`` as its scheduler calls it (0.5.23's call shapes: `sglang0523`,
over this one), with arguments and results as plain records of our own
(`sglang_types`; no sglang import, no torch).

How SGLang's scheduler calls a tree cache, and what each call does here::

    match_prefix(MatchPrefixParams(RadixKey(fill_ids[:-1], extra_key)))   pure: a hit
        -> req.prefix_indices, req.last_node
    req.lock_result = inc_lock_ref(req.last_node)      PrefillAdder: pin the prefix while it
                                                       budgets (available + evictable)
    alloc_for_extend(req, n)                           first call admits the request (its own
                                                       locks replace the pin), then every call
                                                       computes n more tokens: an `Allocation`
    cache_unfinished_req(req, chunked=True)            after each chunk's forward: inserts the
                                                       computed pages, rewrites req.prefix_indices
    alloc_for_decode(reqs)                             one token per request (the last output)
    cache_finished_req(req)                            insert and release; ``is_insert=False``
                                                       (a retraction) releases without inserting

``alloc_for_extend`` / ``alloc_for_decode`` stand in for sglang's ``mem_cache.common`` helpers
of the same names: in shadowradix the cache plans every pool's slots, so allocation is its call.
Capacity failure raises `CapacityError` (SGLang raises on OOM too); ``can_alloc_for_extend`` and
``check_decode_mem`` answer first without raising.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from ..cache import ShadowRadixCache
from ..config import CacheConfig
from ..errors import InvalidRequestError, LockError
from ..events import KvEvent
from ..locks import PinReceipt
from ..node import Node
from ..request import Request
from ..results import Allocation, ExtendCheck
from ..results import MatchResult as CoreMatch
from ..validation import as_tokens
from .admission import admission_check, admit_and_extend
from .paths import prefix_vpages, slots_of
from .sglang_types import (
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
    RadixKey,
    Req,
    TreeNode,
)

__all__ = ["ShadowRadixSGLangCache", "RadixKey", "MatchPrefixParams", "Req"]


class ShadowRadixSGLangCache:
    """``BasePrefixCache`` over a `ShadowRadixCache` made from ``config`` (``.cache``)."""

    def __init__(self, config: CacheConfig, *, kv_events: bool = False) -> None:
        self.cache = ShadowRadixCache(config, kv_events=kv_events)
        self.page_size = config.page_size
        self.disable = False
        self._namespaces: dict[Hashable, None] = {None: None}  # seen, for pretty_print
        #: the pins `inc_lock_ref` took and nothing released yet, by node (latest last), and
        #: each one's node: a node's pins are interchangeable, like SGLang's lock counter
        #: (its scheduler drops ``inc_lock_ref``'s result and calls ``dec_lock_ref(node)``)
        self._pins: dict[TreeNode, list[PinReceipt]] = {}
        self._pin_node: dict[int, TreeNode] = {}  # id(receipt) -> node, while held

    # -- lookup and locks ------------------------------------------------------------------

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """Longest reusable prefix of ``params.key`` (in its ``extra_key`` namespace). Pure."""
        key = _key_of(params)
        tokens = key.token_ids if len(key.token_ids) else [0]  # an empty key: the empty match
        match = self.cache.match_prefix(tokens, len(key.token_ids), namespace=key.extra_key)
        self._namespaces[key.extra_key] = None
        indices = slots_of(prefix_vpages(match), match.prefix_len, self.page_size)
        prefix = match.tokens[: match.prefix_len]
        node = TreeNode(match.prefix_len, prefix, key.extra_key, match, _read_only(indices))
        branching = match.cached_len if match.cached_len > match.prefix_len else None
        return MatchResult(indices, node, node, node, 0, branching, match.cached_len)

    def inc_lock_ref(self, node: TreeNode) -> IncLockRefResult:
        """Keep ``node``'s prefix (and its live window) from eviction until `dec_lock_ref`.
        ``delta``: the change of `evictable_size` (<= 0)."""
        if not isinstance(node, TreeNode):
            raise InvalidRequestError(f"expected a TreeNode, got {type(node).__name__}")
        if node.prefix_len == 0:
            return IncLockRefResult(0, None)
        before = self.evictable_size()
        receipt = self.cache.pin(node.tokens, namespace=node.namespace)
        self._pins.setdefault(node, []).append(receipt)
        self._pin_node[id(receipt)] = node
        return IncLockRefResult(self.evictable_size() - before, receipt)

    def dec_lock_ref(
        self, node: TreeNode, params: DecLockRefParams | None = None
    ) -> DecLockRefResult:
        """Release one pin `inc_lock_ref` took on ``node``: the receipt in ``params`` if it
        is still held, else (as SGLang's scheduler calls it, without one) the node's latest —
        a node's pins count like SGLang's lock counter. `LockError` when the node holds none;
        the root: nothing to release."""
        if not isinstance(node, TreeNode):
            raise InvalidRequestError(f"expected a TreeNode, got {type(node).__name__}")
        if params is not None and not isinstance(params, DecLockRefParams):
            raise InvalidRequestError(f"expected DecLockRefParams, got {type(params).__name__}")
        receipt = None if params is None else params.receipt
        if receipt is None and node.prefix_len == 0:
            return DecLockRefResult(0)
        pin = self._held_pin(receipt, node)
        if pin is None:
            raise LockError("dec_lock_ref: no inc_lock_ref of this node is still held")
        before = self.evictable_size()
        self._release_pin(pin)
        return DecLockRefResult(self.evictable_size() - before)

    def holds_pin(self, receipt: PinReceipt) -> bool:
        """Whether ``receipt`` (an `inc_lock_ref` result's) is still held here."""
        return id(receipt) in self._pin_node

    # -- allocation (sglang.srt.mem_cache.common's alloc_for_extend / alloc_for_decode) ----

    def can_alloc_for_extend(self, req: Req, num_tokens: int) -> ExtendCheck:
        """Whether `alloc_for_extend(req, num_tokens)` would go through now (changes nothing
        but, for a request not yet admitted, possibly a node split where its match ends)."""
        n, kv = _positive(num_tokens), _checked(req).kv
        if kv is not None and kv.is_active:
            return self.cache.can_extend([kv], [n])
        return admission_check(self.cache, self._match_for(req), n)

    def alloc_for_extend(self, req: Req, num_tokens: int) -> Allocation:
        """Compute the next ``num_tokens`` of ``req.fill_ids``: admit it first if it is not
        running (at ``req.last_node``'s match, or a fresh one leaving the last token to
        compute), releasing ``req.lock_result``. An admission whose match replays its window
        leaves the rebuild in ``req.kv.replay_allocation``: run it first.

        Raises `CapacityError` or `InvalidRequestError` changing nothing (for an admission,
        but a node split), `StaleMatchError` if the tree changed under the match in a way that
        moves it (an unpinned match lost pages to eviction): match again."""
        n, fill = _positive(num_tokens), _checked(req).fill_ids
        if req.kv is not None and req.kv.is_active:
            start = req.kv.length
            _check_span(fill, start, n)
            return self.cache.extend(req.kv, fill[start : start + n])
        match = self._match_for(req)
        _check_span(fill, match.prefix_len, n)
        chunk = fill[match.prefix_len : match.prefix_len + n]
        req.kv, allocation = admit_and_extend(self.cache, fill, match, chunk)
        self._release_scheduler_lock(req)
        return allocation

    def check_decode_mem(self, reqs: Sequence[Req]) -> ExtendCheck:
        """Whether `alloc_for_decode(reqs)` would go through now (else retract some)."""
        return self.cache.can_extend([_running(r) for r in reqs], [1] * len(reqs))

    def alloc_for_decode(self, reqs: Sequence[Req]) -> Allocation:
        """One decode step: each request computes its last output token (the only one of
        ``fill_ids`` not computed yet). Raises `CapacityError` changing nothing."""
        kvs = [_running(r) for r in reqs]
        tokens = []
        for r, kv in zip(reqs, kvs):
            fill = r.fill_ids
            if len(fill) != kv.length + 1:
                raise InvalidRequestError(
                    f"{r.rid}: decode computes one token, {len(fill) - kv.length} are pending"
                )
            tokens.append([fill[-1]])
        return self.cache.extend_batch(kvs, tokens)

    # -- caching -------------------------------------------------------------------------

    def cache_unfinished_req(self, req: Req, chunked: bool = False) -> None:
        """Insert the computed pages of a running request (after its chunk's forward).
        Rewrites ``req.prefix_indices`` (the KV indices of every computed token: insertion may
        replace pages with the tree's copies) and ``req.last_node`` (its tree prefix)."""
        kv = _running(req)
        self.cache.cache_unfinished(kv)
        req.prefix_indices = slots_of(kv.vpages, kv.num_committed, self.page_size)
        req.last_node = tree_node_of(kv, req.extra_key, self.page_size)

    def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        """Insert the computed pages (unless ``is_insert=False``: a retraction) and release
        the request's locks and private pages, and ``req.lock_result`` if still held.
        `InvalidRequestError` for a request finished already."""
        kv = _checked(req).kv
        if kv is not None:
            if is_insert:
                self.cache.finish(kv)
            else:
                self.cache.abort(kv)
        self._release_scheduler_lock(req)

    def insert(self, params: InsertParams) -> InsertResult:
        """Insert ``params.key`` whose KV the engine holds (a transfer, a load), its whole pages
        (``total_len``; a partial last page is not inserted, as SGLang's paged tree keeps only
        page-aligned keys): pages for the part the tree lacks are allocated and inserted at
        once; the engine writes the KV into ``InsertResult.allocation`` (``None`` when nothing
        was missing, or when the tree holds compressed KV of the key past its last live window:
        then nothing is inserted) before any forward reads it. ``prefix_len``: the tokens the
        tree already held (compressed KV)."""
        key = params.key if isinstance(params, InsertParams) else None
        if not isinstance(key, RadixKey):
            raise InvalidRequestError("expected InsertParams(key=RadixKey(...))")
        self._namespaces[key.extra_key] = None
        tokens = as_tokens(key.token_ids, "insert's key").tolist()  # bad tokens: refused first
        whole = len(tokens) // self.page_size * self.page_size  # a partial last page is not kept
        if whole == 0:
            return InsertResult(0, 0, None)
        tokens = tokens[:whole]
        match = self.cache.match_prefix(tokens, namespace=key.extra_key)
        if match.cached_len > match.prefix_len or match.prefix_len == whole:
            # all there, or the tree holds compressed KV past its last live window: pages
            # allocated for those tokens would be duplicates, freed by the insertion and then
            # handed out again under the engine's write; nothing is inserted
            return InsertResult(match.cached_len, whole, None)
        kv, allocation = admit_and_extend(self.cache, tokens, match, tokens[match.prefix_len :])
        self.cache.finish(kv)
        return InsertResult(match.cached_len, whole, allocation)

    # -- eviction and sizes ----------------------------------------------------------------

    def evict(self, params: EvictParams) -> EvictResult:
        if not isinstance(params, EvictParams):
            raise InvalidRequestError("expected EvictParams")
        report = self.cache.evict(params.num_tokens, params.swa_num_tokens)
        p = self.page_size
        return EvictResult(report.full_pages * p, report.swa_pages * p)

    def evictable_size(self) -> int:
        return self.cache.stats().full.evictable_pages * self.page_size

    def full_evictable_size(self) -> int:
        return self.evictable_size()

    def swa_evictable_size(self) -> int:
        return self.cache.stats().swa.evictable_pages * self.page_size

    def protected_size(self) -> int:
        return self.cache.stats().full.protected_pages * self.page_size

    def full_protected_size(self) -> int:
        return self.protected_size()

    def swa_protected_size(self) -> int:
        return self.cache.stats().swa.protected_pages * self.page_size

    def total_size(self) -> int:
        """Tokens the tree holds (compressed KV reusable)."""
        return self.cache.stats().cached_tokens

    def full_available_size(self) -> int:
        """Free tokens of the full (virtual) pool (SGLang asks its allocator)."""
        return self.cache.stats().full.free_pages * self.page_size

    def swa_available_size(self) -> int:
        return self.cache.stats().swa.free_pages * self.page_size

    def take_events(self) -> list[KvEvent]:
        """The core's KV events (`ConfigError` unless made with ``kv_events=True``)."""
        return self.cache.take_events()

    def reset(self) -> None:
        """Drop every cached prefix; `InvalidRequestError` while requests run or pins are held."""
        self.cache.reset()
        self._pins.clear()
        self._pin_node.clear()

    def pretty_print(self) -> None:
        print(self.format_tree())

    def format_tree(self) -> str:
        """One line per node, indented by depth: pages, live SWA, locks."""
        lines = []
        for ns in self._namespaces:
            root = self.cache.match_prefix([0], max_len=0, namespace=ns).node
            if root.children:
                lines.append(f"namespace {ns!r}")
                lines.extend(_format_subtree(root, 1))
        lines.append(f"#tokens: {self.total_size()}")
        return "\n".join(lines)

    # -- helpers ---------------------------------------------------------------------------

    def _release_scheduler_lock(self, req: Req) -> None:
        """Drop the pin the scheduler took with ``inc_lock_ref(req.last_node)``: its receipt
        in ``req.lock_result`` (or, released already through ``dec_lock_ref(node)``, another
        pin of that node), or with no result kept (SGLang's scheduler drops it: its tree moves
        the lock itself) the latest pin of ``req.last_node``; none held: nothing."""
        lock, req.lock_result = req.lock_result, None
        if lock is not None and lock.receipt is None:  # the root's
            return
        pin = self._held_pin(None if lock is None else lock.receipt, req.last_node)
        if pin is not None:
            self._release_pin(pin)

    def _held_pin(self, receipt: PinReceipt | None, node: TreeNode | None) -> PinReceipt | None:
        """``receipt`` if this shim still holds it, else ``node``'s latest pin, else None."""
        if receipt is not None and id(receipt) in self._pin_node:
            return receipt
        held = self._pins.get(node) if node is not None else None
        return held[-1] if held else None

    def _release_pin(self, pin: PinReceipt) -> None:
        self.cache.unpin(pin)
        node = self._pin_node.pop(id(pin))
        held = self._pins[node]
        held[:] = [r for r in held if r is not pin]
        if not held:
            del self._pins[node]

    def _match_for(self, req: Req) -> CoreMatch:
        node = _checked(req).last_node
        if node is not None and node.match is not None:
            if node.match.namespace != req.extra_key:  # another tenant's / adapter's prefix
                raise InvalidRequestError(
                    f"{req.rid}: its last_node was matched in namespace {node.match.namespace!r}, "
                    f"the request's is {req.extra_key!r}"
                )
            return node.match
        fill = req.fill_ids
        return self.cache.match_prefix(fill, max_len=len(fill) - 1, namespace=req.extra_key)


def tree_node_of(kv: Request, namespace: Hashable, page_size: int) -> TreeNode:
    """The handle on the tree prefix of running request ``kv``: its inserted whole pages."""
    tree_len = kv.tree_pages * page_size
    indices = _read_only(slots_of(kv.vpages, tree_len, page_size))
    return TreeNode(tree_len, kv.token_array()[:tree_len].copy(), namespace, None, indices)


def _read_only(indices: np.ndarray) -> np.ndarray:
    out = indices.copy()
    out.flags.writeable = False
    return out


def _key_of(params: MatchPrefixParams) -> RadixKey:
    key = params.key if isinstance(params, MatchPrefixParams) else None
    if not isinstance(key, RadixKey):
        raise InvalidRequestError("expected MatchPrefixParams(key=RadixKey(...))")
    return key


def _positive(n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise InvalidRequestError(f"num_tokens must be a positive int, got {n!r}")
    return int(n)


def _check_span(fill: list[int], start: int, n: int) -> None:
    if start + n > len(fill):
        raise InvalidRequestError(
            f"{n} tokens from {start} run past the request's {len(fill)} tokens"
        )


def _checked(req: Req) -> Req:
    if not isinstance(req, Req):
        raise InvalidRequestError(f"expected a Req, got {type(req).__name__}")
    return req


def _running(req: Req) -> Request:
    if not isinstance(req, Req) or req.kv is None or not req.kv.is_active:
        raise InvalidRequestError(f"{getattr(req, 'rid', req)!r} is not running")
    return req.kv


def _format_subtree(node: Node, depth: int) -> list[str]:
    lines = []
    for child in node.children.values():
        head = child.tokens[:4].tolist()
        lines.append(
            f"{'  ' * depth}[{child.start_page}, {child.end_page}) tokens {head}... "
            f"swa live from page {child.start_page + child.live_from} "
            f"lock full={child.full_lock_ref} swa={child.swa_lock_ref}"
        )
        lines.extend(_format_subtree(child, depth + 1))
    return lines
