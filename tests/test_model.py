"""The paged forward (adapters/forward/paged.py) driven directly through a `ShadowRadixCache`
equals the
dense no-cache reference forward (adapters/model/reference.py).

In float64 on the CPU both forwards perform the same arithmetic in the same order, so the logits
must be *bit-identical* (``torch.equal``): any wrong slot, stale ring row, mis-padded overlap or
wrong window shows up as a nonzero difference. In float32 the two differ only by reduction order;
we assert ``max |paged - reference| < FLOAT32_TOL = 1e-3`` (observed: ~3e-6 on logits of
magnitude ~5).

Also unit checks of the position-local maths in adapters/model/ops.py, and a sensitivity check
proving
that corrupting a single pool slot is detected by the comparison.
"""

from __future__ import annotations

import functools
import itertools
import warnings

import numpy as np
import pytest
import torch
from small_models import CFG, SHORT, SMALL

from adapters.forward.graph_decode import GraphDecoder
from adapters.forward.paged import build_step, run_step
from adapters.memory.pools import KVPools
from adapters.model import ops
from adapters.model.model_config import preset
from adapters.model.reference import reference_logits
from adapters.model.weights import init_weights
from shadowradix import CacheConfig, ShadowRadixCache, WindowSource


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matrices: intra-op threads only add synchronisation (and make timings collapse when
    the machine is shared)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# torch warns once about wrapping read-only NumPy arrays (the cache's slot arrays); harmless.
pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")

FLOAT32_TOL = 1e-3

#: window 128, ratios (0, 0, 4, 128, 4, 128): the real V4 attention structure, shrunk.
#: a short window for short sequences: C4 (overlapped, sparse) and C16 (dense); span 15 <= 16.

N_TOKENS = 530
TOKENS: list[int] = np.random.default_rng(1234).integers(0, 256, N_TOKENS).tolist()
#: every length the brief names: chunk ends / prompt ends land right on and around them
CRITICAL = (3, 4, 5, 7, 8, 9, 127, 128, 129, 255, 256, 257, 511, 512, 513)


@functools.cache
def weights_for(cfg, dtype):
    return init_weights(cfg, "cpu", dtype)


@functools.cache
def ref_logits(cfg, dtype, tokens: tuple[int, ...]) -> torch.Tensor:
    return reference_logits(weights_for(cfg, dtype), list(tokens))


def ceil_to(x: int, p: int) -> int:
    return -(-x // p) * p


class Paged:
    """Minimal engine: a cache, its pools, and `extend -> read_plan(start) -> build_step ->
    run_step` per step, returning the logits of every new token of every request."""

    def __init__(
        self, cfg, page: int, max_chunk: int, dtype=torch.float64, full_tokens=1200, swa_tokens=None
    ) -> None:
        self.cfg, self.dtype = cfg, dtype
        self.weights = weights_for(cfg, dtype)
        # a request holds up to window + 2 chunks of SWA at the peak of an extend
        swa = swa_tokens or ceil_to(cfg.window + 2 * max_chunk + 3 * page, page) * 3
        self.cc = cfg.cache_config(
            page_size=page,
            full_capacity=ceil_to(full_tokens, page),
            swa_capacity=swa,
            debug=True,
        )
        self.cache = ShadowRadixCache(self.cc)
        self.pools = KVPools(cfg, self.cc, "cpu", dtype)

    def admit(self, prompt: list[int], reuse: bool = True):
        """``reuse``: resume after the longest cached prefix of ``prompt[:-1]``; otherwise the
        caller expects no hit (fresh cache / unrelated prompt) and it is asserted."""
        if reuse and len(prompt) > 1:
            return self.cache.admit(prompt, self.cache.match_prefix(prompt[:-1]))
        req = self.cache.admit(prompt)
        assert req.length == 0
        return req

    def step(self, reqs, chunks: list[list[int]]) -> list[torch.Tensor]:
        alloc = self.cache.extend_batch(reqs, chunks)
        plans = [self.cache.read_plan(r, start=s) for r, s in zip(reqs, alloc.starts)]
        flat = np.fromiter(itertools.chain.from_iterable(chunks), np.int64)
        st = build_step(self.cfg, alloc, plans, flat, "cpu")
        logits = run_step(self.weights, self.pools, st, None)
        return list(torch.split(logits, [len(c) for c in chunks]))

    def prefill(self, req, schedule: list[int]) -> torch.Tensor:
        """Extends the request's remaining prompt by chunks of the given sizes (the last chunk
        takes whatever is left); returns logits of every extended position."""
        out = []
        sizes = iter(schedule)
        while len(req.prompt_remaining):
            n = next(sizes, len(req.prompt_remaining))
            out += self.step([req], [req.prompt_remaining[:n].tolist()])
        return torch.cat(out)


def schedule_ending_at(ends: tuple[int, ...]) -> list[int]:
    """Chunk sizes whose cumulative ends are exactly ``ends``."""
    return [b - a for a, b in zip((0,) + ends[:-1], ends)]


SCHEDULES = {
    "odd37": [37] * 20,
    "chunk100": [100] * 10,
    # chunk ends exactly at every critical length: many 1- and 2-token extends (the decode fast
    # path) right at page / group / window boundaries
    "critical": schedule_ending_at(CRITICAL),
    # odd, mixed sizes that keep shifting the phase against pages and groups
    "mixed": [1, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71],
}


#: fp64 rounding a CPU's BLAS may add: MKL picks shape-dependent code paths on some CPUs (AMD
#: EPYC: one row of a 128-row chunk off by 3.6e-12 against the same row of a 257-row pass; no
#: MKL_CBWR setting makes both that and the CP tests exact). A cache error moves logits by
#: orders of magnitude more; within this bound the test passes with a warning.
ULP_SLACK = 1e-11


def assert_exact(paged: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    """``paged == ref`` bit for bit (the CI machine's result), or within `ULP_SLACK` of the
    logits' scale with a warning naming the difference."""
    assert paged.shape == ref.shape, (paged.shape, ref.shape)
    if not torch.equal(paged, ref):
        diff = (paged - ref).abs()
        bad = torch.nonzero(diff.amax(-1) > 0).flatten()
        if float(diff.max()) <= ULP_SLACK * max(1.0, float(ref.abs().max())):
            warnings.warn(f"{what}: not bit-exact on this CPU's BLAS: {len(bad)} rows, max "
                          f"|diff| {float(diff.max()):.1e}", stacklevel=2)  # fmt: skip
            return
        pytest.fail(
            f"{what}: paged != reference at {len(bad)} rows, first row {int(bad[0])}, "
            f"max |diff| {float(diff.max()):.3e}"
        )


# -- paged == reference, float64, bit-exact ------------------------------------------------------


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("page", [1, 4, 16, 64])
def test_chunked_prefill_matches_reference_exactly(page: int, schedule: str) -> None:
    """Every position of a 520-token prompt (query positions cross all critical lengths), with
    chunks ending at odd places, equals the reference bit for bit."""
    prompt = TOKENS[:520]
    sched = SCHEDULES[schedule]
    eng = Paged(CFG, page, max(sched))
    req = eng.admit(prompt, reuse=False)
    got = eng.prefill(req, sched)
    assert_exact(got, ref_logits(CFG, torch.float64, tuple(prompt)), f"page {page} {schedule}")
    eng.cache.finish(req)
    eng.cache.check_invariants()


def test_a_read_plan_that_misses_a_query_window_is_refused() -> None:
    """`build_step` needs ``read_plan(start=)`` of the chunk's first token: the default plan (the
    window of the request's end) misses the early queries' windows, and that is a bug the step
    builder names instead of reading some other request's keys."""
    eng = Paged(CFG, 4, 300)
    prompt = TOKENS[:300]
    req = eng.admit(prompt, reuse=False)
    alloc = eng.cache.extend_batch([req], [prompt])
    flat = np.asarray(prompt, np.int64)
    with pytest.raises(RuntimeError, match="does not cover"):
        build_step(CFG, alloc, [eng.cache.read_plan(req)], flat, "cpu")
    step = build_step(CFG, alloc, [eng.cache.read_plan(req, start=0)], flat, "cpu")
    assert step.window_slots.shape == (300, CFG.window)
    # token t's last window column is its own slot; masked columns (before position 0) are off
    assert torch.equal(step.window_slots[:, -1], step.swa_slots)
    assert not step.window_mask[0, :-1].any() and step.window_mask[-1].all()


@pytest.mark.parametrize("length", CRITICAL)
@pytest.mark.parametrize("page", [4, 64])
def test_prompt_length_then_decode_matches_reference(page: int, length: int) -> None:
    """A prompt of exactly a critical length (one chunk, published by cache_unfinished as the
    runner does), then 3 decode steps crossing the next boundaries."""
    seq = TOKENS[: length + 3]
    eng = Paged(CFG, page, max_chunk=length)
    req = eng.admit(seq[:length], reuse=False)
    got = [eng.prefill(req, [length])]
    eng.cache.cache_unfinished(req)
    for t in seq[length:]:
        got += eng.step([req], [[t]])
    assert_exact(torch.cat(got), ref_logits(CFG, torch.float64, tuple(seq)), f"L={length}")
    eng.cache.finish(req)
    assert eng.cache.stats().num_requests == 0


@pytest.mark.parametrize(
    "page,len_a,shared,finish_first",
    [
        (4, 129, 129, True),  # b extends a (multi-turn)
        (16, 265, 260, True),  # b diverges from a inside a's last page
        (16, 200, 200, False),  # a still running (published by cache_unfinished)
        (64, 300, 300, True),
        (1, 131, 130, False),
    ],
)
def test_prefix_reuse_matches_reference(
    page: int, len_a: int, shared: int, finish_first: bool
) -> None:
    """A second request reusing the first one's cached prefix (compressed entries from the tree,
    window and in-flight ring rows from the shadows) still equals recomputation exactly.

    Only boundaries whose preceding window is still live can be resumed from; the window a
    request keeps is the one before its last page boundary, so ``b`` shares ``a`` up to (at
    least) that boundary."""
    a = TOKENS[:len_a]
    b = TOKENS[:shared] + TOKENS[400:461]  # diverges after `shared` tokens
    eng = Paged(CFG, page, max_chunk=64)
    ra = eng.admit(a, reuse=False)
    eng.prefill(ra, [37] * 20)
    eng.cache.cache_unfinished(ra)
    if finish_first:
        for t in TOKENS[470:473]:  # a decodes a little; its window moves on
            eng.step([ra], [[t]])
        eng.cache.finish(ra)
    match = eng.cache.match_prefix(b[:-1])
    assert match.prefix_len == min(shared, len_a) // page * page
    assert match.window is WindowSource.LIVE and match.hit_len == match.prefix_len
    rb = eng.cache.admit(b, match)
    assert rb.length == match.prefix_len
    got = [eng.prefill(rb, [23] * 20)]
    for t in TOKENS[500:503]:  # decode continues after the prefix hit
        got += eng.step([rb], [[t]])
    ref = ref_logits(CFG, torch.float64, tuple(b + TOKENS[500:503]))
    assert_exact(torch.cat(got), ref[match.prefix_len :], "prefix reuse")
    if not finish_first:
        eng.cache.finish(ra)
    eng.cache.finish(rb)
    assert eng.cache.stats().hit_tokens == match.prefix_len
    eng.cache.check_invariants()


@pytest.mark.parametrize("page,shared", [(4, 129), (16, 200), (64, 300)])
def test_publishing_every_chunk_allows_mid_prompt_reuse(page: int, shared: int) -> None:
    """As the runner does: ``cache_unfinished`` after every prefill chunk puts each chunk's pages
    into the tree with their live SWA, so a request branching mid-prompt resumes at the deepest
    page boundary before the branch, and still equals recomputation exactly."""
    a = TOKENS[:320]
    b = TOKENS[:shared] + TOKENS[400:450]
    eng = Paged(CFG, page, max_chunk=64)
    ra = eng.admit(a, reuse=False)
    for chunk in (37, 64, 64, 64, 64, 27):
        eng.step([ra], [ra.prompt_remaining[:chunk].tolist()])
        eng.cache.cache_unfinished(ra)
    assert ra.length == 320
    match = eng.cache.match_prefix(b[:-1])
    assert match.prefix_len == shared // page * page and match.window is WindowSource.LIVE
    rb = eng.cache.admit(b, match)
    got = eng.prefill(rb, [41] * 5)
    assert_exact(got, ref_logits(CFG, torch.float64, tuple(b))[match.prefix_len :], "mid-prompt")
    eng.cache.finish(ra)
    eng.cache.finish(rb)
    eng.cache.check_invariants()


def test_prefix_without_live_window_is_not_reused() -> None:
    """Without publishing each chunk, the mid-prompt windows of a chunked prefill are released
    (private pages), so a request sharing only the first 129 tokens of a 320-token request cannot
    resume (cached_len > 0, prefix_len 0) and must be recomputed, still exactly."""
    a, b = TOKENS[:320], TOKENS[:129] + TOKENS[400:440]
    eng = Paged(CFG, 4, max_chunk=64)
    ra = eng.admit(a, reuse=False)
    eng.prefill(ra, [64] * 5)
    eng.cache.finish(ra)
    match = eng.cache.match_prefix(b[:-1])
    assert match.cached_len == 128 and match.prefix_len == 0
    rb = eng.cache.admit(b, match)
    assert_exact(eng.prefill(rb, [50] * 4), ref_logits(CFG, torch.float64, tuple(b)))
    eng.cache.finish(rb)


@pytest.mark.parametrize("page", [4, 16])
def test_batched_requests_in_one_step_match_reference(page: int) -> None:
    """Several requests share every step: mixed prefill chunks of different sizes (one request
    finishing its prompt while others continue), then batched single-token decode."""
    prompts = [TOKENS[0:5], TOKENS[5:135], TOKENS[135:395], TOKENS[10:139]]
    eng = Paged(CFG, page, max_chunk=80, full_tokens=1600)
    reqs = [eng.admit(p, reuse=False) for p in prompts]
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    sizes = [3, 41, 80, 17]
    while any(len(r.prompt_remaining) for r in reqs):
        live = [i for i, r in enumerate(reqs) if len(r.prompt_remaining)]
        chunks = [reqs[i].prompt_remaining[: sizes[i]].tolist() for i in live]
        for i, lg in zip(live, eng.step([reqs[i] for i in live], chunks)):
            got[i].append(lg)
    extra = [TOKENS[450 + 7 * i : 450 + 7 * i + 6] for i in range(len(prompts))]
    for k in range(6):
        outs = eng.step(reqs, [[extra[i][k]] for i in range(len(reqs))])
        for i, lg in enumerate(outs):
            got[i].append(lg)
    for i, p in enumerate(prompts):
        ref = ref_logits(CFG, torch.float64, tuple(p + extra[i]))
        assert_exact(torch.cat(got[i]), ref, f"request {i}")
    for r in reqs:
        eng.cache.finish(r)
    eng.cache.check_invariants()


@pytest.mark.parametrize("page", [1, 2, 4, 8, 16])
def test_short_window_config_matches_reference(page: int) -> None:
    """window 16 with C4 + C16: windows and groups roll over many times in a short prompt;
    prefix reuse from a finished request included."""
    a = TOKENS[:90]
    b = a + TOKENS[200:240]  # a follow-up turn: shares all of a
    eng = Paged(SHORT, page, max_chunk=7)
    ra = eng.admit(a, reuse=False)
    assert_exact(eng.prefill(ra, [1, 3, 5, 7] * 30), ref_logits(SHORT, torch.float64, tuple(a)))
    eng.cache.finish(ra)
    rb = eng.admit(b)
    start = rb.length
    assert start == 90 // page * page
    got = eng.prefill(rb, [5, 7] * 20)
    assert_exact(got, ref_logits(SHORT, torch.float64, tuple(b))[start:], "short-window reuse")
    eng.cache.finish(rb)
    eng.cache.check_invariants()


@pytest.mark.parametrize("page", [1, 4, 16, 64])
def test_graph_decoder_matches_reference_exactly(page: int) -> None:
    """`GraphDecoder` (decode slots computed from raw batch state, eager on the CPU) after a
    paged prefill: a batch of requests decoding across the 4/8, 128 and 256 boundaries, with
    requests joining and leaving the batch (buffer rows re-uploaded), equals the reference."""
    prompts = [TOKENS[:125], TOKENS[:254], TOKENS[300:303], TOKENS[100:160]]
    eng = Paged(CFG, page, max_chunk=100, full_tokens=1600)
    dec = GraphDecoder(
        eng.weights,
        eng.pools,
        eng.cc,
        max_batch=4,
        max_context=eng.cc.full_capacity,
        min_context_bucket=64,
    )
    reqs = [eng.admit(p, reuse=False) for p in prompts]
    got: list[list[torch.Tensor]] = [[eng.prefill(r, [100] * 3)] for r in reqs]
    fed: list[list[int]] = [[] for _ in prompts]
    for k in range(7):
        live = [0, 1, 2] if k < 4 else [1, 3, 2]  # request 0 leaves, 3 joins in another row
        toks = [TOKENS[460 + 5 * i + k] for i in live]
        batch = [reqs[i] for i in live]
        plan = eng.cache.extend_batch(batch, [[t] for t in toks])
        logits = dec.step(batch, toks, plan.deltas)
        for j, i in enumerate(live):
            got[i].append(logits[j : j + 1])
            fed[i].append(toks[j])
    for i, p in enumerate(prompts):
        ref = ref_logits(CFG, torch.float64, tuple(p + fed[i]))
        assert_exact(torch.cat(got[i]), ref, f"request {i}")
    for r in reqs:
        eng.cache.finish(r)
    eng.cache.check_invariants()


# -- float32 --------------------------------------------------------------------------------------


def test_float32_within_tolerance() -> None:
    """fp32: the paged forward is within FLOAT32_TOL of the fp32 reference (and of the fp64
    reference); it is not required to be bit-exact."""
    prompt = TOKENS[:520]
    eng = Paged(CFG, 16, max_chunk=37, dtype=torch.float32)
    req = eng.admit(prompt, reuse=False)
    got = eng.prefill(req, [37] * 20)
    ref32 = ref_logits(CFG, torch.float32, tuple(prompt))
    ref64 = ref_logits(CFG, torch.float64, tuple(prompt))
    assert got.dtype == torch.float32
    assert float((got - ref32).abs().max()) < FLOAT32_TOL
    assert float((got.double() - ref64).abs().max()) < FLOAT32_TOL
    # the logits are far from trivial (the tolerance is meaningful relative to their scale)
    assert float(ref64.abs().max()) > 100 * FLOAT32_TOL
    eng.cache.finish(req)


# -- the comparison is sensitive: a single corrupted slot is detected -----------------------------

CORRUPTIONS = ["swa_window_slot", "dense_c128_entry", "dense_c128_ring_row", "c4_entries"]


@pytest.mark.parametrize("what", CORRUPTIONS + ["none"])
def test_corrupted_slot_changes_decode_logits(what: str) -> None:
    """After a 255-token prefill, the decode at position 255 reads the window, the C128 entry 0
    and (completing group 1) the C128 in-flight rows 128..254. Corrupting one of them must
    make the paged logits differ from the reference; leaving them alone must not."""
    length, page = 255, 16
    seq = TOKENS[: length + 1]
    eng = Paged(CFG, page, max_chunk=100)
    req = eng.admit(seq[:length], reuse=False)
    eng.prefill(req, [100, 100])
    plan = eng.cache.read_plan(req)
    pools = eng.pools
    if what == "swa_window_slot":
        assert plan.swa_positions[-1] == length - 1
        pools.swa[0][int(plan.swa_slots[-1])] += 1.0
    elif what == "dense_c128_entry":
        slots = plan.stream(128).entry_slots
        assert len(slots) == 1
        pools.compressed[3][int(slots[0])] += 1.0
    elif what == "dense_c128_ring_row":
        s = plan.stream(128)
        assert s.inflight_positions[0] == 128
        pools.ring[3][int(s.inflight_rows[0])] += 1.0
    elif what == "c4_entries":
        slots = torch.as_tensor(plan.stream(4).entry_slots)
        assert len(slots) == length // 4
        pools.compressed[2][slots] += 1.0
    logits = eng.step([req], [[seq[length]]])[0]
    ref = ref_logits(CFG, torch.float64, tuple(seq))[length:]
    if what == "none":
        assert torch.equal(logits, ref)
    else:
        assert float((logits - ref).abs().max()) > 1e-6, f"corrupting {what} went unnoticed"
    eng.cache.finish(req)


# -- ops ------------------------------------------------------------------------------------------


def _brute_topk(row: list[float], k: int) -> list[int]:
    return sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_topk_lowest_index_breaks_ties_by_lowest_index(dtype) -> None:
    """fp64 goes through a stable sort, other dtypes through packed (score bits, index) keys:
    both must pick the same entries, ties resolved by the lowest index."""
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 0.0, 0.0]], dtype=dtype)
    _, idx = ops.topk_lowest_index(scores, 4)
    assert idx.tolist() == [[1, 2, 4, 0]]
    _, idx = ops.topk_lowest_index(scores, 6)
    assert idx.tolist() == [[1, 2, 4, 0, 3, 5]]
    # all zero (ReLU scores often are): the first k indices
    vals, idx = ops.topk_lowest_index(torch.zeros(2, 9, dtype=dtype), 3)
    assert idx.tolist() == [[0, 1, 2]] * 2 and vals.tolist() == [[0.0] * 3] * 2
    # -0.0 ties with +0.0
    _, idx = ops.topk_lowest_index(torch.tensor([[-0.0, 0.0, -0.0, 0.0]], dtype=dtype), 3)
    assert idx.tolist() == [[0, 1, 2]]
    # -inf (masked) entries come last, ties among them by index too; negatives order correctly
    inf = float("-inf")
    row = torch.tensor([[inf, 0.0, inf, 0.0, -2.5, -1.0, 7.0]], dtype=dtype)
    vals, idx = ops.topk_lowest_index(row, 7)
    assert idx.tolist() == [[6, 1, 3, 5, 4, 0, 2]]
    assert vals.dtype == dtype and torch.equal(vals, row[:, idx[0]])
    assert torch.isfinite(vals).tolist() == [[True] * 5 + [False] * 2]
    # many random rows with heavy ties (and signs), against a brute-force ordering; longer
    # than torch's small-sort cutoff, so a non-stable sort would show
    g = torch.Generator().manual_seed(0)
    s = (torch.randint(-3, 4, (64, 300), generator=g) * 0.5).to(dtype)
    for k in (1, 7, 300):
        _, idx = ops.topk_lowest_index(s, k)
        for r, got in zip(s.double().tolist(), idx.tolist()):
            assert got == _brute_topk(r, k)


def test_rope_inverse_undoes_rope_and_is_a_relative_rotation() -> None:
    g = torch.Generator().manual_seed(1)
    n, h, d, rd = 50, 3, 32, 8
    x = torch.randn(n, h, d, generator=g, dtype=torch.float64)
    pos = torch.randint(0, 100_000, (n,), generator=g)
    y = ops.rope(x, pos, rd, 10_000.0)
    back = ops.rope(y, pos, rd, 10_000.0, inverse=True)
    torch.testing.assert_close(back, x, rtol=0, atol=1e-9)
    assert torch.equal(y[..., :-rd], x[..., :-rd])  # only the last rope_dim channels rotate
    assert not torch.allclose(y[..., -rd:], x[..., -rd:])
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))  # a rotation
    assert torch.equal(ops.rope(x, torch.zeros(n, dtype=torch.long), rd, 1e4), x)
    # q(m) . k(n) depends only on m - n
    q, k = x[:1, 0], x[1:2, 0]
    dots = [
        float(
            ops.rope(q, torch.tensor([m + 5]), rd, 1e4) @ ops.rope(k, torch.tensor([m]), rd, 1e4).T
        )
        for m in (0, 17, 1000)
    ]
    assert max(dots) - min(dots) < 1e-9


@pytest.mark.parametrize("iters", [12, 60])
def test_sinkhorn_is_doubly_stochastic(iters: int) -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(20, 4, 4, generator=g, dtype=torch.float64)
    m = ops.sinkhorn(logits, iters)
    assert bool((m >= 0).all())
    # the last normalisation is over columns: exact; rows converge geometrically
    torch.testing.assert_close(m.sum(-2), torch.ones(20, 4, dtype=torch.float64))
    row_tol = 1e-3 if iters == 12 else 1e-9
    assert float((m.sum(-1) - 1).abs().max()) < row_tol
    # invariant to a constant shift of the logits (it subtracts the max)
    torch.testing.assert_close(ops.sinkhorn(logits + 50.0, iters), m)


def _naive_pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """(R, dim) rows -> (dim,) per-channel softmax over the rows."""
    return (torch.softmax(score, dim=0) * kv).sum(0)


def test_pool_groups_overlap_pads_group_minus_one() -> None:
    """With the overlap, group 0's previous group is padding (kv 0, score -inf): its entry equals
    pooling its own rows' second-half channels only; group g > 0 mixes the previous group's
    first-half channels with its own second-half channels."""
    g = torch.Generator().manual_seed(3)
    r, dim = 4, 6
    width = 2 * dim  # overlap doubles the kv (and score) channels
    rows = torch.randn(3 * r, 2 * width, generator=g, dtype=torch.float64)  # 3 groups
    kv, score = rows[:, :width], rows[:, width:]
    pad = torch.zeros(r, 2 * width, dtype=torch.float64)
    pad[:, width:] = float("-inf")
    grouped = torch.stack(
        [
            torch.cat((pad if i == 0 else rows[(i - 1) * r : i * r], rows[i * r : (i + 1) * r]))
            for i in range(3)
        ]
    )  # (3, 2r, 2*width)
    got = ops.pool_groups(grouped, overlap=True, ratio=r)
    assert got.shape == (3, dim)
    own = slice(0, r)
    # entry 0: only its own group, second-half channels
    torch.testing.assert_close(
        got[0], _naive_pool(kv[own, dim:], score[own, dim:]), rtol=0, atol=1e-12
    )
    # ... which is also the non-overlapped pooling of those channels
    no_overlap = torch.cat((kv[own, dim:], score[own, dim:]), dim=-1)[None]
    torch.testing.assert_close(got[0], ops.pool_groups(no_overlap, False, r)[0], rtol=0, atol=0)
    for i in (1, 2):
        prev, cur = slice((i - 1) * r, i * r), slice(i * r, (i + 1) * r)
        want = _naive_pool(
            torch.cat((kv[prev, :dim], kv[cur, dim:])),
            torch.cat((score[prev, :dim], score[cur, dim:])),
        )
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-12)
        # and it genuinely differs from pooling the own group only
        assert not torch.allclose(got[i], _naive_pool(kv[cur, dim:], score[cur, dim:]))
    # no overlap: plain per-channel softmax over the group
    plain = torch.randn(2, r, 2 * dim, generator=g, dtype=torch.float64)
    torch.testing.assert_close(
        ops.pool_groups(plain, False, r)[1],
        _naive_pool(plain[1, :, :dim], plain[1, :, dim:]),
        rtol=0,
        atol=1e-12,
    )


def test_cache_config_rejects_window_shorter_than_span() -> None:
    """The short-window model used here is only valid because span(16) = 15 <= window 16."""
    from shadowradix import ConfigError

    with pytest.raises(ConfigError):
        preset("tiny", **SMALL, window=8, compress_ratios=(0, 4, 16, 4)).cache_config(
            page_size=4, full_capacity=64, swa_capacity=64
        )
    assert isinstance(
        SHORT.cache_config(page_size=4, full_capacity=64, swa_capacity=64), CacheConfig
    )
