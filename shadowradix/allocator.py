"""Page allocators for the virtual (full) slot space and the SWA pool.

The allocator knows page ids only: no tokens, no bytes. Its free list is a LIFO stack, so an
allocation undone by `give_back` (rejected drafts) restores the exact prior state.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import NewType

import numpy as np

from .errors import CapacityError, ConfigError, InvalidRequestError, require

#: A page of the virtual full-token slot space (compressed shadows derive from it).
VirtualPage = NewType("VirtualPage", int)
#: A page of the physical SWA pool (ring shadows derive from it).
SwaPage = NewType("SwaPage", int)


class PageAllocator:
    """Hands out page ids in ``[0, capacity)``; ``capacity`` may move within ``(0, max_pages]``.

    ``capacity`` is the live size, movable at run time (re-balancing), and every id in use is
    below it, so an adapter's tensors need rows for the live capacity only::

        ids  [0 ......... capacity)  [capacity ........ max_pages)
             used or on the stack     not in use: no physical row

    `grow` pushes the new ids; `shrink` drops the ids from the new capacity on from the stack,
    once the caller has moved every id in use there below it (`relocation`).
    """

    def __init__(self, name: str, capacity: int, max_pages: int) -> None:
        if not 0 < capacity <= max_pages:
            raise ConfigError(f"{name}: need 0 < capacity <= max_pages, got {capacity}/{max_pages}")
        self.name = name
        self.max_pages = max_pages
        self.capacity = capacity
        # Low ids on top of the stack, so small runs stay dense.
        self._free: list[int] = list(range(capacity - 1, -1, -1))

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    @property
    def num_free(self) -> int:
        """Pages obtainable right now without eviction."""
        return len(self._free)

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
        if num_pages > len(free):
            raise CapacityError(self.name, num_pages, len(free))
        if num_pages <= 1:
            return [free.pop()] if num_pages else []
        pages = free[: -num_pages - 1 : -1]  # the top num_pages, first popped first
        del free[-num_pages:]
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages in any order."""
        self._free.extend(pages)

    def give_back(self, pages: list[int]) -> None:
        """Undo the tail of the latest `allocate`: the free stack ends up exactly as before it."""
        self.free(pages[::-1])

    def set_capacity(self, capacity: int) -> None:
        """Grow, or shrink when every id at or above ``capacity`` is free (else, as for a
        capacity outside ``(0, max_pages]``, `ConfigError`, changing nothing). The cache's
        `rebalance` moves ids in use out of the way first (`relocation`)."""
        if not 0 < capacity <= self.max_pages:
            raise ConfigError(
                f"{self.name}: capacity must be in (0, {self.max_pages}], got {capacity}"
            )
        if capacity >= self.capacity:
            self.grow(capacity)
            return
        if self.capacity - capacity > sum(i >= capacity for i in self._free):
            raise ConfigError(f"{self.name}: ids at or above {capacity} are in use: relocate")
        self.shrink(capacity, [])

    def grow(self, capacity: int) -> None:
        """Raise the capacity; the new ids go to the bottom of the stack (used last)."""
        if not self.capacity <= capacity <= self.max_pages:
            raise ConfigError(
                f"{self.name}: cannot grow from {self.capacity} to {capacity} "
                f"(max {self.max_pages})"
            )
        self._free[:0] = range(capacity - 1, self.capacity - 1, -1)
        self.capacity = capacity

    def free_below(self, capacity: int, num_pages: int) -> list[int]:
        """``num_pages`` free ids below ``capacity``, lowest first (the targets of a
        relocation); `InvariantError` if there are fewer."""
        low = sorted(i for i in self._free if i < capacity)
        require(len(low) >= num_pages, f"{self.name}: {len(low)} free ids below {capacity}")
        return low[:num_pages]

    def shrink(self, capacity: int, taken: list[int]) -> None:
        """Lower the capacity to ``capacity`` once no id at or above it is in use: the ids
        ``taken`` (free ids below it that a relocation now uses) leave the stack, and so do
        every id from ``capacity`` on (free now, or the relocation's sources)."""
        require(0 < capacity <= self.capacity, f"{self.name}: cannot shrink to {capacity}")
        gone = set(taken)
        self._free = [i for i in self._free if i < capacity and i not in gone]
        self.capacity = capacity
        require(self.num_used >= 0, f"{self.name}: more pages in use than capacity {capacity}")

    def free_snapshot(self) -> tuple[int, ...]:
        return tuple(self._free)

    def check_invariants(self, owned: np.ndarray) -> None:
        """``owned``: every page id some owner holds (tree or request), possibly with repeats.

        Free list and owners must partition ``[0, capacity)``: no id at or above the capacity,
        no duplicate on the free list, no page owned twice, no owned page on the free list, and
        no page lost (a leak)."""
        cap = self.capacity
        free = np.asarray(self._free, dtype=np.int64)
        require(len(np.unique(free)) == len(free), f"{self.name}: duplicate ids in the free list")
        require(bool(((free >= 0) & (free < cap)).all()), f"{self.name}: bad id freed")
        ids, counts = np.unique(owned, return_counts=True)
        require(
            bool(((ids >= 0) & (ids < cap)).all()),
            f"{self.name}: page id(s) {ids[(ids < 0) | (ids >= cap)]} owned outside [0, {cap})",
        )
        require((counts == 1).all(), f"{self.name}: page(s) {ids[counts > 1]} owned twice")
        require(not np.isin(ids, free).any(), f"{self.name}: an owned page is on the free list")
        require(
            len(ids) == self.num_used,
            f"{self.name}: {self.num_used} pages in use but {len(ids)} owned (leak)",
        )
