"""Prefix matching: the longest reusable prefix of a prompt (`ShadowRadixCache.match_prefix`), the
deepest boundary whose window is live, the replay alternative, and the checks that let a match
taken earlier still be admitted after the tree changed elsewhere."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import numpy as np

from . import slots
from .errors import InvalidRequestError, StaleMatchError
from .node import Node
from .radix_tree import RadixTree, Walk
from .results import MatchResult, WindowSource
from .validation import TokenInput, as_tokens

if TYPE_CHECKING:
    from .config import CacheConfig

#: `MatchResult`'s ``__init__`` fields, in order (`_sealed` fills them without the frozen
#: ``__init__``'s per-field ``object.__setattr__``)
_MATCH_FIELDS = tuple(f.name for f in dataclasses.fields(MatchResult) if f.init)


class PrefixMatching:
    """Mixed into `ShadowRadixCache` (see there for the state it names)."""

    if TYPE_CHECKING:
        config: CacheConfig
        _tree: RadixTree

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
        arr = as_tokens(tokens, "tokens")
        if max_len is not None:
            if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)):
                raise InvalidRequestError(f"max_len must be an int, got {max_len!r}")
            if max_len < 0:
                raise InvalidRequestError(f"max_len must be >= 0, got {max_len}")
            return self._match(arr[:max_len], self._hashable(namespace), arr)
        return self._match(arr, self._hashable(namespace), arr)

    @staticmethod
    def _hashable(namespace: Hashable) -> Hashable:
        try:
            hash(namespace)
        except TypeError:
            raise InvalidRequestError(f"namespace must be hashable, got {namespace!r}") from None
        return namespace

    def _match(
        self, arr: np.ndarray, namespace: Hashable, source: np.ndarray | None = None
    ) -> MatchResult:
        """`match_prefix` of validated tokens (``arr``: ``source`` or a prefix of it)."""
        root = self._tree.root_of(namespace)
        walk = self._tree.walk(arr, start=root)
        cached_len = walk.num_pages * self.config.page_size
        node, node_pages = self._deepest_live(walk, root)
        prefix_len = (node.start_page + node_pages) * self.config.page_size
        replay_gain = cached_len - self.config.window
        if self.config.bounded_replay and replay_gain > prefix_len:
            return self._sealed(
                walk.nodes[-1],
                source,
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
        window = WindowSource.LIVE if prefix_len else WindowSource.NONE
        return self._sealed(
            walk.nodes[-1] if walk.nodes else root,
            source,
            len(arr),
            cached_len,
            prefix_len,
            prefix_len,
            window,
            None,
            node,
            node_pages,
            self._tree.version,
            arr,
            self._any_approximate(walk, node),
            self,
            namespace,
        )

    def _sealed(self, walk_end: Node, source: object, *values: Any) -> MatchResult:
        """The `MatchResult` of ``values`` (its ``__init__`` fields in order), sealed by this
        cache, as ``MatchResult(*values)`` with ``_seal``, ``_walk_end``, ``_source`` set."""
        match = object.__new__(MatchResult)
        fields = match.__dict__
        fields.update(zip(_MATCH_FIELDS, values))
        fields["_seal"], fields["_walk_end"], fields["_source"] = self, walk_end, source
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
                and slots.window_first_page(end_page * p, w, p) >= run_start[i]
            ):
                return n, used
        return root, 0

    def _current_match(self, arr: np.ndarray, match: MatchResult) -> MatchResult:
        """``match`` checked, and re-taken against the current tree if that changed."""
        self._check_match(arr, match)
        if match.version == self._tree.version:
            return match
        moved = self._revalidated(match)
        if moved is not None:
            return moved
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
        n, matched = match.prefix_len, match.tokens
        # the array the match was taken from (as `admit(prompt, match_prefix(prompt))` passes
        # it) starts with its own prefix, whatever it holds: only another array is compared
        if len(arr) < n or (
            arr is not matched and arr is not match._source and not (arr[:n] == matched[:n]).all()
        ):
            raise InvalidRequestError("tokens do not start with the matched prefix")

    def _revalidated(self, match: MatchResult) -> MatchResult | None:
        """``match`` carried over to the current tree without walking its tokens again, when no
        change since it was taken can alter it; ``None`` when one may have (match again).

        Splits (another admission cutting a node it walked through) move no page: the match
        holds, its node is whichever now contains its end. It may be altered only by a change
        of a node on the path down to where the walk ended (SWA tombstoned or revived, the
        walk's last node removed: each stamps ``node.changed``) or by growth right where the
        walk ended (a new child, appended pages: ``node.grown``). O(path nodes)."""
        p, v = self.config.page_size, match.version
        walk_end = match._walk_end
        assert walk_end is not None  # sealed matches record it
        node = _containing(walk_end, match.cached_len // p)
        if node.grown > v:
            return None
        up: Node | None = node
        while up is not None:
            if up.changed > v:
                return None
            up = up.parent
        end = (match.cached_len if match.is_replay else match.prefix_len) // p
        at = _containing(node, end)
        return self._sealed(node, match._source, match.query_len, match.cached_len,
                            match.prefix_len, match.hit_len, match.window, match.replay_start,
                            at, end - at.start_page, self._tree.version, match.tokens,
                            match.approximate, self, match.namespace)  # fmt: skip


def _containing(node: Node, end_page: int) -> Node:
    """The node on ``node``'s root path that holds page ``end_page - 1`` (splits above a node
    only ever move its start forward): ``node`` itself unless a split cut it before the end."""
    while node.parent is not None and node.start_page >= end_page:
        node = node.parent
    return node
