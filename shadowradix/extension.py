"""Extending requests by a step: the batch checks, the pages every request needs (all taken
before any request changes, so a failure leaves everything as it was), the general path and the
one-token decode path, and the `Allocation` describing what the step writes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .errors import InvalidRequestError
from .eviction import NO_EVICTION
from .request import Request, RequestState
from .results import Allocation, EvictionReport
from .shadows import Run
from .validation import TokenInput

if TYPE_CHECKING:
    from .allocator import PageAllocator
    from .config import CacheConfig
    from .shadows import Shadows


class StepExtension:
    """Mixed into `ShadowRadixCache` (see there for the state it names)."""

    if TYPE_CHECKING:
        config: CacheConfig
        _full: PageAllocator
        _swa: PageAllocator
        _shadows: Shadows

        def _check_active(self, request: Request) -> None: ...
        def _reserve(self, full_pages: int, swa_pages: int) -> EvictionReport: ...
        def _release_window(self, request: Request, computed_len: int) -> None: ...
        def _debug_check(self) -> None: ...

    def _check_batch(
        self, requests: Sequence[Request], tokens: Sequence[TokenInput] | np.ndarray
    ) -> None:
        for name, value in (("requests", requests), ("tokens", tokens)):
            if type(value) is list or type(value) is tuple:
                continue
            if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
                raise InvalidRequestError(f"{name} must be a sequence, got {type(value).__name__}")
        if len(requests) != len(tokens) or not requests:
            raise InvalidRequestError("need one token list per request, and at least one request")
        if len(requests) > 1 and len({id(r) for r in requests}) != len(requests):
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
        evicted = self._reserve(crossing, crossing) if crossing else NO_EVICTION
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
