"""Typed errors raised by the core. Every failing call leaves the cache exactly as before."""

from __future__ import annotations


class ShadowRadixError(Exception):
    """Base class of every error the core raises on purpose."""


class ConfigError(ShadowRadixError, ValueError):
    """A `CacheConfig` field (or a runtime re-balance) is invalid."""


class CapacityError(ShadowRadixError):
    """A pool cannot supply the pages an operation needs, even after evicting all it may.

    Attributes name the pool (``"full"`` or ``"swa"``) and the pages needed versus obtainable,
    so a scheduler can defer or preempt the request.
    """

    def __init__(self, pool: str, needed_pages: int, available_pages: int) -> None:
        super().__init__(
            f"{pool} pool exhausted: need {needed_pages} page(s), "
            f"only {available_pages} free or evictable"
        )
        self.pool = pool
        self.needed_pages = needed_pages
        self.available_pages = available_pages

    def __reduce__(self) -> tuple[type[CapacityError], tuple[str, int, int]]:
        """Copies and pickles (a failed request's result keeps its error) rebuild it from its
        attributes: the constructor takes them, not the message."""
        return type(self), (self.pool, self.needed_pages, self.available_pages)


class LockError(ShadowRadixError):
    """A lock receipt was released twice, or does not belong to this cache."""


class InvalidRequestError(ShadowRadixError, ValueError):
    """Bad input: empty or malformed tokens, a finished request, drafts not verified, ..."""


class StaleMatchError(InvalidRequestError):
    """`admit` got a `MatchResult` taken before the tree last changed; match again."""


class StalePlanError(InvalidRequestError):
    """A `StepPlan`'s reads were asked for after a later call changed one of its requests."""


class InvariantError(ShadowRadixError, AssertionError):
    """`check_invariants` found the cache in a state it must never reach (a bug)."""


def require(condition: object, message: str) -> None:
    """Raise `InvariantError` unless ``condition`` holds (works under ``python -O`` too)."""
    if not condition:
        raise InvariantError(message)
