"""The sglang-0.5.23-shaped layer's records and contracts, one at a time: `RadixKey`'s ``limit``
and ``cache_salt``, `MatchResult`'s field order, the read-only KV indices of a path, `TreeLock`s
and bare receipts (each released once), checkpoint and release refusals — every typed error
leaving the cache as it was (`shadowradix.testing.snapshot`). The scheduler loop over random
workloads is `test_integrations_sglang0523_loop.py`."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from shadowradix import CacheConfig, InvalidRequestError, LockError
from shadowradix.integrations.sglang0523 import ShadowRadixSGLang0523Cache
from shadowradix.integrations.sglang0523_common import (
    checkpoint_kv_cache,
    init_next_round_input,
    match_kv_cache,
    release_kv_cache,
)
from shadowradix.integrations.sglang0523_types import (
    MatchPrefixParams,
    MatchResult,
    RadixKey,
    Req,
    TreeLock,
)
from shadowradix.integrations.sglang_types import DecLockRefParams, EvictParams
from shadowradix.testing import snapshot

PROMPT = list(range(1, 22))  # 21 tokens: 5 whole pages of 4 once served


def _tree() -> ShadowRadixSGLang0523Cache:
    config = CacheConfig(page_size=4, window=8, compress_ratios=(0, 4, 8), overlap_ratios=(4,),
                         full_capacity=4 * 32, swa_capacity=4 * 12, debug=True)  # fmt: skip
    return ShadowRadixSGLang0523Cache(config)


def _prefill(tree: ShadowRadixSGLang0523Cache, req: Req, chunk: int = 8) -> list[int]:
    """Match, lock and compute the request's prompt in chunks, checkpointing each: the engine's
    row, kept from what the layer reports. Samples one token at the end."""
    init_next_round_input(req, tree)
    req.lock = tree.lock(req.last_node)
    row = tree.prefix_device_indices(req).tolist()
    fill = req.full_untruncated_fill_ids
    while req.prefix_len < len(fill):
        req.extend_end = min(req.prefix_len + chunk, len(fill))
        assert tree.can_alloc_for_extend(req)
        row += tree.alloc_for_extend(req).virtual_slots.tolist()
        rewrite = checkpoint_kv_cache(req, tree)
        if rewrite is not None:
            row[rewrite.start_pos : rewrite.end_pos] = rewrite.device_indices.tolist()
        assert row == tree.row_device_indices(req).tolist()
    req.output_ids.append(0)
    return row


def _admitted(tree: ShadowRadixSGLang0523Cache, req: Req, extend_end: int) -> Req:
    """``req`` matched, locked and computing ``[prefix_len, extend_end)`` (not checkpointed)."""
    init_next_round_input(req, tree)
    req.lock = tree.lock(req.last_node)
    req.extend_end = extend_end
    tree.alloc_for_extend(req)
    return req


def _serve(tree: ShadowRadixSGLang0523Cache, req: Req) -> None:
    _prefill(tree, req)
    tree.alloc_for_decode([req])
    req.output_ids.append(1)
    release_kv_cache(req, tree, checkpoint=True)


def _match(tree: ShadowRadixSGLang0523Cache, tokens: list[int], **key: object) -> MatchResult:
    return tree.match_prefix(MatchPrefixParams(RadixKey(tokens, **key)))  # type: ignore[arg-type]


def _refused(
    tree: ShadowRadixSGLang0523Cache,
    error: type[Exception],
    call: Callable[..., object],
    /,
    *args: object,
    **kwargs: object,
) -> None:
    """``call(*args, **kwargs)`` raises ``error`` and leaves the cache as it was."""
    before = snapshot(tree.cache)
    with pytest.raises(error):
        call(*args, **kwargs)
    assert snapshot(tree.cache) == before


def test_radix_key_limit_caps_what_is_looked_at() -> None:
    tree = _tree()
    _serve(tree, Req("a", PROMPT))
    key = RadixKey(PROMPT, limit=9)
    assert len(key) == 9 and list(key.raw_token_ids()) == PROMPT[:9]
    assert _match(tree, PROMPT, limit=9).device_prefix_len == 8  # whole pages of the first 9
    assert _match(tree, PROMPT, limit=100).device_prefix_len == 20
    assert _match(tree, PROMPT, limit=0).device_prefix_len == 0
    for bad in (-1, True, 2.0):
        _refused(tree, InvalidRequestError, _match, tree, PROMPT, limit=bad)


def test_cache_salts_never_share_a_prefix() -> None:
    tree = _tree()
    _serve(tree, Req("a", PROMPT, cache_salt="s1"))
    assert _match(tree, PROMPT, cache_salt="s1").device_prefix_len == 20
    assert _match(tree, PROMPT, cache_salt="s2").device_prefix_len == 0
    assert _match(tree, PROMPT).device_prefix_len == 0
    assert _match(tree, PROMPT, extra_key="s1").device_prefix_len == 0  # not the salt's
    assert _match(tree, PROMPT, extra_key="x", cache_salt="s1").device_prefix_len == 0
    _serve(tree, Req("b", PROMPT, extra_key="x", cache_salt="s1"))
    assert _match(tree, PROMPT, extra_key="x", cache_salt="s1").device_prefix_len == 20
    assert _match(tree, PROMPT).device_prefix_len == 0


def test_an_empty_cache_salt_is_no_salt() -> None:
    assert RadixKey(PROMPT, cache_salt="").cache_salt is None
    assert RadixKey(PROMPT, cache_salt="") == RadixKey(PROMPT)
    assert Req("a", PROMPT, cache_salt="").namespace == Req("b", PROMPT).namespace is None
    tree = _tree()
    _serve(tree, Req("a", PROMPT, cache_salt=""))
    assert _match(tree, PROMPT).device_prefix_len == 20


def test_match_result_has_0523_fields_in_order() -> None:
    tree = _tree()
    _serve(tree, Req("a", PROMPT))
    m = _match(tree, PROMPT)
    assert MatchResult._fields == (
        "device_prefix_len", "last_device_node", "last_host_node", "best_match_node",
        "host_hit_length", "swa_host_hit_length", "swa_branching_seqlen",
        "mamba_host_hit_length", "mamba_branching_seqlen", "cache_protected_len",
        "full_kv_hit_length", "cache_actions", "last_visited_node_id", "full_device_match_len",
    )  # fmt: skip
    prefix_len, device_node, host_node, best_node, host_hit, *_ = m
    assert (prefix_len, host_hit, m.full_kv_hit_length) == (20, 0, 20)
    assert device_node is host_node is best_node is m.last_device_node
    assert m.swa_branching_seqlen is None and m.cache_protected_len is None


def test_swa_branching_seqlen_reports_a_tombstoned_window() -> None:
    tree = _tree()
    _serve(tree, Req("a", PROMPT))
    tree.evict(EvictParams(swa_num_tokens=10**6))  # tombstone every unprotected window
    m = _match(tree, PROMPT)
    assert m.device_prefix_len < m.full_kv_hit_length == m.swa_branching_seqlen == 20


def test_path_device_indices_are_read_only_and_the_real_slots() -> None:
    tree = _tree()
    _serve(tree, Req("a", PROMPT))
    req = Req("b", PROMPT + [7, 8])
    match_kv_cache(req, tree, req.full_untruncated_fill_ids, max_prefix_len=22)
    path = tree.path_device_indices(req.last_node)
    prefix = tree.prefix_device_indices(req)
    assert len(path) == len(prefix) == req.prefix_len == 20
    for view in (path, prefix):
        with pytest.raises(ValueError):
            view[0] = 99
    req.lock = tree.lock(req.last_node)
    req.extend_end = len(req.full_untruncated_fill_ids)
    tree.alloc_for_extend(req)
    assert np.array_equal(tree.row_device_indices(req)[:20], path)


def test_a_checkpoint_that_dedups_reports_the_rewrite() -> None:
    """Two requests compute the same prompt side by side: the second's checkpoint swaps its
    pages for the tree's copies, and the `RowRewrite` names them."""
    tree = _tree()
    a, b = Req("a", PROMPT), Req("b", PROMPT)
    for req in (a, b):
        _admitted(tree, req, len(PROMPT))
    assert checkpoint_kv_cache(a, tree).device_indices.size == 0  # nothing to swap
    b_row = tree.row_device_indices(b).copy()
    rewrite = checkpoint_kv_cache(b, tree)
    assert (rewrite.start_pos, rewrite.end_pos) == (0, 20)
    b_row[rewrite.start_pos : rewrite.end_pos] = rewrite.device_indices
    assert np.array_equal(b_row, tree.row_device_indices(b))
    assert np.array_equal(rewrite.device_indices, tree.row_device_indices(a)[:20])
    assert b.last_node.prefix_len == b.kv.cache_protected_len == 20
    for req in (a, b):
        release_kv_cache(req, tree, checkpoint=False)
    tree.reset()


def test_a_request_kept_out_of_the_tree_inserts_nothing() -> None:
    """``skip_radix_cache_insert``: checkpoints only advance the request, and even a finished
    release (``checkpoint=True``) inserts nothing."""
    tree = _tree()
    req = _admitted(tree, Req("a", PROMPT, skip_radix_cache_insert=True), 12)
    assert checkpoint_kv_cache(req, tree) is None and req.prefix_len == 12
    req.extend_end = 21
    tree.alloc_for_extend(req)
    assert checkpoint_kv_cache(req, tree) is None and tree.total_size() == 0
    release_kv_cache(req, tree, checkpoint=True)
    assert tree.total_size() == 0 and tree.protected_size() == 0
    tree.reset()


def test_a_tree_lock_is_released_once() -> None:
    tree = _tree()
    _serve(tree, Req("a", PROMPT))
    node = _match(tree, PROMPT).last_device_node
    lock = tree.lock(node)
    assert isinstance(lock, TreeLock) and tree.protected_size() == 20
    _refused(tree, InvalidRequestError, tree.reset)
    tree.release_swa(lock)  # nothing to do: a pin keeps its SWA until unlocked
    tree.unlock(lock)
    assert tree.protected_size() == 0
    _refused(tree, LockError, tree.release_swa, lock)
    _refused(tree, LockError, lambda: tree.unlock(lock))
    _refused(tree, InvalidRequestError, lambda: tree.unlock("lock"))  # type: ignore[arg-type]
    tree.unlock(None)  # nothing, as SGLang
    root = tree.lock(_match(tree, [50, 51]).last_device_node)
    tree.unlock(root)
    _refused(tree, LockError, lambda: tree.unlock(root))
    tree.reset()


def test_a_bare_receipt_is_released_once_and_only_by_its_holder() -> None:
    tree, other = _tree(), _tree()
    for t in (tree, other):
        _serve(t, Req("a", PROMPT))
    node = _match(tree, PROMPT).last_device_node
    short = _match(tree, PROMPT[:9]).last_device_node
    receipt = tree.inc_lock_ref(node)
    assert receipt.delta == -20
    _refused(tree, InvalidRequestError, tree.reset)
    foreign = other.inc_lock_ref(_match(other, PROMPT).last_device_node).to_dec_params()
    lock = tree.lock(short)
    _refused(tree, LockError, lambda: tree.dec_lock_ref(node, foreign))
    _refused(tree, LockError, lambda: tree.dec_lock_ref(short, lock.receipt))  # a lock's
    _refused(tree, LockError, lambda: tree.dec_lock_ref(node))  # which holder's? none given
    _refused(tree, InvalidRequestError, lambda: tree.dec_lock_ref(short, receipt.to_dec_params()))
    _refused(tree, InvalidRequestError, tree.dec_lock_ref, node, "x")
    tree.unlock(lock)
    assert tree.dec_lock_ref(node, receipt.to_dec_params()).delta == 20
    _refused(tree, LockError, lambda: tree.dec_lock_ref(node, receipt.to_dec_params()))
    root = _match(tree, [50]).last_device_node
    assert tree.dec_lock_ref(root, DecLockRefParams(None)).delta == 0
    tree.reset()


def test_checkpoint_only_at_the_computed_length() -> None:
    tree = _tree()
    _serve(tree, Req("a", PROMPT))
    req = _admitted(tree, Req("b", PROMPT + [7, 8, 9, 10, 11]), 24)
    fields = (req.lock, req.last_node, req.prefix_len, req.kv.cache_protected_len)
    for up_to in (23, 25, 20, True, "24"):
        _refused(tree, InvalidRequestError, tree.checkpoint, req, up_to=up_to)
    req.extend_end = 23
    _refused(tree, InvalidRequestError, lambda: checkpoint_kv_cache(req, tree))
    assert (req.lock, req.last_node, req.prefix_len, req.kv.cache_protected_len) == fields
    req.extend_end = 24
    checkpoint_kv_cache(req, tree)
    assert req.lock is not fields[0] and req.prefix_len == 24 and req.last_node.prefix_len == 24
    _refused(tree, LockError, lambda: tree.unlock(fields[0]))  # the checkpoint retired it
    req.finished_reason = "stop"
    _refused(tree, InvalidRequestError, lambda: checkpoint_kv_cache(req, tree))
    release_kv_cache(req, tree, checkpoint=True)
    tree.reset()


def test_release_once() -> None:
    tree = _tree()
    req = Req("a", PROMPT)
    _prefill(tree, req)
    release_kv_cache(req, tree, checkpoint=False)
    assert req.lock is None and not req.kv.holds_kv and tree.protected_size() == 0
    for checkpoint in (False, True):
        _refused(tree, InvalidRequestError, release_kv_cache, req, tree, checkpoint=checkpoint)
    waiting = Req("b", PROMPT)  # locked, never admitted: the release only unlocks
    init_next_round_input(waiting, tree)
    waiting.lock = tree.lock(waiting.last_node)
    release_kv_cache(waiting, tree, checkpoint=True)
    _refused(tree, InvalidRequestError, lambda: release_kv_cache(waiting, tree, checkpoint=True))
    tree.reset()


def test_unsupported_calls_are_refused() -> None:
    tree = _tree()
    _serve(tree, Req("a", PROMPT))
    running = Req("b", PROMPT + [7])
    _prefill(tree, running)
    bigram, mamba = RadixKey(PROMPT, is_bigram=True), RadixKey(PROMPT)
    _refused(tree, InvalidRequestError, lambda: tree.match_prefix(MatchPrefixParams(bigram)))
    params = MatchPrefixParams(mamba, cow_mamba=True)
    _refused(tree, InvalidRequestError, lambda: tree.match_prefix(params))
    for n in (2, 0, True):
        _refused(tree, InvalidRequestError, tree.alloc_for_decode, [running], n)
    tree.alloc_for_decode([running], 1)
    release_kv_cache(running, tree, checkpoint=True)


def test_every_typed_error_leaves_the_cache_unchanged() -> None:
    tree = _tree()
    _serve(tree, Req("a", PROMPT))
    running = _admitted(tree, Req("b", PROMPT + [5, 6, 7, 8, 9]), 21)
    salted = Req("c", PROMPT + [5], cache_salt="s")
    salted.prefix_len, salted.last_node = running.prefix_len, running.last_node  # unsalted match
    salted.extend_end = 22
    unmatched, ahead = Req("d", PROMPT), Req("e", PROMPT)
    unmatched.extend_end = 3
    init_next_round_input(ahead, tree)
    ahead.extend_end, ahead.prefix_len = 21, 4  # not the match's length
    calls: list[Callable[[], object]] = [
        lambda: tree.match_prefix(RadixKey(PROMPT)),  # type: ignore[arg-type]
        lambda: _match(tree, [-1]),
        lambda: tree.alloc_for_extend(running),  # prefix_len behind its computed tokens
        lambda: tree.alloc_for_extend(salted),  # another namespace's match
        lambda: tree.can_alloc_for_extend(salted),
        lambda: tree.alloc_for_extend(unmatched),  # no match
        lambda: tree.alloc_for_extend(ahead),
        lambda: tree.alloc_for_extend("req"),  # type: ignore[arg-type]
        lambda: tree.alloc_for_decode([running]),  # its prompt is not all computed
        lambda: tree.check_decode_mem([unmatched]),
        lambda: tree.row_device_indices(unmatched),
        lambda: tree.prefix_device_indices(unmatched),
        lambda: tree.path_device_indices("node"),  # type: ignore[arg-type]
        lambda: tree.lock("node"),  # type: ignore[arg-type]
        lambda: tree.inc_lock_ref("node"),  # type: ignore[arg-type]
        lambda: tree.evict_sliding_windows(unmatched, 0),
        lambda: init_next_round_input(running, tree),  # running: its prefix is its own
        lambda: match_kv_cache("req", tree),  # type: ignore[arg-type]
        lambda: checkpoint_kv_cache("req", tree),  # type: ignore[arg-type]
        lambda: tree.release_kv_cache(running, checkpoint=None),  # type: ignore[arg-type]
        lambda: tree.evict(EvictParams(num_tokens=-1)),
        lambda: tree.reset(),  # b is running
    ]
    for call in calls:
        _refused(tree, InvalidRequestError, call)
    forged = TreeLock(running.last_node, DecLockRefParams(None))  # not one of the tree's
    waiting = Req("f", PROMPT + [5])
    init_next_round_input(waiting, tree)
    waiting.lock, waiting.extend_end, running.lock = forged, 22, forged
    _refused(tree, LockError, lambda: tree.alloc_for_extend(waiting))
    _refused(tree, LockError, lambda: tree.checkpoint(running, up_to=21))
    _refused(tree, LockError, lambda: release_kv_cache(running, tree, checkpoint=True))
