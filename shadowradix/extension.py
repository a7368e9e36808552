"""Extending requests by a step: the batch checks, the pages every request needs (all taken
before any request changes, so a failure leaves everything as it was), the general path and the
one-token decode path, and the `StepPlan` describing what the step writes, reads and changes in
the page tables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from . import slots
from .errors import InvalidRequestError, StalePlanError
from .eviction import NO_EVICTION
from .request import Request, RequestState
from .results import EvictionReport, ReadPlan, StepPlan
from .shadows import Run
from .validation import TokenInput

if TYPE_CHECKING:
    from collections.abc import Iterator

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
        _step_stamps: Iterator[int]

        def _read_plan(self, request: Request, start: int) -> ReadPlan: ...
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
    ) -> StepPlan:
        p = self.config.page_size
        needs = [self._pages_needed(r, len(a)) for r, a in zip(requests, arrays)]
        evicted = self._reserve(sum(n[0] for n in needs), sum(n[1] for n in needs))
        pages = self._take_pages(needs)  # before any request changes: all or nothing
        stamp = next(self._step_stamps)
        runs, records = [], []
        for r, a, (vp, sp) in zip(requests, arrays, pages):
            start, base = r.length, r.swa_base
            v_end, s_end = len(r.vpages), base + len(r.swa_pages)
            self._grow(r, vp, sp)
            first = max(r.swa_base, slots.window_first_page(start, self.config.window, p))
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
            r._step_stamp = stamp
            if vp or sp or r.swa_base != base:
                records.append((r.id, v_end, vp, s_end, sp, base, r.swa_base))
        plan = StepPlan(
            tuple([r.id for r in requests]),
            [run.start for run in runs],
            [run.end for run in runs],
            evicted,
            False,
            self._shadows.expander(runs),
            (self._step_reads, tuple(requests), stamp),
            records,
        )
        self._debug_check()
        return plan

    def _extend_decode(self, requests: Sequence[Request], tokens: list[int]) -> StepPlan:
        """One token per request: same contract as `_extend`, with O(1) Python per request."""
        p, w = self.config.page_size, self.config.window
        group_mask = self._shadows.group_mask
        starts = [r._len for r in requests]
        crossing = sum(1 for start in starts if start % p == 0)
        evicted = self._reserve(crossing, crossing) if crossing else NO_EVICTION
        fresh = iter(self._take_pages([(1, 1)] * crossing))
        stamp = next(self._step_stamps)
        vpages: list[int] = []
        spages: list[int] = []
        carry_tables: dict[int, tuple[int, list[int]]] = {}
        records = []
        for i, (r, t, start) in enumerate(zip(requests, tokens, starts)):
            page, base = start // p, r.swa_base
            new = next(fresh) if start % p == 0 else None
            if new is not None:
                self._grow(r, *new)
            table = r.vpages
            vpages.append(table.own[page - table.base])  # a new token's page is never shared
            spages.append(r.swa_pages[page - base])
            if not (start + 1) & group_mask:
                first = max(base, slots.window_first_page(start, w, p))
                carry_tables[i] = (first, r.swa_pages[first - base : page + 1 - base])
            r._append_one(t)
            if page != r.released_at // p:
                self._release_window(r, start)
            r._step_stamp = stamp
            if new is not None:  # the new page is page ``page`` of both tables
                records.append((r.id, page, new[0], page, new[1], base, r.swa_base))
            elif r.swa_base != base:
                records.append((r.id, page + 1, [], page + 1, [], base, r.swa_base))
        plan = StepPlan(
            tuple(r.id for r in requests),
            starts,
            [s + 1 for s in starts],
            evicted,
            False,
            self._shadows.decode_expander(starts, vpages, spages, carry_tables),
            (self._step_reads, tuple(requests), stamp),
            records,
        )
        self._debug_check()
        return plan

    def _step_reads(
        self, requests: tuple[Request, ...], starts: Sequence[int], stamp: int
    ) -> tuple[ReadPlan, ...]:
        """A step's reads (`StepPlan.reads`): `read_plan` of each request from its step's start,
        refused once a later call changed one of the requests (its tables are no longer the
        step's)."""
        for r in requests:
            if r._step_stamp != stamp:
                raise StalePlanError(
                    f"request {r.id} changed since this step: read plan.reads before the next "
                    "call on its requests (or call read_plan)"
                )
        return tuple(self._read_plan(r, s) for r, s in zip(requests, starts))

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
        pages = slots.num_pages(end, p)
        num_v = pages - len(request.vpages)
        num_s = pages - (request.swa_base + len(request.swa_pages))
        return num_v, num_s
