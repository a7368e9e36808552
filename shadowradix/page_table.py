"""A request's virtual page table, sharing its admitted prefix with the tree.

At admission a request's first pages are those of the tree path it resumes after. The table
keeps that path's node page tuples as they are (immutable: splits and inserts make new ones),
so admitting a 128K-token prefix costs O(path nodes), not O(pages). Pages from ``base`` on are
the request's own list::

    pages   [0 ............. base)  [base ................ len)
            shared: the path's node  own: a list (inserted later, or private;
            tuples                   the cache appends, replaces and truncates here)

Readers see an immutable sequence of ints (``len``, indexing, slicing to a list, iteration,
``==`` with any list or tuple, ``np.asarray``: a new array). Every array it hands out is
read-only or a copy; ``own`` and the mutators below are the cache's, never a reader's.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from itertools import chain
from typing import Any, overload

import numpy as np

_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False


def page_array(pages: Sequence[int]) -> np.ndarray:
    """``pages`` as a new read-only int64 array. Packing the ints with `struct` costs half of
    ``np.fromiter`` (a third of ``np.asarray``) once there are a few dozen of them."""
    n = len(pages)
    if n < 32:
        out = np.fromiter(pages, np.int64, n)
        out.flags.writeable = False
        return out
    return np.frombuffer(struct.pack(f"{n}q", *pages), np.int64)  # read-only: over bytes


class PageTable(Sequence[int]):
    __slots__ = ("_segments", "_flat", "_shared", "base", "own")

    def __init__(self, segments: Sequence[tuple[int, ...]] = ()) -> None:
        self._segments = tuple(segments)
        self._flat: tuple[int, ...] | None = None  # the segments concatenated, on first need
        self._shared: np.ndarray | None = None  # ``_flat`` as an array, on first need
        #: pages held in the shared segments; page ``base + i`` is ``own[i]``
        self.base = sum(len(s) for s in self._segments)
        self.own: list[int] = []

    def __len__(self) -> int:
        return self.base + len(self.own)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            lo, hi, step = index.indices(len(self))
            return self.slice(lo, hi) if step == 1 else self.tolist()[index]
        i = index + len(self) if index < 0 else index
        if not 0 <= i < len(self):
            raise IndexError("page table index out of range")
        return self.own[i - self.base] if i >= self.base else self.flat()[i]

    def slice(self, lo: int, hi: int | None = None) -> list[int]:
        """Pages ``[lo, hi)`` (to the end without ``hi``) as a new list; ``0 <= lo``."""
        b = self.base
        if hi is None:
            hi = b + len(self.own)
        if lo >= b:
            return self.own[lo - b : max(hi - b, 0)]
        head = list(self.flat()[lo : min(hi, b)])
        return head + self.own[: hi - b] if hi > b else head

    def flat(self) -> tuple[int, ...]:
        """The shared pages ``[0, base)`` as one tuple (a node's own, for a one-node path)."""
        if self._flat is None:
            segs = self._segments
            self._flat = segs[0] if len(segs) == 1 else tuple(chain.from_iterable(segs))
        return self._flat

    def shared(self) -> np.ndarray:
        """The shared pages ``[0, base)`` as one read-only array (made on first need)."""
        if self._shared is None:
            self._shared = page_array(self.flat()) if self.base else _EMPTY
        return self._shared

    def tolist(self) -> list[int]:
        return [*self.flat(), *self.own]

    def __iter__(self) -> Iterator[int]:
        return chain(self.flat(), self.own)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.concatenate((self.shared(), page_array(self.own)))
        return out if dtype is None else out.astype(dtype)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (PageTable, list, tuple)):
            return self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PageTable({self.tolist()!r})"

    # -- the cache's changes (all on the own part; a change below ``base`` copies once) ------

    def extend(self, pages: list[int]) -> None:
        self.own.extend(pages)

    def replace(self, lo: int, hi: int, pages: list[int]) -> None:
        """Pages ``[lo, hi)`` become ``pages`` (same length)."""
        if lo < self.base:
            self._unshare()
        b = self.base
        self.own[lo - b : hi - b] = pages

    def truncate(self, num_pages: int) -> None:
        """Keep the first ``num_pages`` pages."""
        if num_pages < self.base:
            self._unshare()
        del self.own[num_pages - self.base :]

    def _unshare(self) -> None:
        self.own = self.tolist()
        self._segments, self._flat, self._shared, self.base = (), None, None, 0
