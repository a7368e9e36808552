"""Admit a request and compute its first chunk, or find out it does not fit — without
admitting it.

Engines ask "does this waiting request fit?" before they commit to it (vLLM's
``allocate_slots`` returns ``None``; SGLang's ``PrefillAdder`` budgets with the matched prefix
locked). The core answers that for running requests (`ShadowRadixCache.can_extend`) but has no
admission form: admitting locks the matched path, which takes its pages out of the evictable
count, so free + evictable before admission overstates what the first chunk can have. Here the
prefix is pinned first (the same FULL and SWA locks `admit` takes), the pools are read with the
pin held, and only then is the request admitted (or the pin dropped).

The one change a refusal can leave is a node split where the match ends inside a node: the
split `admit` itself would make, invisible to matching and to page accounting.
"""

from __future__ import annotations

from .. import slots
from ..cache import ShadowRadixCache
from ..errors import CapacityError, InvalidRequestError
from ..locks import PinReceipt
from ..request import Request
from ..results import ExtendCheck, MatchResult, StepPlan
from .protocol import TokenInput, as_tokens


def pages_to_admit(cache: ShadowRadixCache, match: MatchResult, num_tokens: int) -> tuple[int, int]:
    """(virtual, SWA) pages that admitting at ``match`` and extending by ``num_tokens`` takes:
    the pages from the resume point to the end, plus a replayed window's private SWA."""
    p, w = cache.config.page_size, cache.config.window
    prefix_pages = slots.page_of(match.prefix_len, p)
    new_pages = slots.num_pages(match.prefix_len + num_tokens, p) - prefix_pages
    replay_pages = slots.window_num_pages(match.prefix_len, w, p) if match.is_replay else 0
    return new_pages, new_pages + replay_pages


def admission_check(cache: ShadowRadixCache, match: MatchResult, num_tokens: int) -> ExtendCheck:
    """Whether `admit_and_extend` would go through now. Pins and unpins ``match``'s prefix, so
    it can split a node (see the module docstring); changes nothing else."""
    receipt = _pin(cache, match)
    try:
        return _check_pinned(cache, match, num_tokens)
    finally:
        if receipt is not None:
            cache.unpin(receipt)


def admit_and_extend(
    cache: ShadowRadixCache, prompt: TokenInput, match: MatchResult, tokens: TokenInput
) -> tuple[Request, StepPlan]:
    """Admit ``prompt`` at ``match`` and extend it by ``tokens`` (its first chunk), or raise
    `CapacityError` having admitted nothing. Also raises, admitting nothing, what `admit` and
    `extend` raise (`InvalidRequestError`, `StaleMatchError`)."""
    chunk = as_tokens(tokens)  # before admitting: a bad chunk must not leave an admission
    if isinstance(match, MatchResult) and match.prefix_len == 0:
        # The engine planned to compute everything. A fresh empty match says the same, and
        # sidesteps the core re-matching an empty query (a max_len=0 match) once the tree
        # moved on, which it refuses as empty tokens.
        match = cache.match_prefix(prompt, 0, namespace=match.namespace)
    receipt = _pin(cache, match)
    try:
        check = _check_pinned(cache, match, len(chunk))
        if not check.ok:
            if check.short_pool == "swa":
                raise CapacityError("swa", check.swa_pages, check.swa_available)
            raise CapacityError("full", check.full_pages, check.full_available)
        request = cache.admit(prompt, match)
    finally:
        if receipt is not None:
            cache.unpin(receipt)  # the request's own locks hold the prefix now
    return request, cache.extend(request, chunk)


def _pin(cache: ShadowRadixCache, match: MatchResult) -> PinReceipt | None:
    """The locks `admit` would take on ``match``'s prefix (none for an empty one)."""
    if not isinstance(match, MatchResult):
        raise InvalidRequestError(f"expected a MatchResult, got {type(match).__name__}")
    if match.prefix_len == 0:
        return None
    return cache.pin(match.tokens[: match.prefix_len], namespace=match.namespace)


def _check_pinned(cache: ShadowRadixCache, match: MatchResult, num_tokens: int) -> ExtendCheck:
    full_pages, swa_pages = pages_to_admit(cache, match, num_tokens)
    stats = cache.stats()
    return ExtendCheck(
        full_pages,
        swa_pages,
        stats.full.free_pages + stats.full.evictable_pages,
        stats.swa.free_pages + stats.swa.evictable_pages,
    )
