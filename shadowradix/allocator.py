"""Page allocators for the virtual (full) slot space and the SWA pool.

The allocator knows page ids only: no tokens, no bytes. Its free list is a LIFO stack, so an
allocation undone by `give_back` (rejected drafts) restores the exact prior state.
"""

from __future__ import annotations

import operator
from typing import NewType

import numpy as np

from .errors import CapacityError, ConfigError, InvalidRequestError, require

#: A page of the virtual full-token slot space (compressed shadows derive from it).
VirtualPage = NewType("VirtualPage", int)
#: A page of the physical SWA pool (ring shadows derive from it).
SwaPage = NewType("SwaPage", int)


class PageAllocator:
    """Hands out page ids in ``[0, max_pages)`` while at most ``capacity`` are in use.

    ``capacity`` is the live size, movable at run time by `set_capacity` (re-balancing); the id
    space stays fixed so adapters size their tensors once.
    """

    def __init__(self, name: str, capacity: int, max_pages: int) -> None:
        if not 0 < capacity <= max_pages:
            raise ConfigError(f"{name}: need 0 < capacity <= max_pages, got {capacity}/{max_pages}")
        self.name = name
        self.max_pages = max_pages
        self.capacity = capacity
        # Low ids on top of the stack, so small runs stay dense.
        self._free: list[int] = list(range(max_pages - 1, -1, -1))

    @property
    def num_used(self) -> int:
        return self.max_pages - len(self._free)

    @property
    def num_free(self) -> int:
        """Pages obtainable right now without eviction (may be negative after a shrink)."""
        return self.capacity - self.max_pages + len(self._free)

    def allocate(self, num_pages: int) -> list[int]:
        """Pop ``num_pages`` ids (first popped first). Raises `CapacityError`, or
        `InvalidRequestError` for a count that is not a non-negative int, changing nothing."""
        if type(num_pages) is not int:  # the cache's own calls skip these checks
            if isinstance(num_pages, (bool, np.bool_)) or not hasattr(num_pages, "__index__"):
                raise InvalidRequestError(
                    f"{self.name}: page count must be an int, got {num_pages!r}"
                )
            num_pages = operator.index(num_pages)
        if num_pages < 0:
            raise InvalidRequestError(f"{self.name}: page count must be >= 0, got {num_pages}")
        free = self._free
        num_free = self.capacity - self.max_pages + len(free)
        if num_pages > num_free:
            raise CapacityError(self.name, num_pages, max(num_free, 0))
        if num_pages <= 1:
            return [free.pop()] if num_pages else []
        pages = free[: -num_pages - 1 : -1]  # the top num_pages, first popped first
        del free[-num_pages:]
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages in any order."""
        self._free.extend(pages)

    def give_back(self, pages: list[int]) -> None:
        """Undo the tail of the latest `allocate`: the free stack ends up exactly as before it."""
        self.free(pages[::-1])

    def set_capacity(self, capacity: int) -> None:
        if not 0 < capacity <= self.max_pages:
            raise ConfigError(
                f"{self.name}: capacity must be in (0, {self.max_pages}], got {capacity}"
            )
        self.capacity = capacity

    def free_snapshot(self) -> tuple[int, ...]:
        return tuple(self._free)

    def check_invariants(self, owned: np.ndarray) -> None:
        """``owned``: every page id some owner holds (tree or request), possibly with repeats.

        Free list and owners must partition the pages in use: no duplicate on the free list,
        no page owned twice, no owned page on the free list, and no page lost (a leak)."""
        free = np.asarray(self._free, dtype=np.int64)
        require(len(np.unique(free)) == len(free), f"{self.name}: duplicate ids in the free list")
        require(bool(((free >= 0) & (free < self.max_pages)).all()), f"{self.name}: bad id freed")
        ids, counts = np.unique(owned, return_counts=True)
        require(bool(((ids >= 0) & (ids < self.max_pages)).all()), f"{self.name}: bad id owned")
        require((counts == 1).all(), f"{self.name}: page(s) {ids[counts > 1]} owned twice")
        require(not np.isin(ids, free).any(), f"{self.name}: an owned page is on the free list")
        require(
            len(ids) == self.num_used,
            f"{self.name}: {self.num_used} pages in use but {len(ids)} owned (leak)",
        )
