"""`PrefixCache`: what an engine needs from a prefix cache, independent of how it is built.

Two implementations live beside it: `radix.ShadowRadixPrefixCache` (the core behind it) and
`naive.NaivePrefixCache` (a deliberately simple full-token cache, the second oracle and the A/B
baseline). The engine-shaped shims (`sglang`, `vllm`) speak their engine's vocabulary over the
core directly; this protocol is the engine-neutral contract the two implementations share, so
one test machine can drive both and compare them.

Units are raw tokens; a page holds ``page_size`` of them and only whole pages are cached. The
lifecycle is ``match`` → ``admit`` → ``extend`` (prefill chunks, decoded tokens) →
``cache_unfinished`` (any time) → ``finish`` or ``abort``. Every call that raises leaves the
cache as it was; errors are `shadowradix.errors` types:

* `InvalidRequestError`: bad tokens or lengths, a request or hit of another cache, a request
  that is no longer active, a hit that does not prefix the prompt; `StaleMatchError` (a
  subclass) when the cache changed under a hit in a way that changes it;
* `CapacityError`: ``extend`` cannot find the pages even after evicting all it may;
* `LockError`: ``unlock`` of a lock that is not live (a double unlock).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import numpy as np

from ..errors import InvalidRequestError

TokenInput = Sequence[int] | np.ndarray

R = TypeVar("R")
_MAX_TOKEN = 2**63 - 1


def as_tokens(tokens: object, what: str = "tokens") -> list[int]:
    """``tokens`` as a list of ints, or `InvalidRequestError` (a non-empty 1-D sequence of
    non-negative ints below 2**63, the core's rule)."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise InvalidRequestError(f"{what} must be a 1-D integer array")
        tokens = tokens.tolist()
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence) or not tokens:
        raise InvalidRequestError(f"{what} must be a non-empty 1-D sequence of ints")
    out = []
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise InvalidRequestError(f"{what} must be ints, got {t!r}")
        if not 0 <= t <= _MAX_TOKEN:
            raise InvalidRequestError(f"{what} must be token ids in [0, 2**63), got {t}")
        out.append(int(t))
    return out


@dataclass(frozen=True)
class PrefixHit:
    """What ``match`` found for ``query_len`` tokens, with
    ``hit_len <= prefix_len <= cached_len <= query_len``:

    * ``cached_len``: the page-aligned prefix whose full-token KV the cache holds;
    * ``prefix_len``: where a request admitted with this hit resumes;
    * ``hit_len``: the tokens whose computation it skips (shorter than ``prefix_len`` only when
      a window is replayed).

    ``source`` is the implementation's own record, which its ``admit`` accepts; a hit of one
    cache is refused by another."""

    query_len: int
    cached_len: int
    prefix_len: int
    hit_len: int
    namespace: Hashable = None
    source: object = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class PrefixLock:
    """Proof of one ``lock``: ``tokens`` of the prefix are kept from eviction until
    ``unlock`` (0 when nothing was cached). ``source`` is the implementation's own receipt."""

    id: int
    tokens: int
    namespace: Hashable = None
    source: object = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class CacheSizes:
    """Full-token pool accounting in tokens: ``free + evictable + protected + held ==
    capacity``. ``cached_tokens`` (``evictable + protected``) is what the cache holds;
    ``held_tokens`` are requests' private pages."""

    page_size: int
    capacity_tokens: int
    free_tokens: int
    evictable_tokens: int
    protected_tokens: int
    held_tokens: int

    @property
    def cached_tokens(self) -> int:
        return self.evictable_tokens + self.protected_tokens


class PrefixCache(Protocol[R]):
    """A prefix cache an engine embeds; ``R`` is its request handle (read ``length`` and
    ``id`` from it, change it only through the cache). Not thread-safe: one scheduler thread."""

    @property
    def page_size(self) -> int: ...

    def match(
        self, tokens: TokenInput, max_len: int | None = None, *, namespace: Hashable = None
    ) -> PrefixHit:
        """The longest reusable prefix of ``tokens[:max_len]`` in ``namespace`` (prefixes never
        match across namespaces). Pure: changes nothing, not even recency."""
        ...

    def admit(self, tokens: TokenInput, hit: PrefixHit | None = None) -> R:
        """Start a request whose prompt is ``tokens``, resuming after ``hit`` (matched now if
        omitted); the reused prefix is locked while the request runs."""
        ...

    def can_extend(self, request: R, num_tokens: int) -> bool:
        """Whether ``extend`` by ``num_tokens`` would find its pages now (after evicting)."""
        ...

    def extend(self, request: R, tokens: TokenInput) -> tuple[int, ...]:
        """Append computed tokens; returns the full-token page ids appended to the request's
        page table (evicting unlocked prefixes if needed)."""
        ...

    def page_table(self, request: R) -> tuple[int, ...]:
        """The request's full-token page ids, one per page of its length. Inserting can
        replace ids with the cache's copies of the same prefix: re-read it after
        ``cache_unfinished``."""
        ...

    def cache_unfinished(self, request: R) -> None:
        """Insert the request's whole computed pages; it keeps running. Never allocates."""
        ...

    def finish(self, request: R) -> None:
        """Insert the whole computed pages, then release the request's locks and pages."""
        ...

    def abort(self, request: R) -> None:
        """Release the request without inserting anything more."""
        ...

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` of unlocked cached prefixes, least recently used first,
        as far as there are; returns the tokens freed."""
        ...

    def lock(self, tokens: TokenInput, *, namespace: Hashable = None) -> PrefixLock:
        """Keep the reusable prefix of ``tokens`` (what ``match`` finds) until ``unlock``."""
        ...

    def unlock(self, lock: PrefixLock) -> None: ...

    def sizes(self) -> CacheSizes: ...

    def reset(self) -> None:
        """Drop every cached prefix; refused (`InvalidRequestError`) while requests run or
        locks are held."""
        ...

    def check_invariants(self) -> None:
        """Raise `InvariantError` if the cache's bookkeeping is inconsistent (a bug). A protocol
        signature: `ShadowRadixPrefixCache` and `NaivePrefixCache` implement it
        (tests/test_integrations_naive.py shows both firing on a corrupted state)."""
