"""Encoder-side bounded replay executed on the pools (adapters/forward/replay.py) against its
explicit
dense oracle (adapters/model/replay_reference.py).

Scenario of every test: a first request computes a prompt cold and is cached; every window is
then tombstoned, so a second request sharing the prefix gets a REPLAY match: it rebuilds the
window ``[prefix_len - W, prefix_len)`` and continues. In float64 on the CPU the paged replay
and the oracle perform the same arithmetic, so the logits must be *bit-identical*
(``torch.equal``) — for the continuation, the decode steps and the replay itself — and they
must differ from a cold prefill (the ``approximate`` flag is honest). Lengths sit on and around
page, group (4, 128) and window boundaries.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
import torch
from small_models import CFG, SHORT, SHORT_SHARED, one_thread

from adapters.forward.graph_decode import GraphDecoder
from adapters.forward.paged import build_step, run_step
from adapters.forward.replay import ReplayPlanError, check_replay, replay_step
from adapters.memory.pools import KVPools
from adapters.model.reference import reference_logits
from adapters.model.replay_reference import (
    SegmentedReference,
    replay_reference_generate,
    replay_reference_logits,
)
from adapters.model.weights import init_weights
from shadowradix import ShadowRadixCache, WindowSource

pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")

TOKENS: list[int] = np.random.default_rng(4321).integers(0, 256, 700).tolist()
TAIL: list[int] = np.random.default_rng(99).integers(0, 256, 300).tolist()


_one_thread = pytest.fixture(autouse=True, scope="module")(one_thread)


@functools.cache
def weights_for(cfg, dtype=torch.float64):
    return init_weights(cfg, "cpu", dtype)


def ceil_to(x: int, p: int) -> int:
    return -(-x // p) * p


class Engine:
    """A cache with ``bounded_replay``, its pools, and the steps the runner performs."""

    def __init__(self, cfg, page: int, swa_tokens: int = 0, dtype=torch.float64) -> None:
        self.cfg, self.page = cfg, page
        self.weights = weights_for(cfg, dtype)
        swa = swa_tokens or ceil_to(3 * (cfg.window + 4 * page + 64), page)
        self.cc = cfg.cache_config(
            page_size=page,
            full_capacity=ceil_to(2400, page),
            swa_capacity=swa,
            bounded_replay=True,
            debug=True,
        )
        self.cache = ShadowRadixCache(self.cc)
        self.pools = KVPools(cfg, self.cc, "cpu", dtype)

    def forward(self, reqs, chunks, alloc, plans) -> list[torch.Tensor]:
        flat = np.fromiter(itertools.chain.from_iterable(chunks), np.int64)
        st = build_step(self.cfg, alloc, plans, flat, "cpu")
        logits = run_step(self.weights, self.pools, st, None)
        return list(torch.split(logits, [len(c) for c in chunks]))

    def step(self, reqs, chunks) -> list[torch.Tensor]:
        alloc = self.cache.extend_batch(reqs, chunks)
        plans = [self.cache.read_plan(r, start=s) for r, s in zip(reqs, alloc.starts)]
        return self.forward(reqs, chunks, alloc, plans)

    def prefill(self, req, chunk: int) -> torch.Tensor:
        out = []
        while len(req.prompt_remaining):
            out += self.step([req], [req.prompt_remaining[:chunk].tolist()])
            self.cache.cache_unfinished(req)
        return torch.cat(out)

    def replay(self, reqs, slices: tuple[int, ...] = (10**9,)) -> list[torch.Tensor]:
        """Executes the replays of ``reqs`` in one forward per slice size (cycled): every
        request advances by the same number of tokens per forward."""
        allocs = [r.replay_allocation for r in reqs]
        at = [a.starts[0] for a in allocs]
        out: list[list[torch.Tensor]] = [[] for _ in reqs]
        for n in itertools.cycle(slices):
            live = [i for i, a in enumerate(allocs) if at[i] < a.ends[0]]
            if not live:
                return [torch.cat(o) for o in out]
            parts = [(allocs[i], at[i], min(at[i] + n, allocs[i].ends[0])) for i in live]
            chunks = [reqs[i].tokens[lo:hi] for i, (_, lo, hi) in zip(live, parts)]
            plans = [self.cache.read_plan(reqs[i]) for i in live]
            logits = self.forward([reqs[i] for i in live], chunks, replay_step(parts), plans)
            for i, (_, _, hi), lg in zip(live, parts, logits):
                out[i].append(lg)
                at[i] = hi
        raise AssertionError("unreachable")  # pragma: no cover

    def serve_cold(self, prompt: list[int], chunk: int = 64) -> None:
        req = self.cache.admit(prompt)
        assert req.length == 0
        self.prefill(req, chunk)
        self.cache.finish(req)

    def admit_replayed(self, prompt: list[int]):
        m = self.cache.match_prefix(prompt[:-1])
        assert m.window is WindowSource.REPLAY, m
        req = self.cache.admit(prompt, m)
        assert req.approximate and req.replay_allocation is not None
        return req


def assert_exact(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    if not torch.equal(got, want):
        diff = (got - want).abs().amax(-1)
        bad = torch.nonzero(diff > 0).flatten()
        pytest.fail(f"{what}: differs at {len(bad)} rows from {int(bad[0])}, max {diff.max():.3e}")


def replayed_prompt(cached: int) -> list[int]:
    """Shares exactly ``cached`` tokens with ``TOKENS`` (then a tail that differs at once)."""
    tail = [t for t in TAIL if t != TOKENS[cached]]
    return TOKENS[:cached] + tail[:40]


# -- paged replay == oracle, float64, bit-exact ---------------------------------------------------

# (page, shared prefix): the cached length is the shared prefix rounded down to a page; around
# 128 / 256 / 512 (C128 groups and the window), mid C4 group (pages 1, 2), C128 open groups
CASES = [
    (1, 129),
    (1, 131),
    (2, 258),
    (4, 132),
    (4, 255),
    (4, 257),
    (8, 300),
    (16, 256),
    (16, 513),
    (64, 512),
    (64, 640),
]


@pytest.mark.parametrize("page,shared", CASES)
def test_replayed_hit_equals_oracle_and_differs_from_cold(page: int, shared: int) -> None:
    eng = Engine(CFG, page)
    eng.serve_cold(TOKENS[: shared + 20])
    eng.cache.evict(swa_tokens=10**6)  # every window tombstoned: only replay can reuse
    prompt = replayed_prompt(shared)
    req = eng.admit_replayed(prompt)
    prefix, start = req.match.prefix_len, req.match.replay_start
    assert prefix == shared // page * page and start == prefix - CFG.window
    replayed = eng.replay([req], (37,))[0]
    got = [eng.prefill(req, 23)]
    decoded = TAIL[40:43]
    for t in decoded:
        got += eng.step([req], [[t]])
    seq = prompt + decoded
    oracle = SegmentedReference(eng.weights)
    oracle.extend(seq[:prefix])
    assert_exact(replayed, oracle.replay(start), "the replay forward")
    assert_exact(torch.cat(got), oracle.extend(seq[prefix:]), "after the replay")
    assert_exact(torch.cat(got), replay_reference_logits(eng.weights, seq, prefix, start), "helper")
    cold = reference_logits(eng.weights, seq)[prefix:]
    assert float((torch.cat(got) - cold).abs().max()) > 1e-9, "replay is an approximation"
    eng.cache.finish(req)
    eng.cache.check_invariants()


@pytest.mark.parametrize("page", [1, 2, 4, 8])
def test_short_window_replay_equals_oracle(page: int) -> None:
    """window 16 with C4 + C16: the replayed window holds one or two whole C16 groups."""
    eng = Engine(SHORT, page)
    eng.serve_cold(TOKENS[:90], chunk=7)
    eng.cache.evict(swa_tokens=10**6)
    prompt = replayed_prompt(83)
    req = eng.admit_replayed(prompt)
    prefix, start = req.match.prefix_len, req.match.replay_start
    eng.replay([req], (1, 3, 5))
    got = eng.prefill(req, 5)
    want = replay_reference_logits(eng.weights, prompt, prefix, start)
    assert_exact(got, want, f"page {page}")
    eng.cache.finish(req)


def test_replay_slices_and_batches_are_exact() -> None:
    """The same replays run in one forward each, in slices of 1 / 7 / 50 tokens, and two
    requests sharing the prefix replayed in the same forwards: identical logits."""
    page, shared = 16, 300
    outs = []
    for slices, together in (((10**9,), False), ((1, 7, 50), False), ((7, 50), True)):
        eng = Engine(CFG, page)
        eng.serve_cold(TOKENS[:320])
        eng.cache.evict(swa_tokens=10**6)
        a = replayed_prompt(shared)
        b = TOKENS[:shared] + [t ^ 1 for t in a[shared:]]
        reqs = [eng.admit_replayed(a)]
        if together:
            reqs.append(eng.admit_replayed(b))
        eng.replay(reqs, slices)
        outs.append(eng.prefill(reqs[0], 40))
        if together:
            want = replay_reference_logits(eng.weights, b, 288, 160)
            assert_exact(eng.prefill(reqs[1], 40), want, "second request")
        for r in reqs:
            eng.cache.finish(r)
    assert_exact(outs[1], outs[0], "sliced")
    assert_exact(outs[2], outs[0], "batched")


def test_replay_writes_exactly_its_allocation() -> None:
    """The replay stores SWA at its own slots and ring rows at the allocation's rows only;
    compressed KV and indexer keys stay as cached; every other pool row is untouched."""
    page = 16
    eng = Engine(CFG, page)
    eng.serve_cold(TOKENS[:300])
    eng.cache.evict(swa_tokens=10**6)
    req = eng.admit_replayed(replayed_prompt(300))
    alloc = req.replay_allocation
    check_replay(alloc)
    before = {
        name: {i: t.clone() for i, t in enumerate(ts) if t is not None}
        for name, ts in _pools(eng.pools).items()
    }
    eng.replay([req])
    written = {"swa": set(alloc.swa_slots.tolist())}
    for s in alloc.streams:
        written[f"ring{s.ratio}"] = set(s.ring_rows.tolist())
        assert len(s.carry_rows) == len(s.entry_slots) == 0
    for name, layers in before.items():
        for i, old in layers.items():
            new = _pools(eng.pools)[name][i]
            changed = set(torch.nonzero((new != old).any(-1)).flatten().tolist())
            ratio = CFG.compress_ratios[i]
            allowed = written.get(name if name == "swa" else f"ring{ratio}", set())
            if name in ("compressed", "index_keys"):
                allowed = set()
            assert changed <= allowed, (name, i, sorted(changed - allowed)[:5])
            if name == "swa":
                assert changed, "the replay wrote the window"
    eng.cache.abort(req)


def _pools(pools: KVPools) -> dict[str, list[torch.Tensor | None]]:
    n = len(pools.swa)
    return {
        "swa": list(pools.swa),
        "compressed": [pools.compressed.get(i) for i in range(n)],
        "ring": [pools.ring.get(i) for i in range(n)],
        "index_keys": [pools.index_keys.get(i) for i in range(n)],
        "index_ring": [pools.index_ring.get(i) for i in range(n)],
    }


@pytest.mark.parametrize("page", [4, 64])
def test_graph_decode_after_replay_equals_oracle(page: int) -> None:
    """Decode through `GraphDecoder` (slots from raw batch state) after a replayed prefill,
    a replayed and an exact request in one batch."""
    eng = Engine(CFG, page)
    eng.serve_cold(TOKENS[:270])
    eng.cache.evict(swa_tokens=10**6)
    prompt = replayed_prompt(260)
    req = eng.admit_replayed(prompt)
    exact = eng.cache.admit(TOKENS[500:540])
    eng.replay([req])
    eng.prefill(req, 64)
    eng.prefill(exact, 64)
    dec = GraphDecoder(eng.weights, eng.pools, eng.cc, 2, eng.cc.full_capacity, None, 64)
    fed: list[int] = []
    got: list[torch.Tensor] = []
    got_exact: list[torch.Tensor] = []
    for k in range(6):
        toks = [TAIL[50 + k], TAIL[60 + k]]
        plan = eng.cache.extend_batch([req, exact], [[t] for t in toks])
        logits = dec.step([req, exact], toks, plan.deltas)
        got.append(logits[:1])
        got_exact.append(logits[1:])
        fed.append(toks[0])
    prefix, start = req.match.prefix_len, req.match.replay_start
    want = replay_reference_logits(eng.weights, prompt + fed, prefix, start)
    assert_exact(torch.cat(got), want[len(prompt) - prefix :], "graph decode after replay")
    ref = reference_logits(eng.weights, TOKENS[500:540] + [TAIL[60 + k] for k in range(6)])
    assert_exact(torch.cat(got_exact), ref[40:], "the exact request beside it")
    eng.cache.finish(req)
    eng.cache.finish(exact)


def test_lineage_reuse_of_a_replayed_branch_equals_the_forked_oracle() -> None:
    """A third request resumes (live window) inside the pages the replayed request inserted:
    it reads replay-derived state (flagged) and equals the oracle forked from that request."""
    page = 16
    eng = Engine(CFG, page)
    eng.serve_cold(TOKENS[:300])
    eng.cache.evict(swa_tokens=10**6)
    b = replayed_prompt(300) + TAIL[:200]
    rb = eng.admit_replayed(b)
    eng.replay([rb])
    eng.prefill(rb, 50)
    eng.cache.finish(rb)
    # the window before 432 lies in the request's own pages (its replayed ones never enter the
    # tree, and the cold pages before 288 are tombstoned)
    c = b[:432] + [t for t in TAIL[5:40] if t != b[432]]
    m = eng.cache.match_prefix(c[:-1])
    assert m.window is WindowSource.LIVE and m.prefix_len == 432 and m.approximate
    rc = eng.cache.admit(c, m)
    assert rc.approximate
    got = eng.prefill(rc, 9)
    oracle = SegmentedReference(eng.weights)
    oracle.extend(b[:288])
    oracle.replay(160)
    oracle.extend(b[288:])
    assert_exact(got, oracle.fork(432).extend(c[432:]), "reuse of a replayed branch")
    eng.cache.finish(rc)


def test_float32_replay_within_tolerance_of_the_fp64_oracle() -> None:
    eng = Engine(CFG, 16, dtype=torch.float32)
    eng.serve_cold(TOKENS[:300])
    eng.cache.evict(swa_tokens=10**6)
    prompt = replayed_prompt(300)
    req = eng.admit_replayed(prompt)
    eng.replay([req])
    got = eng.prefill(req, 64)
    want = replay_reference_logits(weights_for(CFG), prompt, 288, 160)
    assert float((got.double() - want).abs().max()) < 1e-3
    eng.cache.finish(req)


# -- the oracle itself ----------------------------------------------------------------------------


def test_oracle_without_replay_is_the_dense_reference() -> None:
    """Extensions of any size are `reference_logits` bit for bit; a fork continues exactly."""
    w = weights_for(SHORT)
    seq = TOKENS[:90]
    ref = reference_logits(w, seq)
    oracle = SegmentedReference(w)
    got = torch.cat([oracle.extend(seq[a:b]) for a, b in ((0, 5), (5, 6), (6, 40), (40, 90))])
    assert_exact(got, ref, "segments")
    assert_exact(oracle.fork(33).extend(seq[33:50]), ref[33:50], "fork")
    with pytest.raises(ValueError, match="outside"):
        oracle.replay(80, 95)
    with pytest.raises(ValueError, match="cannot fork"):
        oracle.fork(91)


def test_oracle_generate_matches_its_logits() -> None:
    w = weights_for(SHORT)
    prompt = TOKENS[:70]
    out = replay_reference_generate(w, prompt, 64, 48, 4)
    oracle = SegmentedReference(w)
    oracle.extend(prompt[:64])
    oracle.replay(48)
    logits = oracle.extend(prompt[64:])[-1]
    assert out[0] == int(logits.argmax())
    assert replay_reference_logits(w, prompt + out[:3], 64, 48)[-1].argmax() == out[3]


# -- bad plans ------------------------------------------------------------------------------------


def test_replay_step_rejects_what_is_not_a_replay() -> None:
    eng = Engine(SHORT, 4)
    eng.serve_cold(TOKENS[:60], chunk=7)
    eng.cache.evict(swa_tokens=10**6)
    req = eng.admit_replayed(replayed_prompt(56))
    alloc = req.replay_allocation
    lo, hi = alloc.starts[0], alloc.ends[0]
    with pytest.raises(ReplayPlanError, match="outside"):
        replay_step([(alloc, lo - 1, hi)])
    with pytest.raises(ReplayPlanError, match="outside"):
        replay_step([(alloc, lo, lo)])
    extend = eng.cache.extend(req, [1, 2, 3])
    with pytest.raises(ReplayPlanError, match="not a one-request replay"):
        check_replay(extend)
    eng.cache.abort(req)
    other = eng.cache.admit(TOKENS[600:630])
    completing = eng.cache.extend(other, TOKENS[600:630])
    forged = type(completing)(
        completing.request_ids, [0], [30], completing.evicted, True, lambda: completing.arrays
    )
    with pytest.raises(ReplayPlanError, match="must not carry rows or write"):
        check_replay(forged)
    eng.cache.abort(other)


def test_oracle_with_sharing_is_the_dense_reference() -> None:
    """The oracle's sharing (sources publish entries and selections, consumers read them) is
    `reference.DenseKeys`' bit for bit, over segments of any size."""
    w = weights_for(SHORT_SHARED)
    seq = TOKENS[:90]
    ref = reference_logits(w, seq)
    oracle = SegmentedReference(w)
    got = torch.cat([oracle.extend(seq[a:b]) for a, b in ((0, 3), (3, 21), (21, 64), (64, 90))])
    assert_exact(got, ref, "segments")
    assert_exact(oracle.fork(45).extend(seq[45:70]), ref[45:70], "fork")


@pytest.mark.parametrize("page", [1, 4, 8])
def test_replayed_hit_on_a_shared_model_equals_oracle(page: int) -> None:
    """Replay with V4.1 sharing: consumers read the sources' cached entries, the replay
    rebuilds every layer's window; the paged result is the oracle's and not a cold prefill."""
    eng = Engine(SHORT_SHARED, page)
    eng.serve_cold(TOKENS[:90], chunk=7)
    eng.cache.evict(swa_tokens=10**6)
    prompt = replayed_prompt(83)
    req = eng.admit_replayed(prompt)
    prefix, start = req.match.prefix_len, req.match.replay_start
    replayed = eng.replay([req], (1, 3, 5))[0]
    got = [eng.prefill(req, 5)]
    for t in TAIL[40:42]:
        got += eng.step([req], [[t]])
    seq = prompt + TAIL[40:42]
    oracle = SegmentedReference(eng.weights)
    oracle.extend(seq[:prefix])
    assert_exact(replayed, oracle.replay(start), "the replay forward")
    assert_exact(torch.cat(got), oracle.extend(seq[prefix:]), f"page {page}")
    cold = reference_logits(eng.weights, seq)[prefix:]
    assert float((torch.cat(got) - cold).abs().max()) > 1e-9, "replay is an approximation"
    eng.cache.finish(req)
    eng.cache.check_invariants()
