"""The arguments and results of the SGLang-shaped shim (`sglang`), named and shaped as in
sglang 0.5.18's ``mem_cache/base_prefix_cache.py`` and its ``Req``: plain records of our own,
holding NumPy arrays where SGLang holds tensors and core receipts where it holds node ids.
Only the fields the shim reads or fills are here."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..locks import PinReceipt
from ..request import Request
from ..results import Allocation
from ..results import MatchResult as CoreMatch

_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False


@dataclass(frozen=True)
class RadixKey:
    """The tokens to look up and the namespace (SGLang's ``extra_key``: LoRA id, cache salt)."""

    token_ids: Sequence[int]
    extra_key: Hashable = None


@dataclass(frozen=True)
class MatchPrefixParams:
    key: RadixKey


@dataclass(frozen=True, eq=False)
class TreeNode:
    """A handle on a tree prefix: the first ``prefix_len`` tokens, ``tokens``, of
    ``namespace``. ``match`` is the core's match a ``match_prefix`` found (what the request
    admission resumes from); ``None`` for the handles ``cache_unfinished_req`` returns.
    ``device_indices``: the prefix's KV indices (virtual slots, read-only) when the handle was
    made: valid while the path is locked (sglang's ``path_device_indices`` contract)."""

    prefix_len: int
    tokens: np.ndarray = field(repr=False)
    namespace: Hashable = None
    match: CoreMatch | None = field(default=None, repr=False)
    device_indices: np.ndarray = field(default_factory=lambda: _EMPTY, repr=False)


@dataclass(frozen=True)
class MatchResult:
    """``device_indices``: the KV indices (virtual slots) of the reusable prefix;
    ``full_kv_hit_length``: the tokens whose full KV the tree holds (``cached_len``); with the
    window tombstoned before that, ``swa_branching_seqlen`` is that length (a hit had the window
    been live), else ``None``. No host tier: the three nodes are the same."""

    device_indices: np.ndarray
    last_device_node: TreeNode
    last_host_node: TreeNode
    best_match_node: TreeNode
    host_hit_length: int = 0
    swa_branching_seqlen: int | None = None
    full_kv_hit_length: int = 0


@dataclass(frozen=True)
class InsertParams:
    key: RadixKey


@dataclass(frozen=True)
class InsertResult:
    """``prefix_len``: tokens the tree held before (compressed KV); ``total_len``: the key's
    tokens in whole pages, the part an insert considers; ``allocation``: where the engine writes
    the KV of the rest (``None``: nothing inserted — all there, or a window tombstoned)."""

    prefix_len: int
    total_len: int
    allocation: Allocation | None = None


@dataclass(frozen=True)
class EvictParams:
    num_tokens: int = 0
    swa_num_tokens: int = 0


@dataclass(frozen=True)
class EvictResult:
    num_tokens_evicted: int = 0
    swa_num_tokens_evicted: int = 0


@dataclass(frozen=True)
class DecLockRefParams:
    """What `dec_lock_ref` releases: the receipt `inc_lock_ref` returned (``None``: nothing)."""

    receipt: PinReceipt | None = None


@dataclass(frozen=True)
class DecLockRefResult:
    delta: int = 0


@dataclass(frozen=True)
class IncLockRefResult:
    """``delta``: how `evictable_size` changed (<= 0); ``receipt``: the pin (``None`` for the
    root)."""

    delta: int
    receipt: PinReceipt | None

    def to_dec_params(self) -> DecLockRefParams:
        return DecLockRefParams(self.receipt)


@dataclass(eq=False)
class Req:
    """The scheduler's request, as far as the cache is concerned. The scheduler owns
    ``origin_input_ids``, ``output_ids`` (it appends each sampled token) and ``lock_result``;
    the cache fills ``prefix_indices`` and ``last_node`` (``match_prefix`` results are set by the
    scheduler, as SGLang does) and ``kv`` (the core request, once admitted)."""

    rid: str
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    extra_key: Hashable = None
    prefix_indices: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    last_node: TreeNode | None = None
    lock_result: IncLockRefResult | None = None
    kv: Request | None = None

    @property
    def fill_ids(self) -> list[int]:
        """Every token: the prompt, then the outputs (the last one not computed yet)."""
        return self.origin_input_ids + self.output_ids
