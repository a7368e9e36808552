"""Slot arithmetic, once (issue #13 item 3): `shadowradix.slots` under NumPy and under torch
gives the same numbers as the documented ``//`` / ``%`` formulas, and the graph metadata built
from it on the device hands out exactly the slots of the core's `Allocation` / `ReadPlan`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from small_models import SHORT

from adapters.forward.graph_meta import StepMeta, step_metadata
from adapters.forward.graph_verify import VerifyBuffers
from adapters.memory.pools import KVPools
from adapters.model.weights import init_weights
from shadowradix import ShadowRadixCache, slots

POW2 = st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, 256])
VALUES = st.lists(st.integers(0, 2**40), min_size=1, max_size=16)


def _both(values: list[int]) -> tuple[np.ndarray, torch.Tensor]:
    return np.array(values, dtype=np.int64), torch.tensor(values, dtype=torch.int64)


def _same(a: np.ndarray, t: torch.Tensor, want: list) -> None:
    """NumPy's and torch's results agree with each other and with the Python-int formula."""
    assert str(a.dtype) == str(t.dtype).removeprefix("torch.")
    assert a.tolist() == t.tolist() == want


@given(POW2, POW2, POW2, st.booleans(), st.integers(1, 300), VALUES, VALUES)
def test_formulas_agree_under_numpy_torch_and_python_ints(p, r, ring, overlap, w, xs, ys) -> None:
    pages, pages_t = _both(ys[: len(xs)] + xs[len(ys) :])
    pos, pos_t = _both(xs)
    spp = max(1, p // r)
    cases = [
        (slots.page_of, (pos, p), (pos_t, p), lambda x, _: x // p),
        (slots.page_slot, (pages, pos, p), (pages_t, pos_t, p), lambda x, g: g * p + x % p),
        (
            slots.ring_row,
            (pages, pos, ring),
            (pages_t, pos_t, ring),
            lambda x, g: g * ring + x % ring,
        ),
        (
            slots.compressed_slot,
            (pages, pos, p, r, spp),
            (pages_t, pos_t, p, r, spp),
            lambda x, g: g * spp + (x % p) // r,
        ),
        (slots.completes_group, (pos, r), (pos_t, r), lambda x, _: (x + 1) % r == 0),
        (slots.ends_page, (pos, p), (pos_t, p), lambda x, _: (x + 1) % p == 0),
        (slots.group_of, (pos, r), (pos_t, r), lambda x, _: (x + 1) // r - 1),
        (slots.group_end, (pos, r), (pos_t, r), lambda x, _: (x + 1) * r - 1),
        (
            slots.group_first,
            (pos, r, overlap),
            (pos_t, r, overlap),
            lambda x, _: x * r - r * overlap,
        ),
        (slots.visible_entries, (pos, r), (pos_t, r), lambda x, _: (x + 1) // r),
        (slots.window_first, (pos, w), (pos_t, w), lambda x, _: x - w),
        (
            slots.window_first_page,
            (pos, w, p, np),
            (pos_t, w, p, torch),
            lambda x, _: max(0, x - w) // p,
        ),
        (
            slots.first_inflight,
            (pos, r, overlap, np),
            (pos_t, r, overlap, torch),
            lambda x, _: max(0, x // r * r - r * overlap),
        ),
    ]
    pairs = list(zip(xs, pages.tolist()))
    for fn, np_args, torch_args, formula in cases:
        want = [formula(x, g) for x, g in pairs]
        _same(np.asarray(fn(*np_args)), fn(*torch_args), want)
        # the int path (the oracle's, the core's scalars: no namespace) is the same formula
        for (x, g), expected in zip(pairs, want):
            args = [x if a is pos else g if a is pages else None if a is np else a for a in np_args]
            assert fn(*args) == expected, (fn.__name__, x, g)


@given(st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=16), st.integers(-5, 5))
def test_clamp_low_agrees_and_keeps_int64(xs, low) -> None:
    """``xp.where`` against a Python int keeps int64 in both namespaces (NEP 50 / torch's
    scalar rules); the int path is Python's ``max``."""
    a, t = _both(xs)
    want = [max(x, low) for x in xs]
    _same(slots.clamp_low(a, np, low), slots.clamp_low(t, torch, low), want)
    assert [slots.clamp_low(x, None, low) for x in xs] == want


# -- the graph metadata hands out the core's slots ----------------------------------------------


def _world(page: int, t_len: int):
    cc = SHORT.cache_config(
        page_size=page, full_capacity=512, swa_capacity=256, speculative=True, debug=True
    )
    weights = init_weights(SHORT)
    pools = KVPools(SHORT, cc, "cpu", torch.float32)
    buf = VerifyBuffers(cc, 4, cc.full_capacity, t_len, weights)
    return ShadowRadixCache(cc), cc, pools, buf


def _check_step(cc, pools: KVPools, plan, meta: StepMeta, t_len: int) -> None:
    """Every slot of the step in ``meta`` equals the allocation's / the read plan's."""
    n, starts = len(plan.request_ids), np.asarray(plan.starts)
    assert meta.positions.tolist() == plan.positions.tolist()
    assert meta.swa_new.tolist() == plan.swa_slots.tolist()
    for s in cc.streams:
        sm, w, r = meta.streams[s.ratio], plan.stream(s.ratio), s.ratio
        layer = cc.compress_ratios.index(r)
        rows = w.ring_request * t_len + w.ring_positions - starts[w.ring_request]
        assert sm.ring_new[rows].tolist() == w.ring_rows.tolist()  # every row the core keeps
        erows = w.entry_request * t_len + slots.group_end(w.entry_groups, r)
        erows -= starts[w.entry_request]
        assert sm.entry_slot[erows].tolist() == w.entry_slots.tolist()
        assert sm.group[erows].tolist() == w.entry_groups.tolist()
        others = np.setdiff1d(np.arange(n * t_len), erows)
        assert set(sm.entry_slot[others].tolist()) <= {KVPools.sentinel(pools.compressed[layer])}
        carry = {
            (q, x): row
            for q, x, row in zip(w.carry_request.tolist(), w.carry_positions.tolist(),
                                 w.carry_rows.tolist())
        }  # fmt: skip
        for row, q in zip(erows.tolist(), w.entry_request.tolist()):
            first = slots.group_first(int(sm.group[row]), r, s.overlap)
            for k, src in enumerate(sm.group_src[row].tolist()):
                if src == 0:  # a carried row: the core carries the same ring row in
                    assert carry[(q, first + k)] == int(sm.group_rows[row, k])
                else:  # this step's row, or padding before position 0
                    assert (first + k >= starts[q]) if src == 1 else (first + k < 0)
    for i, read in enumerate(plan.reads):
        for j in range(t_len):
            row, t = i * t_len + j, int(starts[i]) + j
            seen = (read.swa_positions > t - cc.window) & (read.swa_positions <= t)
            got = meta.window_slots[row][meta.window_mask[row]].tolist()
            assert got == read.swa_slots[seen].tolist(), (i, j)
        last = i * t_len + t_len - 1  # the request's last row sees every entry of the read plan
        for s in cc.streams:
            sm, entries = meta.streams[s.ratio], read.stream(s.ratio).entry_slots
            assert int(sm.lengths[last]) == len(entries)
            got = sm.rows(meta.row_batch).slots()[last, : len(entries)]
            assert got.tolist() == entries.tolist()


@pytest.mark.parametrize("page,t_len", [(1, 1), (4, 1), (16, 1), (4, 3), (16, 5)])
def test_graph_metadata_slots_equal_the_core_allocation(page: int, t_len: int) -> None:
    """Decode (``T = 1``) and verify steps over requests at group / page / window boundaries:
    the device metadata's SWA slots, ring rows, entry slots, carried rows, window and visible
    entries are the core's, slot for slot."""
    cache, cc, pools, buf = _world(page, t_len)
    prompt = list(range(40))
    reqs = [cache.admit(prompt[:n]) for n in (15, 31, 3)]
    deltas = list(cache.extend_batch(reqs, [r.prompt_remaining.tolist() for r in reqs]).deltas)
    for step in range(3):
        chunks = [[(5 * step + 3 * i + j) % 200 for j in range(t_len)] for i in range(3)]
        extend = cache.extend_batch if t_len == 1 else cache.extend_draft_batch
        plan = extend(reqs, chunks)
        buf.load_block(reqs, chunks, None, [*deltas, *plan.deltas])
        meta = step_metadata(cc, pools, buf, len(reqs), 64)
        _check_step(cc, pools, plan, meta, t_len)
        deltas = []
        if t_len > 1:
            deltas = [d for r in reqs for d in cache.rollback(r, 1).deltas]
