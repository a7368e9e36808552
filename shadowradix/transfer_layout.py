"""The records of a prefix transfer between two caches (`transfer`): the sender's
`PrefixLayout`, the receiver's `ImportPlan` and `ImportReceipt`, the `PageMap` of pages to copy,
the `PoolRegion`s a page's rows occupy, and the typed refusal `ImportRefused`."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .config import CacheConfig, StreamSpec
from .errors import ShadowRadixError
from .locks import PinReceipt, Pool
from .results import EvictionReport

NO_PAGES = np.zeros(0, dtype=np.int64)
NO_PAGES.flags.writeable = False


class RefusalReason(enum.Enum):
    #: the receiver's pools cannot hold the pages even after evicting all they may
    NO_ROOM = "no_room"
    #: the layout was made by a cache of another page size, window or streams
    MISMATCH = "mismatch"
    #: a layout this version cannot import (state derived from a bounded replay)
    UNSUPPORTED = "unsupported"


class ImportRefused(ShadowRadixError):
    """The receiver will not import the layout; nothing changed. ``needed`` / ``available``:
    (virtual pages, SWA pages), for `RefusalReason.NO_ROOM`."""

    def __init__(
        self,
        reason: RefusalReason,
        detail: str,
        needed: tuple[int, int] = (0, 0),
        available: tuple[int, int] = (0, 0),
    ) -> None:
        super().__init__(f"import refused ({reason.value}): {detail}")
        self.reason, self.detail = reason, detail
        self.needed, self.available = needed, available

    def __reduce__(self) -> tuple[type[ImportRefused], tuple[Any, ...]]:
        return type(self), (self.reason, self.detail, self.needed, self.available)


@dataclass(frozen=True)
class PoolRegion:
    """One kind of pool row and the page id it follows: rows ``page * rows_per_page + k``."""

    name: str
    pool: Pool
    rows_per_page: int
    ratio: int | None = None


def pool_regions(config: CacheConfig) -> tuple[PoolRegion, ...]:
    """Every region a prefix occupies: ``swa`` (window latents), then per stream ``c{r}``
    (compressed entries, and the indexer keys of the sparse stream) and ``ring{r}``."""
    out = [PoolRegion("swa", Pool.SWA, config.page_size)]
    for spec in config.streams:
        out.append(PoolRegion(f"c{spec.ratio}", Pool.FULL, spec.slots_per_page, spec.ratio))
        out.append(PoolRegion(f"ring{spec.ratio}", Pool.SWA, spec.ring_len, spec.ratio))
    return tuple(out)


def page_rows(pages: np.ndarray, rows_per_page: int) -> np.ndarray:
    """The rows of ``pages``, page by page: ``pages[i] * rows_per_page + k``."""
    k = np.arange(rows_per_page, dtype=np.int64)
    return (np.asarray(pages, dtype=np.int64)[:, None] * rows_per_page + k).ravel()


def frozen_pages(values: Any) -> np.ndarray:
    arr = np.array(values, dtype=np.int64)
    arr.flags.writeable = False
    return arr


@dataclass(frozen=True, eq=False)
class PrefixLayout:
    """What a sender holds of a prefix, by its own page ids (`export_layout`).

    ``full_pages[i]``: the virtual page of page ``i`` (``i < num_pages``); ``swa_pages[j]``:
    the SWA page of page ``window_first_page + j`` (the window before ``num_tokens``). ``pin``
    keeps them from eviction at the sender until `release_layout`; it stays local (a pickled
    layout carries ``pin=None``)."""

    tokens: np.ndarray
    source_len: int
    page_size: int
    window: int
    streams: tuple[StreamSpec, ...]
    full_pages: np.ndarray
    window_first_page: int
    swa_pages: np.ndarray
    approximate: bool = False
    pin: PinReceipt | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_pages(self) -> int:
        return len(self.full_pages)

    @property
    def excluded_len(self) -> int:
        """Tokens of the source the layout does not cover (the receiver computes them)."""
        return self.source_len - self.num_tokens

    def pages_of(self, pool: Pool) -> np.ndarray:
        return self.full_pages if pool is Pool.FULL else self.swa_pages

    def slots(self, region: PoolRegion) -> np.ndarray:
        """The sender's rows of ``region``."""
        return page_rows(self.pages_of(region.pool), region.rows_per_page)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "pin": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name in ("tokens", "full_pages", "swa_pages"):
            state[name] = frozen_pages(state[name])
        self.__dict__.update(state)


@dataclass(frozen=True, eq=False)
class PageMap:
    """Pages to copy in one pool: layout entry ``index[i]`` (the sender's page ``src[i]``)
    lands on the receiver's page ``dst[i]``."""

    pool: Pool
    index: np.ndarray
    src: np.ndarray
    dst: np.ndarray

    def __len__(self) -> int:
        return len(self.index)

    def rows(self, rows_per_page: int) -> tuple[np.ndarray, np.ndarray]:
        """(sender rows, receiver rows) of a region with ``rows_per_page``, one to one."""
        return page_rows(self.src, rows_per_page), page_rows(self.dst, rows_per_page)


@dataclass(frozen=True)
class ImportPlan:
    """Which layout entries the receiver lacks (`plan_import`): ``full_index`` into
    ``layout.full_pages``, ``swa_index`` into ``layout.swa_pages``; the rest it holds."""

    num_tokens: int
    reused_pages: int
    full_index: tuple[int, ...]
    swa_index: tuple[int, ...]
    #: the receiver's tree version the plan was made at
    version: int

    @property
    def needed(self) -> tuple[int, int]:
        return len(self.full_index), len(self.swa_index)


@dataclass(frozen=True, eq=False)
class ImportReceipt:
    """What `import_prefix` did: the prefix ``[0, num_tokens)`` is in the receiver's tree;
    ``full`` / ``swa`` name the pages to fill, one to one with the layout's."""

    num_tokens: int
    reused_pages: int
    full: PageMap
    swa: PageMap
    evicted: EvictionReport

    def pages(self, pool: Pool) -> PageMap:
        return self.full if pool is Pool.FULL else self.swa

    def slot_pairs(self, region: PoolRegion) -> tuple[np.ndarray, np.ndarray]:
        """(sender rows, receiver rows) of ``region``."""
        return self.pages(region.pool).rows(region.rows_per_page)
