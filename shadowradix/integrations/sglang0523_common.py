"""The scheduler-side helpers of sglang 0.5.23's ``mem_cache/common.py``, with its call shapes,
over `ShadowRadixSGLang0523Cache`: what the scheduler calls instead of the cache's methods.

=====================================  ==========================================================
sglang 0.5.23                          here
=====================================  ==========================================================
``req.init_next_round_input(tree)``    `init_next_round_input`: match leaving one token to compute
``match_kv_cache(req, tree, ...)``     `match_kv_cache`: match and adopt the hit as req's prefix
``checkpoint_kv_cache(req, tree)``     `checkpoint_kv_cache`: after a prefill forward
``release_kv_cache(req, tree, *,       `release_kv_cache`: finished (``checkpoint=True``),
checkpoint)``                          retracted or aborted (``False``)
=====================================  ==========================================================
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import InvalidRequestError
from .sglang0523 import ShadowRadixSGLang0523Cache
from .sglang0523_types import MatchPrefixParams, MatchResult, RadixKey, Req, RowRewrite

__all__ = ["init_next_round_input", "match_kv_cache", "checkpoint_kv_cache", "release_kv_cache"]


def init_next_round_input(req: Req, tree_cache: ShadowRadixSGLang0523Cache) -> MatchResult:
    """Match ``req``'s tokens as 0.5.23's ``Req.init_next_round_input`` does: all of them,
    limited to one fewer (the last is computed for its logits)."""
    fill = _waiting(req).full_untruncated_fill_ids
    return match_kv_cache(req, tree_cache, fill, max_prefix_len=max(len(fill) - 1, 0))


def match_kv_cache(
    req: Req,
    tree_cache: ShadowRadixSGLang0523Cache,
    token_ids: Sequence[int] | None = None,
    *,
    max_prefix_len: int | None = None,
) -> MatchResult:
    """Match ``token_ids`` (``req``'s tokens by default, the first ``max_prefix_len``) in
    ``req``'s ``(extra_key, cache_salt)`` namespace and adopt the hit: sets ``prefix_len``,
    ``last_node``, ``last_host_node``, ``best_match_node``, ``host_hit_length``,
    ``swa_branching_seqlen`` and ``req.kv.cache_protected_len``. Refused for a running
    request (`InvalidRequestError`, nothing set)."""
    if token_ids is None:
        token_ids = _waiting(req).full_untruncated_fill_ids
    key = RadixKey(token_ids, _waiting(req).extra_key, limit=max_prefix_len,
                   cache_salt=req.cache_salt)  # fmt: skip
    m = tree_cache.match_prefix(MatchPrefixParams(key, req=req))
    req.prefix_len, req.last_node = m.device_prefix_len, m.last_device_node
    req.last_host_node, req.best_match_node = m.last_host_node, m.best_match_node
    req.host_hit_length, req.swa_branching_seqlen = m.host_hit_length, m.swa_branching_seqlen
    protected = m.cache_protected_len
    req.kv.cache_protected_len = m.device_prefix_len if protected is None else protected
    return m


def checkpoint_kv_cache(req: Req, tree_cache: ShadowRadixSGLang0523Cache) -> RowRewrite | None:
    """Publish what the running request computed so far (``checkpoint(req,
    up_to=req.extend_end)``) unless ``req.skip_radix_cache_insert``, then resume the next
    extend at ``extend_end``. `InvalidRequestError` for a finished request (release it)."""
    if not isinstance(req, Req):
        raise InvalidRequestError(f"expected a Req, got {type(req).__name__}")
    if req.finished():
        raise InvalidRequestError(f"{req.rid} is finished: release_kv_cache, not a checkpoint")
    rewrite = None
    if not req.skip_radix_cache_insert:
        rewrite = tree_cache.checkpoint(req, up_to=req.extend_end)  # type: ignore[arg-type]
    elif not req.kv.holds_kv or req.extend_end != req.kv.kv_committed_len:
        raise InvalidRequestError(f"{req.rid}: extend_end is not its computed length")
    req.prefix_len = req.kv.kv_committed_len
    return rewrite


def release_kv_cache(req: Req, tree_cache: ShadowRadixSGLang0523Cache, *, checkpoint: bool) -> None:
    """Give the request's KV back, inserting it first with ``checkpoint``: see
    `ShadowRadixSGLang0523Cache.release_kv_cache`."""
    tree_cache.release_kv_cache(req, checkpoint=checkpoint)


def _waiting(req: object) -> Req:
    if not isinstance(req, Req):
        raise InvalidRequestError(f"expected a Req, got {type(req).__name__}")
    if req.kv.holds_kv:
        raise InvalidRequestError(f"{req.rid} is running: its prefix is its own, not a match")
    return req
