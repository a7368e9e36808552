"""V4.1 cross-layer sharing (docs/sharing.md): `ModelConfig(kv_sources=, index_sources=)`.

The dense reference spells the sharing out (a KV-source layer publishes its entries and indexer
keys, consumers read them; an index source publishes its top-k, other C4 layers reuse it), with
no pool in sight. Every cached path must reproduce it bit for bit in float64: the paged forward
(chunked prefill, prefix reuse, decode), the graph decode and the runner (paged decode, graph
decode, HiSparse). Pools and weights exist only where the sharing says a layer computes.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from small_models import fp64_reference, fp64_weights, one_thread
from test_model import SMALL, TOKENS, Paged, assert_exact, schedule_ending_at

from adapters.engine.runner import Runner
from adapters.engine.sampling import SamplingParams
from adapters.forward.graph_decode import GraphDecoder
from adapters.memory.pools import KVPools, bytes_per_token
from adapters.model.model_config import PRESETS, ModelConfig, preset
from adapters.model.reference import reference_generate
from shadowradix import WindowSource

pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")

#: tiny-shared shrunk: (0, 4, 128, 4, 128, 4, 0, 4), sources (1, 2), index sources (1, 5)
SHARED = preset("tiny-shared", **SMALL)
#: two C4 KV sources (1 and 3), each read by the next layer; 4 reuses 3's selection
TWO_SOURCES = preset(
    "tiny", **SMALL, compress_ratios=(0, 4, 4, 4, 4, 128), kv_sources=(1, 3, 5),
    index_sources=(1, 2, 3),
)  # fmt: skip
#: window 16 for runner tests (short prompts cross many windows and groups)
SHORT_SHARED = preset(
    "tiny-shared",
    **{**SMALL, "index_topk": 4},
    window=16,
    compress_ratios=(0, 4, 16, 4, 16, 4, 0, 4),
)


_one_thread = pytest.fixture(autouse=True, scope="module")(one_thread)


weights = fp64_weights


ref = fp64_reference


# -- config ---------------------------------------------------------------------------------------

BAD = {
    "swa_layer_as_kv_source": dict(kv_sources=(0, 2, 3)),
    "out_of_range": dict(kv_sources=(2, 3, 9)),
    "not_increasing": dict(kv_sources=(3, 2)),
    "duplicate": dict(kv_sources=(2, 2, 3)),
    "a_list": dict(kv_sources=[2, 3]),
    "bool_layer": dict(kv_sources=(True, 2, 3)),
    "c128_consumer_without_source": dict(kv_sources=(2,)),
    "c4_consumer_before_its_source": dict(kv_sources=(3, 4)),
    "index_source_not_c4": dict(index_sources=(2, 3)),
    "c4_reuser_without_index_source": dict(index_sources=(4,)),
    "c4_kv_source_not_index_source": dict(kv_sources=(2, 3, 4), index_sources=(2,)),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_sharing_configs_rejected(name: str) -> None:
    """tiny: ratios (0, 0, 4, 128, 4, 128)."""
    with pytest.raises(ValueError, match="source|layer indices|increasing"):
        preset("tiny", **BAD[name])  # type: ignore[arg-type]


def test_source_resolution() -> None:
    m = SHARED
    assert m.compress_ratios == (0, 4, 128, 4, 128, 4, 0, 4)
    assert [m.kv_source_of(i) for i in (1, 2, 3, 4, 5, 7)] == [1, 2, 1, 2, 1, 1]
    assert [m.index_source_of(i) for i in (1, 3, 5, 7)] == [1, 1, 5, 5]
    assert [m.runs_indexer(i) for i in range(8)] == [i in (1, 5) for i in range(8)]
    assert m.last_kv_source == 2 and m.shares_kv and m.kv_source_layers == (1, 2)
    t = TWO_SOURCES
    assert [t.kv_source_of(i) for i in (1, 2, 3, 4, 5)] == [1, 1, 3, 3, 5]
    assert [t.index_source_of(i) for i in (1, 2, 3, 4)] == [1, 2, 3, 3]
    plain = PRESETS["tiny"]
    assert plain.kv_source_layers == (2, 3, 4, 5) and plain.last_kv_source is None
    assert [plain.kv_source_of(i) for i in (2, 3)] == [2, 3] and plain.index_source_of(4) == 4
    with pytest.raises(ValueError, match="SWA-only"):
        m.kv_source_of(0)
    with pytest.raises(ValueError, match="not a C4"):
        m.index_source_of(2)
    assert m.unshared().kv_sources == () and m.unshared().index_sources == ()
    cut = m.first_layers(4)
    assert cut.compress_ratios == (0, 4, 128, 4) and cut.kv_sources == (1, 2)
    assert cut.index_sources == (1,)
    assert preset("flash-shared").hidden == 4096 and preset("flash-shared").last_kv_source == 2


# -- weights --------------------------------------------------------------------------------------


def test_weights_exist_only_where_the_sharing_computes() -> None:
    """Consumers have no compressor, C4 layers reusing a selection no indexer, index sources
    that are not KV sources no indexer compressor; every kept tensor equals the unshared
    model's (same seed, same draws), so the unshared presets are unchanged."""
    shared, plain = weights(SHARED), weights(SHARED.unshared())
    for i, (s, p) in enumerate(zip(shared.layers, plain.layers)):
        assert (s.compressor is not None) == (i in (1, 2)), i
        assert (s.indexer is not None) == (i in (1, 5)), i
        if s.indexer is not None:
            assert (s.indexer.compressor is not None) == (i == 1)
            assert torch.equal(s.indexer.w_q, p.indexer.w_q)
        if s.compressor is not None:
            assert torch.equal(s.compressor.w_kv, p.compressor.w_kv)
        assert torch.equal(s.w_q, p.w_q) and torch.equal(s.w_down, p.w_down)
        if p.ratio:  # the unshared model keeps everything
            assert p.compressor is not None
        if p.ratio == 4:
            assert p.indexer is not None and p.indexer.compressor is not None
    assert torch.equal(shared.head, plain.head)


# -- pools and memory -----------------------------------------------------------------------------


def test_pools_only_for_sources_and_bytes_per_token() -> None:
    cc = SHARED.cache_config(page_size=128, full_capacity=1024, swa_capacity=512)
    shared = KVPools(SHARED, cc, "cpu", torch.float32)
    plain = KVPools(SHARED.unshared(), cc, "cpu", torch.float32)
    assert sorted(shared.compressed) == sorted(shared.ring) == [1, 2]
    assert sorted(shared.index_keys) == sorted(shared.index_ring) == [1]
    assert sorted(plain.compressed) == [1, 2, 3, 4, 5, 7] and len(shared.swa) == 8
    assert shared.late_swa_valid is None
    for pools, model in ((shared, SHARED), (plain, SHARED.unshared())):
        per = bytes_per_token(model, cc, torch.float32)
        sizes = pools.nbytes()
        sentinels = sum(t[0].numel() * 4 for t in pools.compressed.values())
        assert sizes.compressed == per.compressed * cc.max_full_capacity + sentinels
        index_sentinels = sum(t[0].numel() * 4 for t in pools.index_keys.values())
        assert sizes.index == per.index * cc.max_full_capacity + index_sentinels
        assert sizes.swa == per.swa * cc.max_swa_capacity + 8 * SHARED.head_dim * 4
    s = bytes_per_token(SHARED, cc, torch.bfloat16)
    p = bytes_per_token(SHARED.unshared(), cc, torch.bfloat16)
    # C4: 32 + 16 (index) values / 4 tokens, C128: 32 / 128, per source layer, 2 bytes each
    assert s.compressed == 2 * (32 / 4 + 32 / 128) and s.index == 2 * 16 / 4
    assert p.compressed == 2 * (4 * 32 / 4 + 2 * 32 / 128) and p.index == 4 * s.index
    assert s.swa == p.swa and s.per_swa_token < p.per_swa_token
    assert p.per_cached_token / s.per_cached_token > 3.5


# -- paged == reference (float64, bit for bit) ----------------------------------------------------


def test_reference_sharing_is_explicit() -> None:
    """Sharing changes the model; naming every compressed layer a source and every C4 layer an
    index source is no sharing at all (same logits as the plain model)."""
    prompt = tuple(TOKENS[:300])
    plain = SHARED.unshared()
    everything = dataclasses.replace(
        plain, kv_sources=plain.kv_source_layers, index_sources=(1, 3, 5, 7)
    )
    assert torch.equal(ref(everything, prompt), ref(plain, prompt))
    assert float((ref(SHARED, prompt) - ref(plain, prompt)).abs().max()) > 1e-3


@pytest.mark.parametrize(
    "cfg,page,schedule",
    [
        (SHARED, 16, [37] * 20),
        (SHARED, 64, schedule_ending_at((3, 4, 5, 127, 128, 129, 255, 256, 257, 511, 512, 513))),
        (SHARED, 4, [100] * 10),
        (TWO_SOURCES, 1, [61] * 10),
        (TWO_SOURCES, 64, [256, 256, 18]),
    ],
)
def test_chunked_prefill_equals_reference(cfg: ModelConfig, page: int, schedule) -> None:
    """A 530-token prompt (queries cross 4/8, 128/129, 256/257, 512/513) in odd chunks."""
    prompt = TOKENS[:530]
    eng = Paged(cfg, page, max(schedule))
    req = eng.admit(prompt, reuse=False)
    assert_exact(eng.prefill(req, schedule), ref(cfg, tuple(prompt)), f"page {page}")
    eng.cache.finish(req)
    eng.cache.check_invariants()


@pytest.mark.parametrize("page,len_a,shared", [(16, 265, 260), (4, 129, 129), (64, 300, 300)])
def test_prefix_reuse_then_decode_equals_reference(page: int, len_a: int, shared: int) -> None:
    """b reuses a's cached prefix (entries of the source layers, window, rings), prefills the
    rest and decodes across boundaries: still the reference, exactly."""
    a = TOKENS[:len_a]
    b = TOKENS[:shared] + TOKENS[400:461]
    eng = Paged(SHARED, page, max_chunk=64)
    ra = eng.admit(a, reuse=False)
    eng.prefill(ra, [37] * 20)
    eng.cache.cache_unfinished(ra)
    eng.cache.finish(ra)
    match = eng.cache.match_prefix(b[:-1])
    assert match.window is WindowSource.LIVE and match.prefix_len == shared // page * page
    rb = eng.cache.admit(b, match)
    got = [eng.prefill(rb, [23] * 20)]
    for t in TOKENS[500:504]:
        got += eng.step([rb], [[t]])
    want = ref(SHARED, tuple(b + TOKENS[500:504]))[match.prefix_len :]
    assert_exact(torch.cat(got), want, "prefix reuse")
    eng.cache.finish(rb)
    eng.cache.check_invariants()


def test_graph_decoder_equals_reference() -> None:
    """Graph decode (slots from raw batch state, eager on the CPU): consumers read the source's
    pools, reused selections; a batch crossing 128/129 and 256/257."""
    prompts = [TOKENS[:125], TOKENS[:254], TOKENS[300:303]]
    eng = Paged(SHARED, 16, max_chunk=100, full_tokens=1600)
    dec = GraphDecoder(eng.weights, eng.pools, eng.cc, 4, eng.cc.full_capacity, None, 64)
    reqs = [eng.admit(p, reuse=False) for p in prompts]
    got = [[eng.prefill(r, [100] * 3)] for r in reqs]
    fed: list[list[int]] = [[] for _ in prompts]
    for k in range(5):
        toks = [TOKENS[460 + 5 * i + k] for i in range(len(reqs))]
        plan = eng.cache.extend_batch(reqs, [[t] for t in toks])
        logits = dec.step(reqs, toks, plan.deltas)
        for i in range(len(reqs)):
            got[i].append(logits[i : i + 1])
            fed[i].append(toks[i])
    for i, p in enumerate(prompts):
        assert_exact(torch.cat(got[i]), ref(SHARED, tuple(p + fed[i])), f"request {i}")
    for r in reqs:
        eng.cache.finish(r)


# -- runner ---------------------------------------------------------------------------------------


def make_runner(cfg=SHORT_SHARED, page=16, chunk=24, hisparse=None, graph_decode=False):
    cc = cfg.cache_config(page_size=page, full_capacity=640, swa_capacity=192, debug=True)
    return Runner(
        cfg,
        cc,
        device="cpu",
        dtype=torch.float64,
        weights=weights(cfg),
        chunk_tokens=chunk,
        max_running=4,
        graph_decode=graph_decode,
        hisparse_pages=hisparse,
    )


def prompts(seed: int, n: int = 5) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 256, 70).tolist()
    return [system + rng.integers(0, 256, int(k)).tolist() for k in rng.integers(1, 50, n)]


@pytest.mark.parametrize(
    "mode,page", [("paged", 16), ("paged", 4), ("graph", 8), ("hisparse", 16), ("hisparse", 4)]
)
def test_runner_greedy_equals_reference(mode: str, page: int) -> None:
    """Continuous batching with a shared system prompt (prefix reuse), chunked prefill and
    batched decode; HiSparse with a 6-page buffer per C4 source layer (constant swap-ins)."""
    runner = make_runner(
        page=page, hisparse=6 if mode == "hisparse" else None, graph_decode=mode == "graph"
    )
    ps = prompts(page)
    results = runner.generate(ps[:1], SamplingParams(max_new_tokens=12))
    results += runner.generate(ps[1:], SamplingParams(max_new_tokens=12))
    for p, r in zip(ps, results):
        assert r.output == reference_generate(weights(SHORT_SHARED), p, 12)
        assert not r.approximate
    assert runner.cache.stats().hit_tokens > 0
    if runner.offload is not None:
        assert runner.offload.layers == [1] and sorted(runner.offload.host) == [1]
        runner.offload.drain()
        assert runner.offload.coordinator.stats().swap_ins > 0
        runner.offload.coordinator.check_invariants()
    runner.cache.check_invariants()
