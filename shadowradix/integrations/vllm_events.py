"""The core's `KvEvent`s as vLLM-shaped ``BlockStored`` / ``BlockRemoved`` per KV-cache group.

Pages enter the tree only through one request's insert, so the shim drains the core's events
right after each call, with that request at hand: its tokens fill ``token_ids`` and its page
table names the parent page, whose hash an earlier ``INSERTED`` event gave. (The core's event
does not carry the parent's hash; a consumer that chains hashes needs it.)

=================  ==========================================  =============================
core event         group 0 (full / compressed)                 group 1 (SWA)
=================  ==========================================  =============================
INSERTED           BlockStored, every page                     BlockStored, the live suffix
EVICTED            BlockRemoved, every page                    BlockRemoved, the live suffix
TOMBSTONED         (compressed KV stays)                       BlockRemoved
REVIVED            (already stored)                            BlockStored
=================  ==========================================  =============================
"""

from __future__ import annotations

from ..events import KvEvent, KvEventKind
from ..request import Request
from .vllm_types import BlockRemoved, BlockStored, KVCacheEvent

FULL_GROUP, SWA_GROUP = 0, 1


class EventTranslator:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._hash: dict[int, int] = {}  # virtual page in the tree -> its chained hash
        self.events: list[KVCacheEvent] = []

    def clear(self) -> None:
        self._hash.clear()

    def add(self, events: list[KvEvent], request: Request | None) -> None:
        """Translate ``events`` of one core call; ``request``: the request it inserted."""
        for e in events:
            if e.kind is KvEventKind.INSERTED:
                self._hash.update(zip(e.vpages, e.page_hashes))
                self._stored(e, e.vpages, FULL_GROUP, request)
                self._stored(e, e.vpages[len(e.vpages) - len(e.swa_pages) :], SWA_GROUP, request)
            elif e.kind is KvEventKind.REVIVED:
                self._stored(e, e.vpages, SWA_GROUP, request)
            elif e.kind is KvEventKind.TOMBSTONED:
                self._removed(e.vpages, SWA_GROUP)
            else:
                live = e.vpages[len(e.vpages) - len(e.swa_pages) :]
                self._removed(e.vpages, FULL_GROUP)
                self._removed(live, SWA_GROUP)
                for v in e.vpages:
                    del self._hash[v]

    def _stored(
        self, e: KvEvent, vpages: tuple[int, ...], group: int, request: Request | None
    ) -> None:
        if not vpages:
            return
        assert request is not None, "pages enter the tree only through a request's insert"
        p = self.page_size
        first = e.first_page + (len(e.vpages) - len(vpages))
        parent = self._hash[request.vpages[first - 1]] if first else None
        tokens = request.token_array()[first * p : (first + len(vpages)) * p]
        hashes = tuple(self._hash[v] for v in vpages)
        self.events.append(BlockStored(hashes, parent, tuple(tokens.tolist()), p, group))

    def _removed(self, vpages: tuple[int, ...], group: int) -> None:
        if vpages:
            self.events.append(BlockRemoved(tuple(self._hash[v] for v in vpages), group))
