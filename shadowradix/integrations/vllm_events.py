"""The core's `KvEvent`s as vLLM-shaped ``BlockStored`` / ``BlockRemoved`` per KV-cache group.

Stateless: an INSERTED or REVIVED event carries its pages' hashes, the hash they chain from
(``parent_hash``) and their tokens, and removals carry the hashes they remove, so each event
translates on its own, whenever the shim drains the core.

=================  ==========================================  =============================
core event         group 0 (full / compressed)                 group 1 (SWA)
=================  ==========================================  =============================
INSERTED           BlockStored, every page                     BlockStored, the live suffix
EVICTED            BlockRemoved, every page                    BlockRemoved, the live suffix
TOMBSTONED         (compressed KV stays)                       BlockRemoved
REVIVED            (already stored)                            BlockStored
FREED              (never cached: vLLM reports no event for a request's private blocks)
=================  ==========================================  =============================
"""

from __future__ import annotations

from ..events import KvEvent, KvEventKind
from .vllm_types import BlockRemoved, BlockStored, KVCacheEvent

FULL_GROUP, SWA_GROUP = 0, 1


class EventTranslator:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.events: list[KVCacheEvent] = []

    def add(self, events: list[KvEvent]) -> None:
        """Translate core events, oldest first, onto ``events``."""
        for e in events:
            kind = e.kind
            if kind is KvEventKind.INSERTED:
                self._stored(e, 0, FULL_GROUP)
                self._stored(e, len(e.vpages) - len(e.swa_pages), SWA_GROUP)
            elif kind is KvEventKind.REVIVED:
                self._stored(e, 0, SWA_GROUP)
            elif kind is KvEventKind.TOMBSTONED:
                self._removed(e.page_hashes, SWA_GROUP)
            elif kind is KvEventKind.EVICTED:
                self._removed(e.page_hashes, FULL_GROUP)
                self._removed(e.page_hashes[len(e.vpages) - len(e.swa_pages) :], SWA_GROUP)

    def _stored(self, e: KvEvent, skip: int, group: int) -> None:
        """``BlockStored`` of ``e``'s pages from its ``skip``-th on (none left: nothing)."""
        hashes = e.page_hashes[skip:]
        if not hashes:
            return
        p = self.page_size
        parent = e.page_hashes[skip - 1] if skip else e.parent_hash
        if e.first_page + skip == 0:
            parent = None  # vLLM's root block has no parent
        tokens = e.token_ids[skip * p :]
        self.events.append(BlockStored(hashes, parent, tokens, p, group))

    def _removed(self, hashes: tuple[int, ...], group: int) -> None:
        if hashes:
            self.events.append(BlockRemoved(hashes, group))
