"""KV events: what entered and left the tree, for KV-transfer and offload connectors and
cache-aware routers (`ShadowRadixCache(config, kv_events=True)`, then `take_events()`).

Four kinds, each naming virtual page ids (and, where SWA moves, SWA page ids):

* ``INSERTED``: pages joined the tree (a finished or unfinished request's prefix). Each page
  carries a chained hash of its tokens, ``blake2b(parent_hash || tokens as int64)`` with 8-byte
  digests, chained from the namespace's seed (0 for the default namespace): equal prefixes of
  one namespace hash equally in any process, so a router can compare them across instances.
  ``swa_pages`` is the live SWA of the inserted pages' suffix.
* ``EVICTED``: pages left the tree (full eviction or `reset`); their live SWA went with them.
* ``TOMBSTONED``: pages kept their compressed KV but lost their SWA (``swa_pages`` freed).
* ``REVIVED``: tombstoned pages got live SWA again (``swa_pages``), recomputed exactly.

A node split changes no page, so it emits nothing. Pages private to a request (never inserted)
emit nothing either: they are the engine's own to track.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass

import numpy as np

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


@dataclass(frozen=True)
class KvEvent:
    """One change of the tree's pages. ``vpages``: the virtual pages concerned, in prefix order
    (for TOMBSTONED / REVIVED, the pages whose SWA changed); ``swa_pages``: the SWA pages that
    came or went with them (for INSERTED / EVICTED, those of the suffix of ``vpages`` that is
    live); ``page_hashes``: INSERTED only, one chained token hash per page; ``first_page``: the
    position of ``vpages[0]`` in its prefix, in pages; ``approximate``: the pages hold
    replay-derived state."""

    kind: KvEventKind
    vpages: tuple[int, ...]
    swa_pages: tuple[int, ...] = ()
    page_hashes: tuple[int, ...] = ()
    first_page: int = 0
    approximate: bool = False


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


class EventLog:
    """The events since the last `take`, and the hash of every page in the tree (to chain the
    hashes of pages inserted below it)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._events: list[KvEvent] = []
        self._hash: dict[int, int] = {}  # virtual page -> its chained hash

    def inserted(self, after: int, at_root: bool, tokens: np.ndarray, vpages: np.ndarray,
                 swa_pages: np.ndarray, first_page: int, approximate: bool) -> None:  # fmt: skip
        """``after``: the virtual page before the new ones, or (``at_root``) the namespace's
        seed (`namespace_seed`)."""
        parent = after if at_root else self._hash[after]
        hashes = page_hashes(parent, tokens, self.page_size)
        ids = vpages.tolist()
        self._hash.update(zip(ids, hashes))
        self._events.append(KvEvent(KvEventKind.INSERTED, tuple(ids), tuple(swa_pages.tolist()),
                                    tuple(hashes), first_page, approximate))  # fmt: skip

    def evicted(self, vpages: np.ndarray, swa_pages: np.ndarray, first_page: int) -> None:
        ids = vpages.tolist()
        for v in ids:
            del self._hash[v]
        self._events.append(
            KvEvent(KvEventKind.EVICTED, tuple(ids), tuple(swa_pages.tolist()), (), first_page)
        )

    def swa_changed(self, kind: KvEventKind, vpages: np.ndarray, swa_pages: np.ndarray,
                    first_page: int) -> None:  # fmt: skip
        self._events.append(
            KvEvent(kind, tuple(vpages.tolist()), tuple(swa_pages.tolist()), (), first_page)
        )

    def take(self) -> list[KvEvent]:
        out, self._events = self._events, []
        return out
