"""The records of the sglang-0.5.23-shaped shim (`sglang0523`), named and shaped as in sglang
0.5.23's ``mem_cache/base_prefix_cache.py`` (``MatchResult``, ``TreeLock``,
``MatchPrefixParams``), ``mem_cache/radix_cache.py`` (``RadixKey``) and
``managers/schedule_batch.py`` (``Req``, ``ReqKvInfo``): plain records of our own, holding
NumPy arrays where SGLang holds tensors. Only the fields a FULL + SWA scheduler (no HiCache, no
mamba) has the cache read or fill are here; the tree handle, lock receipts and evict records
are the 0.5.18 shim's (`sglang_types`), unchanged in 0.5.23 for what this shim reads.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..request import Request
from .sglang_types import DecLockRefParams, TreeNode

__all__ = [
    "RadixKey",
    "MatchPrefixParams",
    "MatchResult",
    "TreeLock",
    "ReqKvInfo",
    "Req",
    "RowRewrite",
    "namespace_of",
]


def namespace_of(extra_key: Hashable, cache_salt: Hashable) -> Hashable:
    """The core namespace of a key: ``None`` for neither, else the pair — one-to-one, so two
    different ``(extra_key, cache_salt)`` never share a prefix (SGLang namespaces its tree by
    both)."""
    return None if extra_key is None and cache_salt is None else (extra_key, cache_salt)


@dataclass(frozen=True)
class RadixKey:
    """sglang 0.5.23's ``RadixKey(token_ids, extra_key=None, is_bigram=False, limit=None,
    cache_salt=None)``: ``limit`` caps the tokens looked at (as if ``token_ids[:limit]``);
    ``cache_salt`` is normalised as SGLang does (``cache_salt or None``). Bigram keys (EAGLE)
    are refused by the shim."""

    token_ids: Sequence[int]
    extra_key: Hashable = None
    is_bigram: bool = False
    limit: int | None = None
    cache_salt: Hashable = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache_salt", self.cache_salt or None)

    def __len__(self) -> int:
        n = len(self.token_ids)
        return n if self.limit is None else min(self.limit, n)

    def raw_token_ids(self) -> Sequence[int]:
        """``token_ids`` honouring ``limit`` (a copy only when capped)."""
        n = len(self)
        return self.token_ids if n == len(self.token_ids) else self.token_ids[:n]

    @property
    def namespace(self) -> Hashable:
        return namespace_of(self.extra_key, self.cache_salt)


@dataclass(frozen=True)
class MatchPrefixParams:
    """``cow_mamba`` must stay ``False`` (no mamba); ``req`` is accepted and not read."""

    key: RadixKey
    cow_mamba: bool = False
    req: Req | None = None


class MatchResult(NamedTuple):
    """sglang 0.5.23's ``MatchResult``, every field in its order (positional unpacking works).
    ``device_prefix_len``: where a request resumes; ``full_kv_hit_length``: the tokens whose
    compressed KV the tree holds (longer when SWA eviction tombstoned the window since, then
    ``swa_branching_seqlen`` is that length, else ``None``). No host tier: the three nodes
    are one, the host and mamba fields zero; ``cache_protected_len`` is ``None`` (the
    scheduler then sets ``req.kv.cache_protected_len`` to ``device_prefix_len``)."""

    device_prefix_len: int
    last_device_node: TreeNode
    last_host_node: TreeNode
    best_match_node: TreeNode
    host_hit_length: int = 0
    swa_host_hit_length: int = 0
    swa_branching_seqlen: int | None = None
    mamba_host_hit_length: int = 0
    mamba_branching_seqlen: int | None = None
    cache_protected_len: int | None = None
    full_kv_hit_length: int = 0
    cache_actions: tuple[object, ...] = ()
    last_visited_node_id: int | None = None
    full_device_match_len: int | None = None


@dataclass(frozen=True, eq=False)
class TreeLock:
    """What ``lock(node)`` returns and ``unlock`` takes, once. ``receipt``: the pin taken on
    ``node`` (``DecLockRefParams(None)`` for the root, and once the lock passed to a running
    request, whose own locks then hold the path). ``swa_released`` stays ``False``: the core
    moves a running request's SWA locks with its window itself (``release_swa`` does nothing)."""

    node: TreeNode
    receipt: DecLockRefParams
    swa_released: bool = False


@dataclass
class ReqKvInfo:
    """The KV a request holds outside the tree (sglang's ``req.kv``). ``request``: the core
    request once admitted (kept after release, inactive); ``cache_protected_len``: the tree
    owns positions ``[0, here)`` of the row (the match, then what checkpoints inserted)."""

    request: Request | None = None
    cache_protected_len: int = 0

    @property
    def holds_kv(self) -> bool:
        return self.request is not None and self.request.is_active

    @property
    def kv_committed_len(self) -> int:
        """Tokens whose KV is computed (0 when no KV is held)."""
        return self.request.num_committed if self.holds_kv else 0  # type: ignore[union-attr]

    @property
    def kv_allocated_len(self) -> int:
        return self.request.length if self.holds_kv else 0  # type: ignore[union-attr]


@dataclass(eq=False)
class Req:
    """The scheduler's request, as far as the cache is concerned (sglang 0.5.23's names). The
    scheduler owns ``origin_input_ids``, ``output_ids``, ``extend_end`` (set when it budgets a
    prefill: compute ``[prefix_len, extend_end)``), ``finished_reason`` and the match fields
    (``match_kv_cache`` sets them); `checkpoint` moves ``last_node`` and ``lock``, the
    allocation fills ``kv``."""

    rid: str
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    extra_key: Hashable = None
    cache_salt: Hashable = None
    prefix_len: int = 0
    extend_end: int | None = None
    last_node: TreeNode | None = None
    last_host_node: TreeNode | None = None
    best_match_node: TreeNode | None = None
    host_hit_length: int = 0
    swa_branching_seqlen: int | None = None
    lock: TreeLock | None = None
    kv: ReqKvInfo = field(default_factory=ReqKvInfo)
    finished_reason: object = None
    skip_radix_cache_insert: bool = False

    def __post_init__(self) -> None:
        self.cache_salt = self.cache_salt or None

    @property
    def full_untruncated_fill_ids(self) -> list[int]:
        """Every token: the prompt, then the outputs (the last one not computed yet)."""
        return self.origin_input_ids + self.output_ids

    @property
    def extend_len(self) -> int:
        return (self.extend_end or 0) - self.prefix_len

    @property
    def namespace(self) -> Hashable:
        return namespace_of(self.extra_key, self.cache_salt)

    def finished(self) -> bool:
        return self.finished_reason is not None

    def owned_kv_len(self) -> int:
        return self.kv.kv_committed_len


@dataclass(frozen=True)
class RowRewrite:
    """What a `checkpoint` rewrote in the request's row (sglang's ``req_to_token`` row, which
    its checkpoint writes itself): positions ``[start_pos, start_pos + len(device_indices))``
    now hold ``device_indices`` (the tree's copies of pages the request computed twice).
    Empty when nothing moved."""

    start_pos: int
    device_indices: np.ndarray

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.device_indices)
