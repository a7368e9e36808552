"""`PageLives`: when a host page's life begins and ends, learned from the prefix cache's KV events
instead of guessed from the writes.

The C4 host mirror is indexed by virtual page, and the cache reuses a virtual page id once it
freed it. A page's life, as the executor sees it::

    unborn --first write of a step--> born --EVICTED / FREED event--> unborn --> ...
    (never written)  (that write is fresh:     (the coordinator releases it: device copy
                      the page holds nothing)   and host data dropped, before the next step)

The cache says when an id stops being used: ``EVICTED`` (tree pages left the tree) and
``FREED`` (private pages returned to the free list without entering it: a finished or
aborted request's tail, duplicates replaced by the tree's pages, rejected drafts). ``INSERTED``
(private pages joining the tree), ``TOMBSTONED`` and ``REVIVED`` (SWA only) leave the
compressed KV where it is. Any other kind raises `InvalidInputError`: a new way of moving page
ids (a relocation) must be taught here, not ignored.

Births are committed at the next `begin`, not at the write: every C4 layer of a step writes
the same pages, and each layer's first write of a new life is fresh.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from shadowradix.events import KvEvent, KvEventKind

from .errors import InvalidInputError
from .ids import HostPageArray
from .inputs import EMPTY, as_host_pages, distinct

#: the kinds that end the life of their ``vpages``
ENDING = frozenset({KvEventKind.EVICTED, KvEventKind.FREED})
#: the kinds that leave the compressed KV of their pages alone
KEEPING = frozenset({KvEventKind.INSERTED, KvEventKind.TOMBSTONED, KvEventKind.REVIVED})


def ended_pages(events: Iterable[KvEvent], max_host_pages: int) -> HostPageArray:
    """The sorted distinct virtual pages whose life ``events`` end (their ids are free for
    reuse). Raises `InvalidInputError` for an event kind it does not know, or a page id out of
    ``[0, max_host_pages)``."""
    ids: list[int] = []
    for event in events:
        kind = event.kind
        if kind in ENDING:
            ids.extend(event.vpages)
        elif kind not in KEEPING:
            raise InvalidInputError(f"no HiSparse handling for KV event kind {kind!r}")
    if not ids:
        return EMPTY
    return distinct(as_host_pages(np.array(ids, np.int64), max_host_pages, "freed pages"))


class PageLives:
    """Which host pages are born (hold data of their current life), per the cache's events."""

    __slots__ = ("born", "_pending", "max_host_pages")

    def __init__(self, max_host_pages: int) -> None:
        self.max_host_pages = max_host_pages
        self.born = np.zeros(max_host_pages, np.bool_)
        self._pending: list[HostPageArray] = []  # pages written this step, born at `begin`

    def begin(self, events: Iterable[KvEvent]) -> HostPageArray:
        """Start a step: the last step's writes are born, then the lives ``events`` end are
        over. Returns the pages that ended (to release). Raises as `ended_pages`, changing
        nothing."""
        ended = ended_pages(events, self.max_host_pages)
        self.settle()
        if len(ended):
            self.born[ended] = False
        return ended

    def fresh(self, write_pages: HostPageArray) -> np.ndarray:
        """For each of the step's written pages, whether the write starts its life."""
        return ~self.born.take(write_pages)

    def wrote(self, write_pages: HostPageArray) -> None:
        """The step wrote ``write_pages`` (born from the next `begin`, or `settle`)."""
        if len(write_pages):
            self._pending.append(write_pages)

    def settle(self) -> None:
        """The writes so far are born now: a plan that covered every layer of its writes
        (a graph window's commit), which the next plan, possibly before the next `begin` (an
        eager step's commit of the following window), must not see as fresh again."""
        for pages in self._pending:
            self.born[pages] = True
        self._pending = []

    def adopt(self, host_pages: HostPageArray) -> None:
        """Pages given data outside the step loop (a benchmark filling the mirror by hand)."""
        self.born[as_host_pages(host_pages, self.max_host_pages, "host_pages")] = True
