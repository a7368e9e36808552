"""Which rank owns which tokens of a context-parallel prefill, and what each rank must receive.

Pure index arithmetic (NumPy, no torch): every rank derives the same plan from ``(length, cp,
chunk_len)``, so no sizes are ever exchanged. The prompt is cut into chunks of ``chunk_len``
tokens dealt round-robin: chunk ``c`` belongs to rank ``c % cp``, and a rank's local tokens are
its chunks in order::

    positions  [0 ........ C)[C ....... 2C)[2C ...... 3C)[3C ...... 4C)[4C .. L)
    owner (cp=2)     0             1             0             1          0
    local row  rank 0: [0, C) -> 0.., [2C, 3C) -> C.., [4C, L) -> 2C..

``chunk_len`` is a multiple of every compression ratio, so no compression group straddles two
ranks: only C4's overlap (entry ``g`` also pools group ``g - 1``) reaches across a boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

I64 = np.int64


class CPLayoutError(ValueError):
    """A context-parallel layout that cannot be executed (sizes, alignment)."""


@dataclass(frozen=True)
class CPLayout:
    """Round-robin chunks of one prompt over ``cp`` ranks. Raises `CPLayoutError` for a
    non-positive size."""

    length: int
    cp: int
    chunk_len: int

    def __post_init__(self) -> None:
        if min(self.length, self.cp, self.chunk_len) < 1:
            raise CPLayoutError(f"length, cp and chunk_len must be positive, got {self}")

    @classmethod
    def for_ratios(cls, length: int, cp: int, chunk_len: int, ratios: tuple[int, ...]) -> CPLayout:
        """A layout whose chunks hold whole compression groups of every ratio in ``ratios``;
        raises `CPLayoutError` otherwise."""
        bad = [r for r in ratios if r and chunk_len % r]
        if bad:
            raise CPLayoutError(
                f"chunk_len {chunk_len} is not a multiple of compression ratio(s) {bad}: a group "
                "would straddle two ranks"
            )
        return cls(length, cp, chunk_len)

    @property
    def num_chunks(self) -> int:
        return -(-self.length // self.chunk_len)

    def owner(self, positions: np.ndarray) -> np.ndarray:
        """The rank holding each position."""
        return (np.asarray(positions, I64) // self.chunk_len) % self.cp

    def local_row(self, positions: np.ndarray) -> np.ndarray:
        """Each position's row in its owner's local token array (chunks in order; only the
        last chunk may be short, and it is the last of its owner's)."""
        p = np.asarray(positions, I64)
        return (p // self.chunk_len) // self.cp * self.chunk_len + p % self.chunk_len

    def positions(self, rank: int) -> np.ndarray:
        """The global positions of ``rank``'s tokens, ascending (maybe none)."""
        self._check_rank(rank)
        starts = np.arange(rank, self.num_chunks, self.cp, dtype=I64) * self.chunk_len
        if not len(starts):
            return np.zeros(0, I64)
        pos = (starts[:, None] + np.arange(self.chunk_len, dtype=I64)[None, :]).ravel()
        return pos[pos < self.length]

    def halo(self, rank: int, window: int) -> np.ndarray:
        """Positions held by other ranks that ``rank``'s windows reach, ascending: for each of
        its chunks, the ``window - 1`` positions before the chunk's start (a window ``(t - W,
        t]`` past the first token of a chunk lies in the chunk itself)."""
        starts = self.positions(rank)
        starts = starts[starts % self.chunk_len == 0]
        reach = (starts[:, None] - np.arange(1, window, dtype=I64)[None, :]).ravel()
        reach = np.unique(reach[reach >= 0])
        return reach[self.owner(reach) != rank]

    def complete_groups(self, rank: int, ratio: int) -> np.ndarray:
        """Groups ``g`` of ``ratio`` whose tokens ``[g r, (g + 1) r)`` are all prompt tokens
        of ``rank``, ascending."""
        pos = self.positions(rank)
        firsts = pos[(pos % ratio == 0) & (pos + ratio <= self.length)]
        return firsts // ratio

    def crosses(self, groups: np.ndarray, ratio: int) -> np.ndarray:
        """Whether group ``g`` and group ``g - 1`` live on different ranks (false for g = 0)."""
        g = np.asarray(groups, I64)
        prev = np.maximum(g - 1, 0) * ratio
        return (g > 0) & (self.owner(prev) != self.owner(g * ratio))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.cp:
            raise CPLayoutError(f"rank {rank} is not in a context-parallel group of {self.cp}")
