"""Frozen cache configuration, validated at construction; derived values are properties."""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from . import slots
from .errors import ConfigError

#: DeepSeek-V4-Flash layer pattern: two SWA-only layers, then C4 / C128 alternating (43 layers).
V4_FLASH_RATIOS: tuple[int, ...] = (0, 0) + (4, 128) * 20 + (4,)

SUPPORTED_PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def as_int(name: str, value: object) -> int:
    """``value`` as a plain int: Python and NumPy integers pass, bools, floats and strings raise
    `ConfigError` (sizes computed with NumPy are realistic; a float capacity is a bug)."""
    if isinstance(value, (bool, np.bool_)) or not hasattr(value, "__index__"):
        raise ConfigError(f"{name} must be an int, got {value!r}")
    return operator.index(value)  # type: ignore[arg-type]


def _as_bool(name: str, value: object) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def _as_ints(name: str, values: object) -> tuple[int, ...]:
    try:
        items: tuple[object, ...] = tuple(values)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(f"{name} must be a sequence of ints, got {values!r}") from None
    return tuple(as_int(f"{name}[{i}]", v) for i, v in enumerate(items))


def _finite(name: str, value: object) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be finite, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class StreamSpec:
    """Shadow arithmetic of one compressed stream (all layers sharing one ratio).

    ``ring_size`` rows are what the stream's in-flight state could ever need (2×ratio with the
    overlap transform, doubled under speculation); each SWA page physically keeps
    ``ring_len = min(page_size, ring_size)`` of them, because a page never holds more positions.
    """

    ratio: int
    overlap: bool
    page_size: int
    speculative: bool

    @property
    def span(self) -> int:
        """In-flight rows that precede a position at most (previous group too if overlapping)."""
        return (2 * self.ratio if self.overlap else self.ratio) - 1

    @property
    def ring_size(self) -> int:
        base = 2 * self.ratio if self.overlap else self.ratio
        return 2 * base if self.speculative else base

    @property
    def ring_len(self) -> int:
        return min(self.page_size, self.ring_size)

    @property
    def slots_per_page(self) -> int:
        """Compressed slots per virtual page: ``page_size // ratio``, at least one."""
        return max(1, self.page_size // self.ratio)

    @property
    def max_draft_len(self) -> int | None:
        """Longest draft whose rejected ring writes cannot clobber a row still needed."""
        if self.ring_len < self.ring_size:
            return None  # one ring row per position of the page: no two positions share a row
        return self.ring_len - self.span


@dataclass(frozen=True)
class CacheConfig:
    """Everything the core needs to know about the model and the pools.

    All lengths and capacities are in raw tokens; capacities must be whole pages.
    ``max_*_capacity`` bound how far ``rebalance`` may grow the live capacities (they default to
    the initial capacities); page ids in use always stay below the live capacity, so adapters
    allocate rows for the live capacities only.
    """

    page_size: int = 64
    window: int = 128
    compress_ratios: tuple[int, ...] = V4_FLASH_RATIOS
    overlap_ratios: tuple[int, ...] = (4,)
    full_capacity: int = 400_000 // 64 * 64
    swa_capacity: int = 40_000 // 64 * 64
    max_full_capacity: int | None = None
    max_swa_capacity: int | None = None
    speculative: bool = False
    bounded_replay: bool = False
    debug: bool = False
    _streams: tuple[StreamSpec, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._coerce_types()
        self._validate_shapes()
        self._validate_capacities()
        if self.speculative and self.bounded_replay:
            raise ConfigError(
                "bounded_replay cannot be combined with speculative decoding "
                "(the seeds describe encoder-side replay as incompatible with it)"
            )
        streams = tuple(
            StreamSpec(r, r in self.overlap_ratios, self.page_size, self.speculative)
            for r in self.ratios
        )
        object.__setattr__(self, "_streams", streams)

    def _coerce_types(self) -> None:
        """Plain ints and bools in every field, or `ConfigError` (before any arithmetic)."""
        put = object.__setattr__
        for name in ("page_size", "window", "full_capacity", "swa_capacity"):
            put(self, name, as_int(name, getattr(self, name)))
        for name in ("max_full_capacity", "max_swa_capacity"):
            if getattr(self, name) is not None:
                put(self, name, as_int(name, getattr(self, name)))
        for name in ("compress_ratios", "overlap_ratios"):
            put(self, name, _as_ints(name, getattr(self, name)))
        for name in ("speculative", "bounded_replay", "debug"):
            put(self, name, _as_bool(name, getattr(self, name)))

    def _validate_shapes(self) -> None:
        if self.page_size not in SUPPORTED_PAGE_SIZES:
            raise ConfigError(
                f"page_size must be one of {SUPPORTED_PAGE_SIZES}, got {self.page_size}"
            )
        if not isinstance(self.window, int) or self.window < 1:
            raise ConfigError(f"window must be a positive int, got {self.window!r}")
        if not self.compress_ratios:
            raise ConfigError("compress_ratios needs at least one layer")
        for r in self.compress_ratios:
            if r != 0 and not _is_pow2(r):
                raise ConfigError(f"compress ratios must be 0 or a power of two, got {r}")
        for r in self.overlap_ratios:
            if not _is_pow2(r):
                raise ConfigError(f"overlap ratios must be powers of two, got {r}")
        for r in self.ratios:
            span = (2 * r if r in self.overlap_ratios else r) - 1
            if span > self.window:
                raise ConfigError(
                    f"ratio {r} keeps {span} in-flight rows before a position, more than the "
                    f"window ({self.window}): ring rows would outlive the SWA pages holding them"
                )

    def _validate_capacities(self) -> None:
        p = self.page_size
        for name in ("full_capacity", "swa_capacity"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < p or value % p:
                raise ConfigError(
                    f"{name} must be a positive multiple of page_size={p}, got {value}"
                )
        for name, live in (
            ("max_full_capacity", self.full_capacity),
            ("max_swa_capacity", self.swa_capacity),
        ):
            value = getattr(self, name)
            if value is None:
                object.__setattr__(self, name, live)
            elif value < live or value % p:
                raise ConfigError(
                    f"{name} must be a multiple of page_size and >= the live capacity"
                )
        window_pages = self.window_pages + 1
        if self.swa_capacity // p < window_pages:
            raise ConfigError(
                f"swa_capacity={self.swa_capacity} holds fewer than the {window_pages} pages "
                "one request needs for its window"
            )

    # -- derived -----------------------------------------------------------------------------

    @cached_property
    def ratios(self) -> tuple[int, ...]:
        """Distinct compression ratios, ascending (one compressed stream each)."""
        return tuple(sorted({r for r in self.compress_ratios if r}))

    @property
    def streams(self) -> tuple[StreamSpec, ...]:
        return self._streams

    @property
    def num_full_pages(self) -> int:
        return self.full_capacity // self.page_size

    @property
    def num_swa_pages(self) -> int:
        return self.swa_capacity // self.page_size

    @property
    def max_full_pages(self) -> int:
        assert self.max_full_capacity is not None
        return self.max_full_capacity // self.page_size

    @property
    def max_swa_pages(self) -> int:
        assert self.max_swa_capacity is not None
        return self.max_swa_capacity // self.page_size

    @property
    def window_pages(self) -> int:
        """SWA pages a request may hold outside its newest chunk: the window plus one page."""
        return slots.tail_window_pages(self.window, self.page_size) + 1

    @property
    def min_hit_granularity(self) -> int:
        """Smallest prefix a match can reuse, in tokens.

        In-flight compression rows live in ring shadows of the SWA pages, so a match may end
        mid-group: the granularity is the page, not ``lcm(page, ratios)``.
        """
        return self.page_size

    @property
    def max_draft_len(self) -> int | None:
        """Longest draft `extend_draft` accepts (``None``: unbounded by the rings)."""
        if not self.speculative:
            return 0
        bounds = [s.max_draft_len for s in self.streams if s.max_draft_len is not None]
        return min(bounds) if bounds else None

    def compressed_capacity(self, ratio: int) -> int:
        """Slots one layer of the ``ratio`` stream needs at the pool's maximum capacity."""
        return self.max_full_pages * self.stream(ratio).slots_per_page

    def ring_capacity(self, ratio: int) -> int:
        """Ring rows one layer of the ``ratio`` stream needs at the SWA pool's maximum."""
        return self.max_swa_pages * self.stream(ratio).ring_len

    def stream(self, ratio: int) -> StreamSpec:
        for s in self.streams:
            if s.ratio == ratio:
                return s
        raise ConfigError(f"no compressed stream with ratio {ratio}")

    @classmethod
    def from_budget(
        cls,
        total_bytes: int,
        swa_full_tokens_ratio: float,
        *,
        full_bytes_per_token: float,
        swa_bytes_per_token: float,
        page_size: int = 64,
        fixed_bytes: int = 0,
        **kwargs: object,
    ) -> CacheConfig:
        """Split a byte budget between the full (compressed) and the SWA pools.

        ``swa_full_tokens_ratio`` is SGLang's knob: SWA tokens per full token. Per-token byte
        costs come from the model (all layers together, compressed pools amortised per token);
        ``fixed_bytes`` is what the pools cost whatever their sizes (their sentinel rows) and
        comes off the budget first. Pools with rows for the live capacities then hold at most
        ``total_bytes`` (`adapters.memory.pool_budget.budget_cache_config` measures the costs).
        ``max_*_capacity`` bound how far `rebalance` may grow each pool later: the whole
        budget in that pool (the caller keeps the sum within the budget: `split_budget`).
        """
        total = _finite("total_bytes", total_bytes) - _finite("fixed_bytes", fixed_bytes)
        if fixed_bytes < 0 or total <= 0:
            raise ConfigError(f"fixed_bytes={fixed_bytes} leaves no budget of {total_bytes}")
        full, swa = split_budget(
            total, swa_full_tokens_ratio, full_bytes_per_token, swa_bytes_per_token, page_size
        )
        kwargs.setdefault(
            "max_full_capacity",
            max(full, int(total // full_bytes_per_token) // page_size * page_size),
        )
        kwargs.setdefault(
            "max_swa_capacity", max(swa, int(total // swa_bytes_per_token) // page_size * page_size)
        )
        return cls(page_size=page_size, full_capacity=full, swa_capacity=swa, **kwargs)  # type: ignore[arg-type]


def split_budget(
    total_bytes: float,
    swa_full_tokens_ratio: float,
    full_bytes_per_token: float,
    swa_bytes_per_token: float,
    page_size: int,
) -> tuple[int, int]:
    """``(full_capacity, swa_capacity)`` in tokens (whole pages) that fit ``total_bytes`` with
    ``swa_full_tokens_ratio`` SWA tokens per full token."""
    page_size = as_int("page_size", page_size)
    if page_size not in SUPPORTED_PAGE_SIZES:
        raise ConfigError(f"page_size must be one of {SUPPORTED_PAGE_SIZES}, got {page_size}")
    total_bytes = _finite("total_bytes", total_bytes)
    swa_full_tokens_ratio = _finite("swa_full_tokens_ratio", swa_full_tokens_ratio)
    full_bytes_per_token = _finite("full_bytes_per_token", full_bytes_per_token)
    swa_bytes_per_token = _finite("swa_bytes_per_token", swa_bytes_per_token)
    if total_bytes <= 0 or swa_full_tokens_ratio <= 0:
        raise ConfigError("total_bytes and swa_full_tokens_ratio must be positive")
    if full_bytes_per_token <= 0 or swa_bytes_per_token <= 0:
        raise ConfigError("per-token byte costs must be positive")
    per_full_token = full_bytes_per_token + swa_full_tokens_ratio * swa_bytes_per_token
    full_tokens = int(total_bytes // per_full_token)
    full = full_tokens // page_size * page_size
    swa = int(full_tokens * swa_full_tokens_ratio) // page_size * page_size
    return full, swa
