"""Speculative drafts: `extend_draft` / `extend_draft_batch` append tokens a verifier has not
accepted yet, and `rollback` settles each request's draft (rejected pages go back on top of the
free stacks, so the pools end as if only the accepted tokens had been extended)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from . import slots
from .errors import InvalidRequestError
from .request import Request
from .table_edits import TableEdits
from .validation import TokenInput, as_count, as_tokens

if TYPE_CHECKING:
    from .allocator import PageAllocator
    from .config import CacheConfig
    from .deltas import TableChanges
    from .radix_tree import RadixTree
    from .results import StepPlan


class DraftVerbs:
    """Mixed into `ShadowRadixCache` (see there for the state it names)."""

    if TYPE_CHECKING:
        config: CacheConfig
        _full: PageAllocator
        _swa: PageAllocator
        _tree: RadixTree

        def _check_active(self, request: Request) -> None: ...
        def _check_batch(
            self, requests: Sequence[Request], tokens: Sequence[TokenInput] | np.ndarray
        ) -> None: ...
        def _extend(
            self, requests: Sequence[Request], arrays: list[np.ndarray], draft: bool
        ) -> StepPlan: ...
        def _release_window(self, request: Request, computed_len: int) -> None: ...
        def _debug_check(self) -> None: ...

    def extend_draft(self, request: Request, tokens: TokenInput) -> StepPlan:
        """Append speculative draft tokens; `rollback` must settle them before anything else.

        Needs ``speculative=True`` (doubled rings) and at most ``config.max_draft_len`` tokens.
        """
        return self.extend_draft_batch([request], [tokens])

    def extend_draft_batch(
        self, requests: Sequence[Request], tokens: Sequence[TokenInput] | np.ndarray
    ) -> StepPlan:
        """Append draft tokens to several requests at once: one `StepPlan` for the verify step.

        Each request gets its own pending draft, settled by its own `rollback`. All or nothing:
        every check (the errors of `extend_draft` for each request) and the capacity check run
        before anything changes. Pages are allocated request by request, in batch order; rolling
        the requests back in reverse order after rejecting every draft restores the exact free
        stacks. A partial acceptance equals never drafting up to a renaming of page ids (see
        docs/speculative.md).
        """
        self._check_batch(requests, tokens)
        arrays = [as_tokens(t, "tokens") for t in tokens]
        if not self.config.speculative:
            raise InvalidRequestError("extend_draft needs CacheConfig(speculative=True)")
        limit = self.config.max_draft_len
        longest = max(len(a) for a in arrays)
        if limit is not None and longest > limit:
            raise InvalidRequestError(f"draft of {longest} tokens exceeds max_draft_len={limit}")
        return self._extend(requests, arrays, draft=True)

    def rollback(self, request: Request, num_tokens: int) -> TableChanges:
        """Reject the last ``num_tokens`` draft tokens and commit the rest of the draft.

        Afterwards tree and pools equal a run that extended only the accepted tokens (unless
        the draft's allocation had to evict): rejected pages go back on top of the free stacks.
        Returns the deltas: both tables cut after the last accepted page, the window trimmed.
        """
        self._check_active(request)
        count = as_count(num_tokens)
        if count is None or count > request.num_draft:
            raise InvalidRequestError(
                f"can roll back 0..{request.num_draft} draft tokens, not {num_tokens!r}"
            )
        num_tokens = count
        edits = TableEdits(request)
        p = self.config.page_size
        start = request.length - request.num_draft
        accepted = request.num_draft - num_tokens
        end = start + accepted
        keep_pages = slots.num_pages(end, p)
        rejected_s = request.swa_pages[keep_pages - request.swa_base :]
        rejected_v = request.vpages.slice(keep_pages)
        self._swa.give_back(rejected_s)
        del (
            request.swa_pages[keep_pages - request.swa_base :],
            request.swa_owned[keep_pages - request.swa_base :],
        )
        self._full.give_back(rejected_v)
        request.vpages.truncate(keep_pages)
        if self._tree.events is not None:
            self._tree.events.freed(rejected_v, rejected_s)
        request._truncate(end)
        request.num_draft = 0
        if accepted:
            self._release_window(request, start)
        request._step_stamp = None
        self._debug_check()
        return edits.changes()
