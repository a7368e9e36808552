"""Per-request state: its token list, page tables and lock receipts.

A request's tokens split into a tree-owned prefix (full-locked) and a private tail::

    positions [0 ........ tree_pages*P) [tree_pages*P ......... len)
    vpages     tree (locked path)        private (freed on abort / deduplicated on insert)
    swa        [swa_base ............................................ ) window pages only,
                each either tree-owned (SWA-locked) or private (``swa_owned``)

Like the page table (`PageTable`), the tokens of the prefix it was admitted with are the path's
node arrays, shared and never copied (nodes never change their arrays in place); the tokens from
there on live in the request's own buffer. Admission is then O(path nodes), not O(prefix).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .locks import LockReceipt
from .node import Node
from .page_table import PageTable
from .results import MatchResult

if TYPE_CHECKING:
    from .results import Allocation

_ids = itertools.count()


class RequestState(enum.Enum):
    ACTIVE = "active"
    FINISHED = "finished"
    ABORTED = "aborted"


class Request:
    __slots__ = (
        "id",
        "owner",
        "prompt",
        "_prefix",
        "_base",
        "_buf",
        "_len",
        "num_draft",
        "vpages",
        "tree_pages",
        "terminal",
        "full_receipt",
        "swa_base",
        "swa_pages",
        "swa_owned",
        "swa_receipt",
        "match",
        "state",
        "replay_allocation",
        "released_at",
        "own_leaf",
        "approximate",
        "_step_stamp",
    )

    def __init__(
        self, owner: object, prompt: np.ndarray, match: MatchResult, path: Sequence[Node] = ()
    ) -> None:
        """``path``: the tree nodes holding the matched prefix (``match.prefix_len`` tokens)."""
        self.id = next(_ids)
        self.owner = owner
        self.prompt = prompt
        #: tokens ``[0, _base)``: the admitted path's node arrays; ``[_base, _len)``: ``_buf``
        self._prefix = tuple(n.tokens for n in path)
        self._base = match.prefix_len
        self._buf = np.empty(max(2 * (len(prompt) - self._base), 64), dtype=np.int64)
        self._len = self._base
        self.num_draft = 0
        self.vpages = PageTable()
        self.tree_pages = 0
        self.terminal: Node = match.node
        self.full_receipt: LockReceipt | None = None
        self.swa_base = 0
        self.swa_pages: list[int] = []
        self.swa_owned: list[bool] = []
        self.swa_receipt: LockReceipt | None = None
        self.match = match
        self.state = RequestState.ACTIVE
        #: the window rebuild a replayed hit must run before its first extend
        self.replay_allocation: Allocation | None = None
        #: length at which the window was last trimmed
        self.released_at = match.prefix_len
        #: the leaf this request last inserted (its later inserts extend it in place)
        self.own_leaf: Node | None = None
        #: reads state derived from a bounded replay (its own, or a cached one it reused)
        self.approximate = match.approximate
        #: the stamp of the last `StepPlan` that extended it; ``None`` once another call
        #: changed it (that plan's reads are then stale)
        self._step_stamp: int | None = None

    @property
    def length(self) -> int:
        return self._len

    @property
    def tokens(self) -> list[int]:
        """All tokens (committed, then draft) as a list: a copy, O(length)."""
        return self._all().tolist()  # type: ignore[no-any-return]

    def token_array(self) -> np.ndarray:
        """All tokens as a read-only view (valid until the next change to the request)."""
        return self.tokens_from(0)

    def tokens_from(self, start: int) -> np.ndarray:
        """Tokens ``[start, length)`` as a read-only array (valid until the next change): a
        view, O(1), when ``start`` is past the admitted prefix."""
        base = self._base
        view = self._buf[start - base : self._len - base] if start >= base else self._all()[start:]
        view.flags.writeable = False
        return view

    def _all(self) -> np.ndarray:
        own = self._buf[: self._len - self._base]
        return np.concatenate((*self._prefix, own)) if self._prefix else own

    def _append(self, tokens: np.ndarray | list[int]) -> None:
        i = self._len - self._base
        end = i + len(tokens)
        if end > len(self._buf):
            grown = np.empty(max(2 * len(self._buf), end), dtype=np.int64)
            grown[:i] = self._buf[:i]
            self._buf = grown
        self._buf[i:end] = tokens
        self._len += len(tokens)

    def _append_one(self, token: int) -> None:
        i = self._len - self._base
        if i == len(self._buf):
            self._append([token])
            return
        self._buf[i] = token
        self._len += 1

    def _truncate(self, length: int) -> None:
        if length < self._base:  # below the shared prefix: keep a private copy from now on
            tokens = self._all()
            self._buf = np.empty(max(2 * len(tokens), 64), dtype=np.int64)
            self._buf[: len(tokens)] = tokens
            self._prefix, self._base = (), 0
        self._len = length

    @property
    def num_committed(self) -> int:
        return self._len - self.num_draft

    @property
    def prompt_remaining(self) -> np.ndarray:
        """Prompt tokens not yet extended (empty once the prompt is consumed)."""
        return self.prompt[self._len :] if self._len < len(self.prompt) else self.prompt[:0]

    @property
    def is_active(self) -> bool:
        return self.state is RequestState.ACTIVE

    def swa_held_pages(self) -> int:
        return len(self.swa_pages)

    def __repr__(self) -> str:
        return (
            f"Request(id={self.id}, len={self.length}, draft={self.num_draft}, "
            f"tree_pages={self.tree_pages}, swa=[{self.swa_base}+{len(self.swa_pages)}], "
            f"{self.state.value})"
        )
