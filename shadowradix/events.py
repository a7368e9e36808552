"""KV events: what entered and left the tree, for KV-transfer and offload connectors and
cache-aware routers (`ShadowRadixCache(config, kv_events=True)`, then `take_events()`).

Five kinds, each naming virtual page ids (and, where SWA moves, SWA page ids):

* ``INSERTED``: pages joined the tree (a finished or unfinished request's prefix). Each page
  carries a chained hash of its tokens, ``blake2b(parent_hash || tokens as int64)`` with 8-byte
  digests, chained from the namespace's seed (0 for the default namespace): equal prefixes of
  one namespace hash equally in any process, so a router can compare them across instances.
  ``parent_hash`` is what the first page chains from (the seed when ``first_page == 0``) and
  ``token_ids`` the pages' tokens, so a consumer can check and extend the chain without keeping
  any state (vLLM's ``BlockStored.parent_block_hash`` / ``token_ids``). ``swa_pages`` is the
  live SWA of the inserted pages' suffix.
* ``EVICTED``: pages left the tree (full eviction or `reset`); their live SWA went with them.
* ``TOMBSTONED``: pages kept their compressed KV but lost their SWA (``swa_pages`` freed).
* ``REVIVED``: tombstoned pages got live SWA again (``swa_pages``), recomputed exactly; like
  INSERTED it carries ``parent_hash`` and ``token_ids``.
* ``FREED``: pages private to a request went back to the free lists without ever being in the
  tree (its duplicates of pages another request inserted first, window pages it moved past,
  rejected drafts, what `finish` or `abort` released). They have no hash; ``first_page`` is 0.

Every kind but FREED carries ``page_hashes``, one per virtual page, so removals name the hashes
a consumer stored without it keeping a map. Together with FREED the stream accounts for every
page id that stops being used: a connector writing pages through (offload, a PD sender) learns
when an id may be reused, instead of guessing from the writes. The page ids a request holds
(and when they change) are reported by the page-table deltas (`shadowradix.deltas`), not here.
A node split changes no page, so it emits nothing.

Consumers: `take_events` is one queue (made by ``kv_events=True``); `subscribe_events` gives
each further consumer its own (`EventSubscription`), fed with every event from then on, so an
offload executor and an engine's connector never take each other's events. A cache made
without ``kv_events`` may still be subscribed to while its tree is empty: its events then name
page ids only (no hashes, no tokens: no blake2b per inserted page).
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass

import numpy as np

from .errors import ConfigError, InvalidRequestError
from .node import Pages

ROOT_HASH = 0


def namespace_seed(namespace: object) -> int:
    """The hash a namespace's prefixes chain from: `ROOT_HASH` for the default one (``None``),
    else 8 bytes of ``blake2b(repr(namespace))``, so equal tokens in two namespaces hash apart."""
    if namespace is None:
        return ROOT_HASH
    digest = hashlib.blake2b(repr(namespace).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class KvEventKind(enum.Enum):
    INSERTED = "inserted"
    EVICTED = "evicted"
    TOMBSTONED = "tombstoned"
    REVIVED = "revived"
    FREED = "freed"


@dataclass(frozen=True)
class KvEvent:
    """One change of the tree's pages (or, FREED, of private ones). ``vpages``: the virtual pages
    concerned, in prefix order (for TOMBSTONED / REVIVED, the pages whose SWA changed);
    ``swa_pages``: the SWA pages that came or went with them (for INSERTED / EVICTED, those of
    the suffix of ``vpages`` that is live); ``page_hashes``: one chained token hash per page of
    ``vpages``; ``first_page``: the position of ``vpages[0]`` in its prefix, in pages;
    ``approximate``: the pages hold replay-derived state; ``parent_hash`` (INSERTED, REVIVED):
    the hash the first page chains from; ``token_ids`` (INSERTED, REVIVED): the tokens of
    ``vpages``, ``page_size`` per page."""

    kind: KvEventKind
    vpages: tuple[int, ...]
    swa_pages: tuple[int, ...] = ()
    page_hashes: tuple[int, ...] = ()
    first_page: int = 0
    approximate: bool = False
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()


def page_hashes(parent_hash: int, tokens: np.ndarray, page_size: int) -> list[int]:
    """Chained hashes of the whole pages of ``tokens`` after a prefix hashing to
    ``parent_hash``."""
    out, h = [], parent_hash
    data = np.ascontiguousarray(tokens, dtype=np.int64)
    for i in range(len(data) // page_size):
        digest = hashlib.blake2b(h.to_bytes(8, "little"), digest_size=8)
        digest.update(data[i * page_size : (i + 1) * page_size].tobytes())
        h = int.from_bytes(digest.digest(), "little")
        out.append(h)
    return out


class EventSubscription:
    """One consumer's queue of `KvEvent`s (`ShadowRadixCache.subscribe_events`): every event
    recorded since it was made, independent of every other consumer."""

    __slots__ = ("_log", "_events")

    def __init__(self, log: EventLog) -> None:
        self._log: EventLog | None = log
        self._events: list[KvEvent] = []

    def take(self) -> list[KvEvent]:
        """The events since the last `take`, oldest first. Raises `InvalidRequestError` once
        closed."""
        if self._log is None:
            raise InvalidRequestError("this event subscription is closed")
        out, self._events = self._events, []
        return out

    def close(self) -> None:
        """Stop receiving events (what was queued is dropped). Raises `InvalidRequestError`
        when already closed."""
        if self._log is None:
            raise InvalidRequestError("this event subscription is already closed")
        self._log.unsubscribe(self)
        self._log, self._events = None, []

    @property
    def closed(self) -> bool:
        return self._log is None


class EventLog:
    """Fans every event out to its subscriptions, and keeps the hash of every page in the tree
    (to chain the hashes of pages inserted below it). ``hashes=False``: events name page ids
    only (``page_hashes``, ``parent_hash`` and ``token_ids`` empty), nothing is hashed."""

    def __init__(self, page_size: int, *, hashes: bool = True, default_queue: bool = True) -> None:
        self.page_size = page_size
        self.hashes = hashes
        self._subs: list[EventSubscription] = []
        self._hash: dict[int, int] = {}  # virtual page -> its chained hash
        #: the queue `take` reads (``kv_events=True``), or ``None``
        self._default = self.subscribe() if default_queue else None

    def subscribe(self) -> EventSubscription:
        sub = EventSubscription(self)
        self._subs.append(sub)
        return sub

    def unsubscribe(self, sub: EventSubscription) -> None:
        self._subs.remove(sub)

    def _emit(self, event: KvEvent) -> None:
        for sub in self._subs:
            sub._events.append(event)

    def hash_of(self, vpage: int) -> int:
        """The chained hash of a page in the tree (`ROOT_HASH` without hashes)."""
        return self._hash[vpage] if self.hashes else ROOT_HASH

    def inserted(self, parent_hash: int, tokens: np.ndarray, vpages: Pages,
                 swa_pages: Pages, first_page: int, approximate: bool) -> None:  # fmt: skip
        """``parent_hash``: the hash of the page before the new ones, or the namespace's seed
        (`namespace_seed`) below a root."""
        if not self.hashes:
            if self._subs:
                self._emit(KvEvent(KvEventKind.INSERTED, vpages, swa_pages,
                                   first_page=first_page, approximate=approximate))  # fmt: skip
            return
        hashes = page_hashes(parent_hash, tokens, self.page_size)
        self._hash.update(zip(vpages, hashes))
        if self._subs:
            self._emit(KvEvent(KvEventKind.INSERTED, vpages, swa_pages,
                               tuple(hashes), first_page, approximate, parent_hash,
                               tuple(tokens.tolist())))  # fmt: skip

    def evicted(self, vpages: Pages, swa_pages: Pages, first_page: int) -> None:
        pop = self._hash.pop
        hashes = tuple(pop(v) for v in vpages) if self.hashes else ()
        if self._subs:
            self._emit(KvEvent(KvEventKind.EVICTED, vpages, swa_pages,
                               hashes, first_page))  # fmt: skip

    def tombstoned(self, vpages: Pages, swa_pages: Pages, first_page: int) -> None:
        if self._subs:
            hashes = tuple(self._hash[v] for v in vpages) if self.hashes else ()
            self._emit(KvEvent(KvEventKind.TOMBSTONED, vpages,
                               swa_pages, hashes, first_page))  # fmt: skip

    def revived(self, parent_hash: int, tokens: np.ndarray, vpages: Pages,
                swa_pages: Pages, first_page: int) -> None:  # fmt: skip
        if not self._subs:
            return
        if not self.hashes:
            self._emit(KvEvent(KvEventKind.REVIVED, vpages, swa_pages,
                               first_page=first_page))  # fmt: skip
            return
        hashes = tuple(self._hash[v] for v in vpages)
        self._emit(KvEvent(KvEventKind.REVIVED, vpages, swa_pages,
                           hashes, first_page, False, parent_hash,
                           tuple(tokens.tolist())))  # fmt: skip

    def freed(self, vpages: list[int], swa_pages: list[int]) -> None:
        """Private pages returned to the free lists (none given: no event)."""
        if (vpages or swa_pages) and self._subs:
            self._emit(KvEvent(KvEventKind.FREED, tuple(vpages), tuple(swa_pages)))

    def take(self) -> list[KvEvent]:
        """The default queue's events (`ShadowRadixCache.take_events`); `ConfigError` when the
        cache was made without ``kv_events``."""
        if self._default is None:
            raise ConfigError("KV events are off: make the cache with kv_events=True")
        return self._default.take()
