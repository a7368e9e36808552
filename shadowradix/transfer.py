"""Moving a cached prefix from one cache to another by page index (prefill → decode, issue #16).

The sender describes what it holds (`export_layout`: its page ids, pinned); the receiver
allocates in its *own* pools and inserts the prefix into its own tree (`import_prefix`), and
answers with its page ids, one to one with the sender's. Every pool row is page-local
arithmetic on a page id (docs/design.md §2, §10), so the transfer layer copies the rows of
sender page ``src[i]`` to receiver page ``dst[i]`` in every tensor without knowing the layout::

    virtual page v   compressed entries  v*spp + k, k < spp       (every stream; indexer keys
                                                                   of the sparse stream alike)
    SWA page s       window latents      s*P + k,   k < P
                     in-flight rows      s*ring_len + k           (every stream's ring)

What a layout covers: the page-aligned prefix ``[0, num_tokens)`` whose window is live at the
sender (the SWA-safe match), i.e. the compressed KV of every whole page, and the SWA pages of
the window before ``num_tokens`` with their ring rows (the in-flight rows of the open groups,
``span <= W``). Not covered: the partial last page and anything after the match (the receiver
computes them), tombstoned SWA before the window (no reader needs it), drafts.

Both sides stay all-or-nothing: `plan_import` (pure) says which of the layout's pages the
receiver lacks, or raises `ImportRefused` (no room, another layout); `import_prefix` then
changes the receiver, or raises and changes nothing.
"""

from __future__ import annotations

from collections.abc import Hashable
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from . import slots
from .errors import CapacityError, InvalidRequestError, require
from .locks import PinReceipt, Pool
from .request import Request
from .results import EvictionReport, WindowSource
from .transfer_layout import (
    NO_PAGES,
    ImportPlan,
    ImportReceipt,
    ImportRefused,
    PageMap,
    PoolRegion,
    PrefixLayout,
    RefusalReason,
    frozen_pages,
    page_rows,
    pool_regions,
)
from .validation import TokenInput, as_tokens

if TYPE_CHECKING:
    from .cache import ShadowRadixCache
    from .config import CacheConfig
    from .node import Node, Pages

__all__ = [
    "ImportPlan",
    "ImportReceipt",
    "ImportRefused",
    "PageMap",
    "PoolRegion",
    "PrefixLayout",
    "RefusalReason",
    "export_layout",
    "import_prefix",
    "page_rows",
    "plan_import",
    "pool_regions",
    "release_layout",
]


# -- sender ----------------------------------------------------------------------------------


def export_layout(
    cache: ShadowRadixCache,
    source: Request | TokenInput,
    *,
    max_len: int | None = None,
    namespace: Hashable = None,
) -> PrefixLayout:
    """Pin the reusable prefix of ``source`` (a request of ``cache``: its committed tokens and
    namespace; or tokens) and describe it by page id. ``max_len`` bounds it as in
    `match_prefix` (``len - 1``: what a receiver's admission of the same prompt can reuse).

    Only what the tree holds is covered (an active request's pages are there once
    `cache_unfinished` ran). A match that would need a replayed window covers nothing. Mutates:
    the pin (and the split `pin` may make). Raises `InvalidRequestError` for bad input."""
    tokens = _source_tokens(cache, source)
    if isinstance(source, Request):
        namespace = source.match.namespace
    limit = len(tokens) if max_len is None else max_len
    match = cache.match_prefix(tokens, max_len=limit, namespace=namespace)
    pin: PinReceipt | None = None
    n = 0 if match.window is WindowSource.REPLAY else match.prefix_len
    if n:
        pin = cache.pin(tokens[:n], namespace=namespace)
        match = cache.match_prefix(tokens[:n], namespace=namespace)  # after pin's split
        require(match.prefix_len == n == pin.tokens, "export: the pinned prefix moved")
    p, w = cache.config.page_size, cache.config.window
    path = [] if match.node.is_root else match.node.path_from_root()
    end = n // p
    full = np.fromiter(chain.from_iterable(nd.vpages for nd in path), np.int64)[:end]
    first = slots.window_first_page(n, w, p) if n else 0
    return PrefixLayout(
        tokens=frozen_pages(tokens[:n]),
        source_len=len(tokens),
        page_size=p,
        window=w,
        streams=cache.config.streams,
        full_pages=frozen_pages(full),
        window_first_page=first,
        swa_pages=frozen_pages(_window_pages(path, first, end)),
        approximate=match.approximate,
        pin=pin,
    )


def release_layout(cache: ShadowRadixCache, layout: PrefixLayout) -> None:
    """Unpin what `export_layout` pinned (the receiver acknowledged, refused, or died). Raises
    `LockError` for a second release."""
    if layout.pin is not None:
        cache.unpin(layout.pin)


def _source_tokens(cache: ShadowRadixCache, source: Request | TokenInput) -> np.ndarray:
    if isinstance(source, Request):
        if source.owner is not cache or not source.is_active:
            raise InvalidRequestError("export_layout: not an active request of this cache")
        return np.array(source.token_array()[: source.num_committed])
    return as_tokens(source, "tokens")


def _window_pages(path: list[Node], first: int, end: int) -> np.ndarray:
    """The live SWA pages of absolute pages ``[first, end)``."""
    parts: list[Pages] = []
    for nd in path:
        lo, hi = max(first, nd.start_page), min(end, nd.end_page)
        if hi <= lo:
            continue
        live_abs = nd.end_page - len(nd.swa_pages)
        require(live_abs <= lo, f"export: window page {lo} of {nd!r} is not live")
        parts.append(nd.swa_pages[lo - live_abs : hi - live_abs])
    return np.fromiter(chain.from_iterable(parts), np.int64)


# -- receiver --------------------------------------------------------------------------------


def plan_import(
    cache: ShadowRadixCache, tokens: TokenInput, layout: PrefixLayout, *, namespace: Hashable = None
) -> ImportPlan:
    """Which of ``layout``'s pages this cache lacks to hold its prefix with a live window.
    Pure. Raises `ImportRefused` (another page size, window or streams; replay-derived state;
    no room even after eviction) and `InvalidRequestError` unless ``tokens`` start with the
    layout's tokens."""
    _check_compatible(cache.config, layout)
    arr = _covered(tokens, layout)
    walk = _Walked(cache, arr, namespace)
    first, num_pages = layout.window_first_page, layout.num_pages
    swa_abs = walk.revive_pages(first) + list(range(max(walk.num_pages, first), num_pages))
    plan = ImportPlan(
        num_tokens=layout.num_tokens,
        reused_pages=walk.num_pages,
        full_index=tuple(range(walk.num_pages, num_pages)),
        swa_index=tuple(k - first for k in swa_abs),
        version=cache._tree.version,
    )
    _check_room(cache, plan, walk.evictable_on_path(first))
    return plan


def import_prefix(
    cache: ShadowRadixCache, tokens: TokenInput, layout: PrefixLayout, *, namespace: Hashable = None
) -> ImportReceipt:
    """Allocate the pages `plan_import` names in this cache's pools (evicting what it must, never
    the prefix's own path), insert the prefix into the tree (a new leaf beyond what the tree
    holds; tombstoned window pages revived), and return where each sender page lands. The
    prefix is then matchable and evictable like any cached prefix (`pin` it to keep it).

    All or nothing: raises as `plan_import` does and changes nothing. The caller must fill
    every page of the receipt before anything reads the prefix (an admission of it)."""
    plan = plan_import(cache, tokens, layout, namespace=namespace)
    need_v, need_s = plan.needed
    if not need_v and not need_s:
        return ImportReceipt(layout.num_tokens, plan.reused_pages, _empty(Pool.FULL),
                             _empty(Pool.SWA), EvictionReport())  # fmt: skip
    arr, tree, first = _covered(tokens, layout), cache._tree, layout.window_first_page
    node = _Walked(cache, arr, namespace).split_end()
    held = [] if node.is_root else [cache._locks.lock_full(node)]
    if node.end_page > first and not node.is_root:
        held.append(cache._locks.lock_swa(node, first))
    try:
        evicted = cache._reserve(need_v, need_s)
    except CapacityError as exc:  # the plan's check makes this unreachable; stay all or nothing
        for receipt in held:
            cache._locks.unlock(receipt)
        raise ImportRefused(RefusalReason.NO_ROOM, str(exc), plan.needed) from exc
    vpages, spages = cache._full.allocate(need_v), cache._swa.allocate(need_s)
    swa_of = dict(zip((first + j for j in plan.swa_index), spages))
    path = [] if node.is_root else node.path_from_root()
    for nd in path:
        live_abs = nd.end_page - len(nd.swa_pages)
        revived = [swa_of[k] for k in range(max(first, nd.start_page), live_abs)]
        if revived:
            tree.revive(nd, tuple(revived))
    if need_v:
        p, lo = cache.config.page_size, node.end_page
        live = [swa_of[k] for k in range(max(lo, first), layout.num_pages)]
        leaf = tree.add_leaf(node, arr[lo * p :].copy(), tuple(vpages), tuple(live),
                             layout.approximate)  # fmt: skip
        path.append(leaf)
    tree.touch(path)
    for receipt in reversed(held):
        cache._locks.unlock(receipt)
    cache._debug_check()
    return ImportReceipt(
        layout.num_tokens,
        plan.reused_pages,
        _page_map(Pool.FULL, layout, plan.full_index, vpages),
        _page_map(Pool.SWA, layout, plan.swa_index, spages),
        evicted,
    )


def _empty(pool: Pool) -> PageMap:
    return PageMap(pool, NO_PAGES, NO_PAGES, NO_PAGES)


def _page_map(pool: Pool, layout: PrefixLayout, index: tuple[int, ...], dst: list[int]) -> PageMap:
    idx = frozen_pages(index)
    return PageMap(pool, idx, frozen_pages(layout.pages_of(pool)[idx]), frozen_pages(dst))


def _check_compatible(config: CacheConfig, layout: PrefixLayout) -> None:
    if not isinstance(layout, PrefixLayout):
        raise InvalidRequestError(f"need a PrefixLayout, got {type(layout).__name__}")
    ours = (config.page_size, config.window, config.streams)
    theirs = (layout.page_size, layout.window, layout.streams)
    if ours != theirs:
        raise ImportRefused(
            RefusalReason.MISMATCH, f"layout of page/window/streams {theirs}, this cache {ours}"
        )
    if layout.approximate:
        raise ImportRefused(RefusalReason.UNSUPPORTED, "the prefix holds replay-derived state")


def _covered(tokens: TokenInput, layout: PrefixLayout) -> np.ndarray:
    arr = as_tokens(tokens, "tokens")[: layout.num_tokens]
    if len(arr) != layout.num_tokens or not np.array_equal(arr, layout.tokens):
        raise InvalidRequestError("tokens do not start with the layout's tokens")
    return arr


def _check_room(cache: ShadowRadixCache, plan: ImportPlan, on_path: tuple[int, int]) -> None:
    """Room for the plan once its own path is locked (its pages then stop being evictable)."""
    available = (
        cache._full.num_free + cache._index.full_evictable - on_path[0],
        cache._swa.num_free + cache._index.swa_evictable - on_path[1],
    )
    if plan.needed[0] > available[0] or plan.needed[1] > available[1]:
        raise ImportRefused(
            RefusalReason.NO_ROOM,
            f"need {plan.needed} (virtual, SWA) pages, {available} free or evictable",
            plan.needed,
            available,
        )


class _Walked:
    """The receiver's tree walk over a layout's tokens: the nodes and pages it already holds."""

    def __init__(self, cache: ShadowRadixCache, arr: np.ndarray, namespace: Hashable) -> None:
        try:
            hash(namespace)
        except TypeError:
            raise InvalidRequestError(f"namespace must be hashable, got {namespace!r}") from None
        self.cache = cache
        self.root = cache._tree.root_of(namespace)
        self.walk = cache._tree.walk(arr, start=self.root)
        self.num_pages = self.walk.num_pages

    def spans(self) -> list[tuple[Node, int, int]]:
        """(node, first, end) absolute pages of each walked node's part the walk covers."""
        out, nodes = [], self.walk.nodes
        for i, nd in enumerate(nodes):
            walked = self.walk.last_pages if i == len(nodes) - 1 else nd.num_pages
            if walked:
                out.append((nd, nd.start_page, nd.start_page + walked))
        return out

    def revive_pages(self, first: int) -> list[int]:
        """Window pages (from ``first``) the tree holds tombstoned."""
        out: list[int] = []
        for nd, lo, hi in self.spans():
            out += range(max(lo, first), min(hi, nd.end_page - len(nd.swa_pages)))
        return out

    def evictable_on_path(self, first: int) -> tuple[int, int]:
        """(virtual, SWA) pages now evictable that the import's locks will protect."""
        full = swa = 0
        for nd, lo, hi in self.spans():
            full += (hi - lo) if nd.full_lock_ref == 0 else 0
            live_abs = nd.end_page - len(nd.swa_pages)
            swa += max(0, min(hi, lo + nd.protect_from()) - max(lo, first, live_abs))
        return full, swa

    def split_end(self) -> Node:
        """The node ending at the walk's end (splitting the last walked node if needed)."""
        spans = self.spans()
        if not spans:
            return self.root
        nd, lo, hi = spans[-1]
        return self.cache._tree.split(nd, hi - lo) if hi < nd.end_page else nd
