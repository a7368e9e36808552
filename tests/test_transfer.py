"""Pure-core tests of shadowradix/transfer.py: a prefix moved by page index between two caches.

A page-level oracle stands in for the pools: every page a cache computes holds a fingerprint of
(pool, token prefix up to its end); a transfer copies fingerprints from the sender's pages to
the receiver's as the receipt says. After an import, every page the receiver's match of the
prompt reads (compressed pages of the whole prefix, SWA pages of its window) must hold the
fingerprint a from-scratch computation would have put there, whatever the receiver held before
(nothing, part of the prefix, tombstoned windows, other branches), and a refused import must
leave the receiver snapshot-identical.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from shadowradix import (
    CacheConfig,
    ImportRefused,
    InvalidRequestError,
    LockError,
    Pool,
    PrefixLayout,
    RefusalReason,
    ShadowRadixCache,
    WindowSource,
    export_layout,
    import_prefix,
    plan_import,
    pool_regions,
    release_layout,
)
from shadowradix.testing.snapshot import snapshot


def config(page: int, full: int = 64, swa: int = 24, window: int = 8) -> CacheConfig:
    return CacheConfig(
        page_size=page,
        window=window,
        compress_ratios=(0, 4, 8),
        full_capacity=full * page,
        swa_capacity=swa * page,
        debug=True,
    )


class Pages:
    """The oracle: fingerprints per (pool, page id) of one cache."""

    def __init__(self, cache: ShadowRadixCache) -> None:
        self.cache = cache
        self.fp: dict[tuple[Pool, int], tuple[int, ...]] = {}

    def serve(self, tokens: list[int]) -> None:
        """Compute ``tokens`` from whatever prefix is cached, fingerprint the new pages, and
        insert them (finish)."""
        p = self.cache.config.page_size
        req = self.cache.admit(tokens, self.cache.match_prefix(tokens, max_len=len(tokens) - 1))
        start = req.length
        self.cache.extend(req, tokens[start:])
        for page in range(start // p, len(tokens) // p):
            self.fp[(Pool.FULL, req.vpages[page])] = tuple(tokens[: (page + 1) * p])
            if page >= req.swa_base:
                self.fp[(Pool.SWA, req.swa_pages[page - req.swa_base])] = tuple(
                    tokens[: (page + 1) * p]
                )
        self.cache.cache_unfinished(req)  # the window while still live, then finish
        self.cache.finish(req)

    def check_prefix(self, tokens: list[int], n: int) -> None:
        """The receiver's LIVE match of ``tokens[:n]`` reads only right fingerprints."""
        p, w = self.cache.config.page_size, self.cache.config.window
        match = self.cache.match_prefix(tokens, max_len=n)
        assert match.prefix_len == n and match.window is not WindowSource.REPLAY
        if not n:
            return
        path = match.node.path_from_root()
        vpages = np.concatenate([nd.vpages for nd in path])
        for page in range(n // p):
            assert self.fp.get((Pool.FULL, int(vpages[page]))) == tuple(tokens[: (page + 1) * p])
        for nd in path:
            live = nd.end_page - len(nd.swa_pages)
            for page in range(max(live, (n - w) // p if n > w else 0), nd.end_page):
                swa = int(nd.swa_pages[page - live])
                assert self.fp.get((Pool.SWA, swa)) == tuple(tokens[: (page + 1) * p])


def transfer(sender: Pages, receiver: Pages, tokens: list[int], layout: PrefixLayout):
    """Pickle ``layout`` (the wire), import, copy the fingerprints by the receipt, release."""
    wire = pickle.loads(pickle.dumps(layout))
    assert wire.pin is None and (layout.pin is not None) == (layout.num_tokens > 0)
    try:
        receipt = import_prefix(receiver.cache, tokens, wire)
    finally:
        release_layout(sender.cache, layout)
    for pool in (Pool.FULL, Pool.SWA):
        pages = receipt.pages(pool)
        for src, dst in zip(pages.src.tolist(), pages.dst.tolist()):
            receiver.fp[(pool, dst)] = sender.fp[(pool, src)]
    return layout, receipt


prefixes = st.lists(st.integers(0, 3), min_size=1, max_size=40)


@settings(max_examples=60)
@given(
    page=st.sampled_from([1, 2, 4, 8]),
    prompt=prefixes,
    before=st.lists(st.tuples(st.integers(0, 40), prefixes), max_size=4),
    evict=st.tuples(st.integers(0, 64), st.integers(0, 64)),
)
def test_import_reads_what_a_recomputation_writes(page, prompt, before, evict):
    """Whatever the receiver held (branches sharing part of the prompt, some of it evicted or
    tombstoned), the imported prefix reads right fingerprints and re-imports cost nothing."""
    sender, receiver = Pages(ShadowRadixCache(config(page))), Pages(ShadowRadixCache(config(page)))
    sender.serve(prompt + [1])
    for cut, suffix in before:  # the receiver computed other prompts sharing a prefix
        receiver.serve(prompt[:cut] + suffix + [2])
    receiver.cache.evict(*evict)
    note(f"receiver before: {receiver.cache.stats()}")
    tokens = prompt + [1]
    before_snap = snapshot(receiver.cache)
    layout = export_layout(sender.cache, tokens, max_len=len(tokens) - 1)
    try:
        plan = plan_import(receiver.cache, tokens, layout)
    except ImportRefused as exc:
        assert exc.reason is RefusalReason.NO_ROOM
        assert snapshot(receiver.cache) == before_snap
        release_layout(sender.cache, layout)
        return
    layout, receipt = transfer(sender, receiver, tokens, layout)
    assert (len(receipt.full), len(receipt.swa)) == plan.needed
    assert receipt.full.index.tolist() == list(plan.full_index)
    receiver.cache.check_invariants()
    sender.cache.check_invariants()
    receiver.check_prefix(tokens, layout.num_tokens)
    again = import_prefix(receiver.cache, tokens, layout)
    assert len(again.full) == len(again.swa) == 0


@settings(max_examples=30)
@given(page=st.sampled_from([1, 2, 4]), prompt=prefixes, full=st.integers(1, 12))
def test_refusal_leaves_the_receiver_unchanged(page, prompt, full):
    """A receiver without room raises `ImportRefused` (NO_ROOM, with what it lacks) and stays
    snapshot-identical; the sender keeps its prefix once it releases the layout."""
    tokens = prompt * 3 + [1]
    room = -(-len(tokens) // page) + 1  # the sender computes the whole prompt in one step
    sender = Pages(ShadowRadixCache(config(page, full=max(64, room), swa=max(24, room))))
    receiver = Pages(ShadowRadixCache(config(page, full=full, swa=max(full, 8 // page + 2))))
    sender.serve(tokens)
    layout = export_layout(sender.cache, tokens, max_len=len(tokens) - 1)
    before = snapshot(receiver.cache)
    try:
        import_prefix(receiver.cache, tokens, layout)
    except ImportRefused as exc:
        assert exc.reason is RefusalReason.NO_ROOM
        assert exc.needed[0] > exc.available[0] or exc.needed[1] > exc.available[1]
        assert snapshot(receiver.cache) == before
        receiver.cache.check_invariants()
    else:
        assert layout.num_pages <= full
    release_layout(sender.cache, layout)
    sender.check_prefix(tokens, layout.num_tokens)


def test_pinned_until_released():
    """The sender's exported pages survive eviction until `release_layout`; releasing twice
    raises `LockError`."""
    cache = ShadowRadixCache(config(4))
    tokens = list(range(30))
    Pages(cache).serve(tokens)
    layout = export_layout(cache, tokens)
    assert layout.num_tokens == 28 and layout.excluded_len == 2
    cache.evict(10**6, 10**6)
    assert cache.match_prefix(tokens).prefix_len == 28
    release_layout(cache, layout)
    with pytest.raises(LockError):
        release_layout(cache, layout)
    cache.evict(10**6, 10**6)
    assert cache.match_prefix(tokens).prefix_len == 0


def test_layout_contents_and_regions():
    """A layout names every virtual page of the prefix and the SWA pages of its window only;
    the regions' rows are page-local (``page * rows_per_page + k``)."""
    cfg = config(4)
    cache = ShadowRadixCache(cfg)
    tokens = list(range(40))
    Pages(cache).serve(tokens)
    layout = export_layout(cache, tokens, max_len=39)
    assert layout.num_tokens == 36 and layout.num_pages == 9
    assert layout.window_first_page == (36 - 8) // 4 and len(layout.swa_pages) == 2
    regions = {r.name: r for r in pool_regions(cfg)}
    assert sorted(regions) == ["c4", "c8", "ring4", "ring8", "swa"]
    assert regions["c4"].rows_per_page == 1 and regions["ring4"].rows_per_page == 4
    rows = layout.slots(regions["swa"])
    assert rows.tolist() == [s * 4 + k for s in layout.swa_pages.tolist() for k in range(4)]
    with pytest.raises(ValueError):
        layout.full_pages[0] = 99  # read-only
    release_layout(cache, layout)


def test_request_source_and_bad_input():
    """An active request exports what its `cache_unfinished` inserted; tokens that differ from
    the layout's, another page size, or a non-layout are refused, changing nothing."""
    cache = ShadowRadixCache(config(4))
    tokens = list(range(20))
    req = cache.admit(tokens)
    cache.extend(req, tokens)
    cache.cache_unfinished(req)
    layout = export_layout(cache, req)
    assert layout.num_tokens == 20 and layout.tokens.tolist() == tokens
    other = ShadowRadixCache(config(2))
    with pytest.raises(ImportRefused) as info:
        import_prefix(other, tokens, layout)
    assert info.value.reason is RefusalReason.MISMATCH
    receiver = ShadowRadixCache(config(4))
    before = snapshot(receiver)
    with pytest.raises(InvalidRequestError):
        import_prefix(receiver, [9] + tokens[1:], layout)
    with pytest.raises(InvalidRequestError):
        import_prefix(receiver, tokens, "not a layout")  # type: ignore[arg-type]
    assert snapshot(receiver) == before
    release_layout(cache, layout)
    cache.finish(req)
    cache.check_invariants()


def test_replay_derived_layouts_are_refused():
    cache = ShadowRadixCache(config(4))
    tokens = list(range(20))
    Pages(cache).serve(tokens)
    layout = export_layout(cache, tokens)
    fake = PrefixLayout(**{**layout.__dict__, "approximate": True, "pin": None})
    with pytest.raises(ImportRefused) as info:
        import_prefix(ShadowRadixCache(config(4)), tokens, fake)
    assert info.value.reason is RefusalReason.UNSUPPORTED
    release_layout(cache, layout)


def test_own_path_is_not_room():
    """The receiver's pages of the prefix itself are not room for the rest of it: the import
    locks them, so a plan counting them as evictable would fail half-way."""
    sender, receiver = Pages(ShadowRadixCache(config(4))), Pages(ShadowRadixCache(config(4, 8)))
    tokens = list(range(41))
    sender.serve(tokens)
    receiver.serve(tokens[:17])  # 4 pages cached (evictable), 4 free; the rest needs 6
    layout = export_layout(sender.cache, tokens, max_len=40)
    before = snapshot(receiver.cache)
    with pytest.raises(ImportRefused) as info:
        plan_import(receiver.cache, tokens, layout)
    assert info.value.needed[0] == 6 and info.value.available[0] == 4
    with pytest.raises(ImportRefused):
        import_prefix(receiver.cache, tokens, layout)
    assert snapshot(receiver.cache) == before
    release_layout(sender.cache, layout)
