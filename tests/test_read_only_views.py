"""Read-only page-table views (issue #13): every array the core hands out as a page table or a
step's slots is read-only or a copy, so an engine writing to one gets an error, never a
corrupted cache; and the vLLM shim reports a replayed admission's private window through the
core's deltas."""

from __future__ import annotations

import numpy as np
import pytest
from core_helpers import cached

from shadowradix import CacheConfig, ShadowRadixCache
from shadowradix.integrations.vllm import ShadowRadixKVCacheManager
from shadowradix.integrations.vllm_types import Request
from shadowradix.testing import snapshot

CFG = dict(page_size=4, window=8, compress_ratios=(4, 0), overlap_ratios=(4,),
           full_capacity=256, swa_capacity=128)  # fmt: skip


def _arrays(plan) -> list[tuple[str, np.ndarray]]:
    out = [(f, getattr(plan, f)) for f in ("token_offsets", "positions", "virtual_slots",
                                           "swa_slots")]  # fmt: skip
    for s in plan.streams:
        out += [(f"w{s.ratio}.{k}", v) for k, v in vars(s).items() if isinstance(v, np.ndarray)]
    for read in plan.reads:
        out += _reads(read)
    return out


def _reads(read) -> list[tuple[str, np.ndarray]]:
    out = [("swa_positions", read.swa_positions), ("swa_slots", read.swa_slots)]
    for s in read.streams:
        out += [(f"r{s.ratio}.{k}", v) for k, v in vars(s).items() if isinstance(v, np.ndarray)]
    return out


def test_writing_to_a_returned_table_raises_and_changes_nothing() -> None:
    cache = ShadowRadixCache(CacheConfig(**CFG))
    prompt = list(range(40))
    cached(cache, prompt)
    cached(cache, prompt[:20] + [7] * 8)  # splits the prompt's node: its path has two nodes
    r = cache.admit(prompt + [1, 2, 3])  # a 40-token hit: its table lends the tree's pages
    assert len(r.terminal.path_from_root()) == 2
    plan = cache.extend(r, r.prompt_remaining)
    views = [("shared", r.vpages.shared())] + _arrays(plan)
    assert len(views) > 8
    before = snapshot(cache), r.vpages.tolist(), list(r.swa_pages)
    for name, view in views:
        if not view.size:
            continue
        with pytest.raises(ValueError, match="read-only"):
            view[0] = 12345
        assert not view.flags.writeable, name
    copy = np.asarray(r.vpages)  # a new array: writing to it leaves the table alone
    copy[:] = -1
    assert (snapshot(cache), r.vpages.tolist(), list(r.swa_pages)) == before
    fresh = cache.read_plan(r, start=40)  # the cached plan's arrays were not written either
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(_reads(fresh), _reads(plan.reads[0])))
    cache.check_invariants()


def test_vllm_reports_a_replayed_window_through_deltas() -> None:
    """A hit whose window is replayed: the hit names no SWA page, the admission gives the
    request private ones; the engine's tables, built from the hit and the deltas, match."""
    config = CacheConfig(**CFG, bounded_replay=True)
    mgr = ShadowRadixKVCacheManager(config)
    a = Request("a", list(range(40)))
    blocks, n, _ = mgr.get_computed_blocks(a)
    mgr.allocate_slots(a, 40, n, blocks)
    a.num_computed_tokens = 40
    mgr.free(a)
    mgr.cache.evict(swa_tokens=128)  # every window tombstoned: the hit must replay
    b = Request("b", list(range(40)) + [7, 8])
    blocks, n, _ = mgr.get_computed_blocks(b)
    assert n == 40 and all(x is None for x in blocks.blocks[1])
    new = mgr.allocate_slots(b, b.num_tokens - n, n, blocks)
    assert new is not None and new.replay is not None
    tables = [list(t) for t in blocks.blocks]
    for g, delta in enumerate(new.deltas):
        del tables[g][delta.first_page :]
        tables[g].extend(delta.block_ids)
    assert tuple(tables) == mgr.get_block_ids("b")
    assert None not in tables[1][-3:]  # the replayed window's pages
