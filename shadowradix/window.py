"""The SWA window a running request holds: which pages it may drop once every later step has
moved past them, and the lock that keeps the tree pages it still reads from being tombstoned::

    request pages   [ dropped ........ | swa_base .... window held .... | new pages )
                                        ^ F - window (F: the last page boundary computed)"""

from __future__ import annotations

from itertools import chain, compress
from typing import TYPE_CHECKING

from . import slots
from .node import Node, Pages
from .request import Request

if TYPE_CHECKING:
    from .allocator import PageAllocator
    from .config import CacheConfig
    from .locks import LockTable
    from .radix_tree import RadixTree


class WindowTrim:
    """Mixed into `ShadowRadixCache` (see there for the state it names)."""

    if TYPE_CHECKING:
        config: CacheConfig
        _swa: PageAllocator
        _locks: LockTable
        _tree: RadixTree

    def _tree_swa_pages(self, node: Node, first_page: int, end_page: int) -> list[int]:
        """Live tree SWA pages for ``[first_page, end_page)`` along the path ending at ``node``."""
        parts: list[Pages] = []
        n: Node | None = node
        while n is not None and not n.is_root and n.end_page > first_page:
            lo = max(first_page, n.start_page) - n.start_page
            assert lo >= n.live_from, "window pages must be live SWA"
            parts.append(n.swa_pages[lo - n.live_from :])
            n = n.parent
        return list(chain.from_iterable(reversed(parts)))

    def _release_window(self, request: Request, computed_len: int) -> None:
        """Drop the window pages no step after ``computed_len`` tokens can read, and re-lock."""
        if self._trim_window(request, computed_len):
            self._relock_swa(request)

    def _trim_window(self, request: Request, computed_len: int) -> bool:
        """Forget window pages before ``F - window`` (``F``: the last page boundary at or before
        ``computed_len``); free the private ones. Keeping ``[F - window, F)`` means inserting
        the request later leaves a live window before ``F`` (a full aligned hit). Returns
        whether any page was dropped (the SWA lock then needs re-taking)."""
        p = self.config.page_size
        request.released_at = max(request.released_at, computed_len)
        new_base = slots.held_window_first_page(request.released_at, self.config.window, p)
        drop = new_base - request.swa_base
        if drop <= 0:
            return False
        owned = request.swa_owned[:drop]  # runs of one kind are the rule: skip compress for them
        if all(owned):
            freed = request.swa_pages[:drop]
        else:
            freed = list(compress(request.swa_pages, owned)) if any(owned) else []
        self._swa.free(freed)
        if freed and self._tree.events is not None:
            self._tree.events.freed([], freed)
        del request.swa_pages[:drop], request.swa_owned[:drop]
        request.swa_base = new_base
        return True

    def _relock_swa(self, request: Request) -> None:
        """Re-take the SWA lock so it covers exactly the tree pages in the request's window."""
        old = request.swa_receipt
        tree_part = request.swa_owned[: max(0, request.tree_pages - request.swa_base)]
        request.swa_receipt = None
        if not all(tree_part):
            request.swa_receipt = self._locks.lock_swa(request.terminal, request.swa_base)
        if old is not None:
            self._locks.unlock(old)
