"""Verification gaps of issue #13 around the replay lineage (`approximate`): it survives a node
split (made by an admission or by an insert), it reaches an exact request that deduplicates onto
a replayed node, an approximate request never revives an exact node's tombstones, a tie between
replay and the live hit stays exact, and an exact hit is never reported approximate because of
replayed nodes below it. Each test fails on a copy of the core carrying the bug it names.

Every write goes through the fingerprint oracle, marked approximate for an approximate request,
so "reads replay-derived state without being flagged" is checked, not only the flags."""

from __future__ import annotations

import numpy as np
import pytest

from shadowradix import Allocation, CacheConfig, Request, ShadowRadixCache, WindowSource
from shadowradix.node import Node
from shadowradix.testing import FingerprintOracle

P, W = 4, 8
CFG = dict(page_size=P, window=W, compress_ratios=(0, 2, 8), overlap_ratios=(2,),
           full_capacity=P * 64, swa_capacity=P * 32, bounded_replay=True, debug=True)  # fmt: skip


class World:
    """A bounded-replay cache and the oracle of everything written to its pools."""

    def __init__(self) -> None:
        self.cache = ShadowRadixCache(CacheConfig(**CFG))
        self.oracle = FingerprintOracle(self.cache.config)

    def start(self, prompt: list[int], *, cold: bool = False) -> Request:
        """Admit ``prompt`` on its best match (on nothing at all if ``cold``: computed from
        scratch) and compute the rest of it; the request keeps running."""
        cut = 0 if cold else len(prompt) - 1
        r = self.cache.admit(prompt, self.cache.match_prefix(prompt, max_len=cut))
        if r.replay_allocation is not None:
            self._write(r, r.replay_allocation)
        if len(r.prompt_remaining):
            self._write(r, self.cache.extend(r, r.prompt_remaining))
        self.check_reads(r)
        return r

    def serve(self, prompt: list[int], *, cold: bool = False) -> Request:
        r = self.start(prompt, cold=cold)
        self.cache.finish(r)
        return r

    def _write(self, r: Request, alloc: Allocation) -> None:
        self.oracle.write(alloc, {r.id: r.tokens}, {r.id} if r.approximate else set())

    def check_reads(self, r: Request) -> None:
        """Every slot ``r`` reads holds recomputation's value, and approximate state only if
        ``r`` says it is approximate."""
        self.oracle.check_reads(self.cache.read_plan(r), r.tokens, r.id, r.approximate)

    def wipe_windows(self) -> None:
        """SWA pressure: tombstone every window nobody protects."""
        self.cache.evict(swa_tokens=10**6)

    def node_at(self, tokens: list[int], end_page: int) -> Node:
        """The tree node on ``tokens``' path that ends at ``end_page``."""
        walk = self.cache._tree.walk(np.asarray(tokens))
        found = [n for n in walk.nodes if n.end_page == end_page]
        assert found, f"no node of the path ends at page {end_page}"
        return found[0]


X = list(range(100, 132))  # 8 pages
Y = list(range(200, 216))  # 4 pages


def _replayed_branch(world: World) -> Request:
    """X cached exactly, its windows tombstoned, then X + Y served by a replay of X's window:
    the node of Y is replay-derived."""
    world.serve(X + [1])
    world.wipe_windows()
    r = world.serve(X + Y + [2])
    assert r.match.window is WindowSource.REPLAY and r.approximate
    assert world.node_at(X + Y, 12).approximate and not world.node_at(X, 8).approximate
    return r


@pytest.mark.parametrize("splitter", ["admit", "insert"])
def test_a_split_replayed_node_keeps_its_lineage_in_both_halves(splitter: str) -> None:
    """Cutting the replayed node of Y (by an admission resuming inside it, or by an insert
    ending inside it) must leave both halves approximate: the upper half's compressed KV was
    computed after the replay. An exact request that then recomputes X + Y[:8] and inserts it
    reads the upper half's pages and must be flagged; so must a later hit on that prefix."""
    world = World()
    _replayed_branch(world)
    prefix = X + Y[:8]  # ends inside Y's node, after 2 of its 4 pages
    if splitter == "admit":
        m = world.cache.match_prefix(prefix + [5])
        assert m.node_pages == 2 and m.node.num_pages == 4, "the admission must split the node"
        world.cache.abort(world.cache.admit(prefix + [5], m))
    exact = world.start(prefix + [3], cold=True)  # computes everything itself
    assert not exact.approximate
    world.cache.cache_unfinished(exact)  # dedups onto X and onto the upper half of Y's node
    upper = world.node_at(prefix, 10)
    assert upper.num_pages == 2 and world.node_at(X + Y, 12).start_page == 10
    assert upper.approximate, "the split lost the replay lineage of the upper half"
    assert exact.approximate, "deduplicated onto replay-derived pages without being flagged"
    world.check_reads(exact)
    world.cache.finish(exact)
    # the exact request's window revived the upper half: a LIVE hit on it, still approximate
    m = world.cache.match_prefix(prefix + [7])
    assert m.window is WindowSource.LIVE and m.prefix_len == 40
    assert m.approximate
    reader = world.cache.admit(prefix + [7], m)
    assert reader.approximate
    world.check_reads(reader)


def test_an_exact_request_deduplicating_onto_a_replayed_node_becomes_approximate() -> None:
    """An exact request computing X + Y + Z from scratch, finishing after the replayed request
    inserted X + Y, switches its page table to the replayed node's pages: from then on it reads
    approximate state (its outputs and whatever it inserts are approximate)."""
    world = World()
    z = list(range(300, 308))
    exact = world.start(X + Y + z + [3], cold=True)
    _replayed_branch(world)  # X + Y enter the tree while `exact` runs
    assert not exact.approximate
    world.cache.cache_unfinished(exact)
    assert exact.vpages[8:12] == list(world.node_at(X + Y, 12).vpages), "no dedup happened"
    assert exact.approximate, "adopted a replayed node's pages but still claims to be exact"
    world.check_reads(exact)
    world._write(exact, world.cache.extend(exact, [4, 4, 4, 4]))  # decoded on approximate state
    world.cache.finish(exact)
    tail = world.node_at(X + Y + z + [3, 4, 4, 4], 15)
    assert tail.approximate, "what the request inserted after the dedup must be approximate"


def test_an_approximate_request_never_revives_an_exact_nodes_tombstones() -> None:
    """X + Y is computed twice: by a replayed request (approximate) and, meanwhile, by an exact
    one, which inserts it first. With Y's node tombstoned, the replayed request's insert
    deduplicates onto it and must not hand it its approximate window: an exact hit on X + Y
    would then read replay-derived SWA."""
    world = World()
    world.serve(X + [1])
    world.wipe_windows()
    replayed = world.start(X + Y + [2])
    assert replayed.match.window is WindowSource.REPLAY and replayed.approximate
    world.serve(X + Y + [3], cold=True)  # exact: Y's node is exact
    node = world.node_at(X + Y, 12)
    assert not node.approximate
    world.wipe_windows()
    assert len(node.swa_pages) == 0
    world.cache.finish(replayed)  # dedups onto the exact, tombstoned node of Y
    assert len(node.swa_pages) == 0, "an approximate window revived an exact node"
    assert not node.approximate
    m = world.cache.match_prefix(X + Y + [5])
    assert m.approximate or m.window is WindowSource.REPLAY
    world.start(X + Y + [5])  # checks its reads: an exact LIVE hit here would read the replay


def test_replay_on_a_tie_with_the_live_hit_stays_exact() -> None:
    """The deepest live boundary (32) is exactly ``cached_len - W`` (40 - 8): a replay would
    skip no more tokens than the live hit, so the match is the exact LIVE one."""
    world = World()
    cache = world.cache
    world.serve(X + [1])
    world.serve(X + Y[:8] + [1])  # X's node [0, 8) and a child [8, 10)
    cache.abort(cache.admit(X + [5]))  # X's path is now more recent than the child
    # heads of X (pages 0..5), then the oldest tail window: the child's first page
    assert cache.evict(swa_tokens=7 * P).swa_pages == 7
    child = world.node_at(X + Y[:8], 10)
    assert child.live_from == 1 and world.node_at(X, 8).live_from == 6
    m = cache.match_prefix(X + Y[:8] + [9])
    assert m.cached_len == 40 and m.cached_len - W == 32
    assert m.window is WindowSource.LIVE and m.replay_start is None
    assert (m.prefix_len, m.hit_len, m.approximate) == (32, 32, False)
    r = cache.admit(X + Y[:8] + [9], m)
    assert not r.approximate and r.replay_allocation is None
    world.check_reads(r)


def test_a_prompt_of_one_window_with_no_live_swa_is_a_miss_not_a_replay() -> None:
    """The other tie: ``cached_len == W`` with nothing live. A replay from 0 would recompute
    every token and only mark the request approximate."""
    world = World()
    world.serve(X[:W] + [1])
    world.wipe_windows()
    m = world.cache.match_prefix(X[:W] + [9])
    assert m.cached_len == W
    assert m.window is WindowSource.NONE and not m.is_replay and m.hit_len == 0
    r = world.cache.admit(X[:W] + [9], m)
    assert not r.approximate and r.replay_allocation is None


def test_an_exact_hit_above_a_replayed_node_is_not_approximate() -> None:
    """The walk goes on into a replayed node (tombstoned) below the deepest live boundary: the
    hit ends at the exact node X, so it is exact, and its reads are all exact."""
    world = World()
    world.serve(X + [1])
    world.wipe_windows()
    world.serve(X + Y[:4] + [2])  # replayed: the child [8, 9) is approximate
    world.wipe_windows()
    world.serve(X + [1], cold=True)  # exact recomputation revives X's window
    assert world.node_at(X + Y[:4], 9).approximate
    m = world.cache.match_prefix(X + Y[:4] + [3])
    assert m.cached_len == 36 and m.prefix_len == 32 and m.window is WindowSource.LIVE
    assert m.node is world.node_at(X, 8)
    assert not m.approximate, "an exact hit reported approximate (a replayed node lies below)"
    r = world.cache.admit(X + Y[:4] + [3], m)
    assert not r.approximate
    world.check_reads(r)
