"""C2 layers (issue #17 item 2): V4.1's pairwise compression end to end, cached == reference.

A C2 layer compresses every pair of positions (no overlap) into one entry and attends, beside
its window, to the top-k entries its own indexer (over C2-compressed keys) selects; between
decode steps the KV source keeps the open pair's row in an in-flight ring shadowed off the SWA
page (docs/design.md, "C2"). In float64 every cached path must reproduce the dense reference
bit for bit: chunked prefill whose chunks split pairs, prefix reuse (a hit ending mid-pair at
page size 1, split nodes, tombstoned windows, eviction), the graph decode and the runner with
speculative drafts rolled back. A one-row shift of the carried pair row is caught.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest
import torch
from small_models import SMALL, fp64_reference, fp64_weights, one_thread
from test_model import TOKENS, Paged, assert_exact, schedule_ending_at

from adapters.engine.drafts import OracleDraft
from adapters.engine.runner import Runner
from adapters.engine.sampling import SamplingParams
from adapters.forward.graph_decode import GraphDecoder
from adapters.forward.paged import build_step, run_step
from adapters.memory.pools import KVPools
from adapters.model.model_config import PRESETS, ModelConfig, preset
from adapters.model.reference import reference_generate
from shadowradix import WindowSource

pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")

#: tiny-c2's layout (0, 0, 2, 4, 128, 2) shrunk: window 16, C128 -> C16 (span 15 <= 16)
C2 = preset("tiny-c2", **SMALL, window=16, compress_ratios=(0, 0, 2, 4, 16, 2))
#: V4.1-style sharing among C2 layers: layer 1 is the C2 KV + index source, 2 reads its KV and
#: its selection, 4 reads its KV and runs its own indexer over 1's keys
C2_SHARED = preset(
    "tiny", **SMALL, window=16, compress_ratios=(0, 2, 2, 4, 2, 16), kv_sources=(1, 3, 5),
    index_sources=(1, 3, 4),
)  # fmt: skip


_one_thread = pytest.fixture(autouse=True, scope="module")(one_thread)


weights = fp64_weights


ref = fp64_reference


@functools.cache
def ref_generate(cfg: ModelConfig, prompt: tuple[int, ...], n: int) -> list[int]:
    return reference_generate(weights(cfg), list(prompt), n)


# -- config, weights, pools --------------------------------------------------------------------


def test_preset_and_roles() -> None:
    """tiny-c2 mixes 0, 2, 4 and 128; C2 is sparse (its own indexer) and not overlapped; the
    cache gets a C2 stream with pairs for rings; selections are reused within one ratio."""
    m = PRESETS["tiny-c2"]
    assert m.compress_ratios == (0, 0, 2, 4, 128, 2) and m.ratios == (2, 4, 128)
    assert m.is_sparse(2) and m.is_sparse(4) and not m.is_sparse(128)
    assert not m.is_overlap(2) and m.is_overlap(4)
    cc = m.cache_config(page_size=64, full_capacity=1024, swa_capacity=512)
    assert cc.overlap_ratios == (4,) and cc.stream(2).ring_size == 2
    assert cc.stream(2).slots_per_page == 32
    s = C2_SHARED
    assert [s.kv_source_of(i) for i in (1, 2, 4)] == [1, 1, 1]
    assert [s.index_source_of(i) for i in (1, 2, 3, 4)] == [1, 1, 3, 4]
    with pytest.raises(ValueError, match="ratio 2 precedes"):  # no C2 index source before 2
        replace(C2_SHARED, index_sources=(3, 4))
    with pytest.raises(ValueError, match="sparse"):
        replace(C2, sparse_ratios=(3,))


def test_weights_and_pools_of_c2_layers() -> None:
    """A C2 layer's compressors pool pairs without overlap (one width of channels); its pools:
    ``page / 2`` entries a page, ``min(page, 2)`` fp64 ring rows an SWA page, for the KV and
    the indexer keys."""
    w = weights(C2)
    for i in (2, 5):
        layer = w.layers[i]
        assert layer.compressor is not None and layer.compressor.w_kv.shape[1] == C2.head_dim
        assert layer.compressor.ape.shape[0] == 2
        assert layer.indexer is not None and layer.indexer.compressor is not None
        assert layer.indexer.compressor.w_kv.shape[1] == C2.index_dim
    cc = C2.cache_config(page_size=8, full_capacity=256, swa_capacity=128)
    pools = KVPools(C2, cc, "cpu", torch.float64)
    for i in (2, 5):
        assert pools.compressed[i].shape == (256 // 2 + 1, C2.head_dim)
        assert pools.ring[i].shape == (128 // 8 * 2 + 1, 2 * C2.head_dim)
        assert pools.index_keys[i].shape == (256 // 2 + 1, C2.index_dim)
        assert pools.index_ring[i].shape == (128 // 8 * 2 + 1, 2 * C2.index_dim)


# -- paged == reference (float64, bit for bit) -------------------------------------------------


@pytest.mark.parametrize(
    "cfg,page,schedule",
    [
        (C2, 1, [5] * 60),
        (C2, 2, [5] * 60),
        (C2, 4, schedule_ending_at((1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 33, 127, 128, 129, 257))),
        (C2, 16, [37] * 10),
        (C2_SHARED, 8, [7] * 40),
    ],
)
def test_chunked_prefill_equals_reference(cfg: ModelConfig, page: int, schedule) -> None:
    """Odd chunks end mid-pair: the next chunk completes the pair from the ring row kept
    across the step boundary (page 1: across a page boundary too)."""
    prompt = TOKENS[:257]
    eng = Paged(cfg, page, max(schedule))
    req = eng.admit(prompt, reuse=False)
    assert_exact(eng.prefill(req, schedule), ref(cfg, tuple(prompt)), f"page {page}")
    eng.cache.finish(req)
    eng.cache.check_invariants()


@pytest.mark.parametrize("page,len_a,shared", [(1, 161, 151), (4, 130, 130), (16, 200, 167)])
def test_prefix_reuse_split_and_decode_equal_reference(page: int, len_a: int, shared: int) -> None:
    """b reuses a's cached prefix (at page 1 the hit ends mid-pair: b's first token completes
    a pair whose first row lives in a's cached page), c then hits inside b's branch (a node
    split), and both decode across pair boundaries: exactly the reference. a's early pages are
    tombstoned (the window passed them) and still serve their compressed entries."""
    a = TOKENS[:len_a]
    b = TOKENS[:shared] + TOKENS[300:331]
    c = b[: shared + 13] + TOKENS[400:409]
    eng = Paged(C2, page, max_chunk=32)
    ra = eng.admit(a, reuse=False)
    eng.prefill(ra, [29] * 20)
    eng.cache.finish(ra)
    st = eng.cache.stats()
    assert st.cached_window_tokens < st.cached_tokens  # a's early pages hold no window
    for prompt, decoded in ((b, TOKENS[500:503]), (c, TOKENS[503:507])):
        match = eng.cache.match_prefix(prompt[:-1])
        assert match.window is WindowSource.LIVE and match.prefix_len > 0
        req = eng.cache.admit(prompt, match)
        got = [eng.prefill(req, [11] * 20)]
        for t in decoded:
            got += eng.step([req], [[t]])
        want = ref(C2, tuple(prompt + decoded))[match.prefix_len :]
        assert_exact(torch.cat(got), want, f"prefix {match.prefix_len}")
        eng.cache.finish(req)
    assert page != 1 or shared % 2  # the page-1 case resumes mid-pair
    eng.cache.check_invariants()


def test_graph_decoder_equals_reference() -> None:
    """Graph decode (slots from raw batch state; eager on the CPU): each request's decode token
    completes a pair every other step, from the ring row the previous step stored."""
    prompts = [TOKENS[:30], TOKENS[:47], TOKENS[300:303]]
    eng = Paged(C2, 4, max_chunk=64, full_tokens=400)
    dec = GraphDecoder(eng.weights, eng.pools, eng.cc, 4, eng.cc.full_capacity, None, 64)
    reqs = [eng.admit(p, reuse=False) for p in prompts]
    got = [[eng.prefill(r, [64])] for r in reqs]
    fed: list[list[int]] = [[] for _ in prompts]
    for k in range(5):
        toks = [TOKENS[460 + 5 * i + k] for i in range(len(reqs))]
        plan = eng.cache.extend_batch(reqs, [[t] for t in toks])
        logits = dec.step(reqs, toks, plan.deltas)
        for i in range(len(reqs)):
            got[i].append(logits[i : i + 1])
            fed[i].append(toks[i])
    for i, p in enumerate(prompts):
        assert_exact(torch.cat(got[i]), ref(C2, tuple(p + fed[i])), f"request {i}")


def test_shifted_pair_row_is_detected() -> None:
    """Sensitivity: the carried pair row read one ring row off (the planted bug) changes the
    logits, so the comparisons above can fail."""
    prompt = TOKENS[:11]  # 6 entries at 12: all selected (top-8), so every entry is read
    eng = Paged(C2, 4, max_chunk=8)
    req = eng.admit(prompt, reuse=False)
    eng.prefill(req, [7])  # position 11 completes the pair (10, 11)
    alloc = eng.cache.extend_batch([req], [[TOKENS[11]]])
    s = next(s for s in alloc.arrays.streams if s.ratio == 2)
    assert len(s.carry_rows) == 1 and len(s.entry_slots) == 1
    pools = eng.pools
    for layer in (2, 5):  # what the carried row would read if the ring were shifted by one
        row = int(s.carry_rows[0])
        pools.ring[layer][row] = pools.ring[layer][row ^ 1]
    plans = [eng.cache.read_plan(req, start=alloc.starts[0])]
    step = build_step(C2, alloc, plans, np.array([TOKENS[11]]), "cpu")
    got = run_step(eng.weights, pools, step, None)
    want = ref(C2, tuple(TOKENS[:12]))[11:]
    assert float((got - want).abs().max()) > 1e-6


# -- runner -------------------------------------------------------------------------------------


def prompts(seed: int, n: int = 4) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 256, 37).tolist()  # odd: hits end mid-pair at page 1
    return [system + rng.integers(0, 256, int(k)).tolist() for k in rng.integers(1, 30, n)]


def make_runner(page: int, full: int = 320, swa: int = 96, **kw) -> Runner:
    cc = C2.cache_config(
        page_size=page, full_capacity=full, swa_capacity=swa, debug=True,
        speculative="speculative_tokens" in kw,
    )  # fmt: skip
    return Runner(
        C2, cc, device="cpu", dtype=torch.float64, weights=weights(C2), chunk_tokens=13,
        max_running=3, **kw,
    )  # fmt: skip


@pytest.mark.parametrize(
    "page,kw",
    [
        (1, {}),
        (4, dict(graph_decode=True)),
        (8, dict(full=96)),  # a tight full pool: cached prefixes are evicted
        (4, dict(speculative_tokens=2, accept=0.5)),
        (2, dict(speculative_tokens=2, accept=0.0)),  # every draft rolled back
    ],
)
def test_runner_greedy_equals_reference(page: int, kw: dict) -> None:
    """Continuous batching with a shared system prompt (prefix hits), chunked prefill, batched
    decode; with speculation (k = 2: C2's doubled ring bounds drafts to 3 tokens) drafts are
    verified and rolled back. Every output is the dense reference's greedy continuation."""
    ps = prompts(page)
    kw = dict(kw)
    accept = kw.pop("accept", None)
    if accept is not None:
        table = {tuple(p): ref_generate(C2, tuple(p), 10) for p in ps}
        kw["draft"] = OracleDraft(table, accept, seed=page)
    runner = make_runner(page, **kw)
    results = runner.generate(ps[:1], SamplingParams(max_new_tokens=10))
    results += runner.generate(ps[1:], SamplingParams(max_new_tokens=10))
    for p, r in zip(ps, results):
        assert r.output == ref_generate(C2, tuple(p), 10)
        assert not r.approximate
    stats = runner.cache.stats()
    assert stats.hit_tokens > 0
    if "full" in kw:
        assert stats.evicted.full_pages > 0
    runner.cache.check_invariants()


def test_speculation_beyond_the_c2_ring_is_refused() -> None:
    """k + 1 verified tokens must fit C2's doubled ring (4 rows, one still open): k = 3 is
    refused with a typed error naming the bound."""
    with pytest.raises(ValueError, match="max_draft_len=3"):
        make_runner(4, speculative_tokens=3)
