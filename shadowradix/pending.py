"""Pending tokens, for overlap scheduling: a decode step's slots planned before the host knows
its input tokens (the step that samples them is still running on the device).

    extend_pending_batch(requests)   one token each, value not known yet: pages taken, the
                                     window kept (nothing released), the token held pending
    resolve_pending(request, token)  its value: committed, the window released, as if
                                     `extend_batch` had appended ``token``
    resolve_draft(request, tokens)   the values of a draft extended with placeholders
    drop_pending(request)            taken back: as if it had never been extended (a request
                                     that turned out to have stopped one step earlier)

A pending token is a one-token draft (`DraftVerbs`): it needs no doubled rings, because a
rejected write of one ring row cannot clobber a row still in flight (``ring_len > span`` for
every stream: `StreamSpec.max_draft_len` is at least 1 without speculation), and `drop_pending`
is `rollback`. Until it is settled the request takes no other extend, and `finish` refuses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .errors import InvalidRequestError
from .request import Request
from .table_edits import TableEdits
from .validation import MAX_TOKEN, TokenInput, as_tokens

if TYPE_CHECKING:
    from .deltas import TableChanges
    from .results import StepPlan


#: the value a pending token holds until it is resolved (never read: nothing inserts it)
_UNKNOWN = 0


class PendingVerbs:
    """Mixed into `ShadowRadixCache` (see there for the state it names)."""

    if TYPE_CHECKING:

        def _check_active(self, request: Request) -> None: ...
        def _check_batch(
            self, requests: Sequence[Request], tokens: Sequence[TokenInput] | np.ndarray
        ) -> None: ...
        def _extend(
            self, requests: Sequence[Request], arrays: list[np.ndarray], draft: bool
        ) -> StepPlan: ...
        def _trim_window(self, request: Request, computed_len: int) -> bool: ...
        def _relock_swa(self, request: Request) -> None: ...
        def _debug_check(self) -> None: ...
        def rollback(self, request: Request, num_tokens: int) -> TableChanges: ...

    def extend_pending_batch(self, requests: Sequence[Request]) -> StepPlan:
        """Append one token of unknown value to each request: one `StepPlan` for the step (its
        writes and deltas as `extend_batch` would give them, less the window release, which
        waits for `resolve_pending`). All or nothing (the errors of `extend_batch`:
        `CapacityError`, `InvalidRequestError` for a request with a pending draft or token)."""
        arrays = [np.array([_UNKNOWN], dtype=np.int64)] * len(requests)
        self._check_batch(requests, arrays)
        return self._extend(requests, arrays, draft=True)

    def resolve_pending(self, request: Request, token: int) -> TableChanges:
        """Give the pending token its value and commit it; the window pages no later step can
        read are released (the deltas name a moved SWA base). Afterwards the request equals one
        that `extend_batch` extended by ``token``. `InvalidRequestError` if it holds no pending
        token or ``token`` is not a token id (nothing changes)."""
        self._check_pending(request)
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
            raise InvalidRequestError(f"a token id must be an int, got {token!r}")
        if not 0 <= token <= MAX_TOKEN:
            raise InvalidRequestError(f"token ids must be in [0, 2**63), got {token}")
        edits = TableEdits(request)
        position = request.length - 1
        request._buf[position - request._base] = token  # a decode position: never shared
        request.num_draft = 0
        if self._trim_window(request, position):
            self._relock_swa(request)
            request._step_stamp = None  # the step's plan no longer matches its tables
        self._debug_check()
        return edits.changes()

    def resolve_draft(self, request: Request, tokens: TokenInput) -> None:
        """Give a pending draft its token values (a draft extended with placeholders: its
        verify step read the tokens on the device; `extend_draft_batch` uses only the count).
        Call it before the draft's `rollback`, which commits the values. Draft positions are
        the request's own (past any shared prefix) and nothing reads their values before the
        rollback commits them. `InvalidRequestError` unless ``tokens`` are exactly the
        request's ``num_draft`` token ids (nothing changes)."""
        self._check_active(request)
        arr = as_tokens(tokens, "tokens")
        if request.num_draft == 0 or len(arr) != request.num_draft:
            raise InvalidRequestError(
                f"request {request.id} holds {request.num_draft} draft tokens, not {len(arr)}"
            )
        end = request.length - request._base
        request._buf[end - len(arr) : end] = arr

    def drop_pending(self, request: Request) -> TableChanges:
        """Take the pending token back: its pages return on top of the free stacks, the request
        equals one never extended by it (`rollback` of a one-token draft). Returns the deltas.
        `InvalidRequestError` if it holds no pending token."""
        self._check_pending(request)
        return self.rollback(request, 1)

    def _check_pending(self, request: Request) -> None:
        self._check_active(request)
        if request.num_draft != 1:
            raise InvalidRequestError(
                f"request {request.id} holds no pending token ({request.num_draft} draft tokens)"
            )
