"""Speculative decoding end to end (adapters/engine/speculative.py, mtp.py, graph_verify.py).

Greedy output with speculation must equal output without it and the dense reference, whatever
the draft proposes (acceptance 0 % .. 100 %, the MTP layer), through prefix sharing, preemption,
stop tokens and max_new_tokens cuts, on the paged verify path and on `GraphVerifier` (eager on
the CPU). The MTP layer's paged drafts equal its dense reference. Float64 on the CPU: logits
(fp32, as the main model's) are bit-identical; hidden states agree within 1e-13 (a matmul's
rounding depends on how many rows it multiplies).

Every runner built through ``make_runner`` is checked at teardown: nothing pending, no cache
request left, ``check_invariants()`` passes (debug caches check after every call).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from small_models import SMALL, one_thread

from adapters import kernels
from adapters.engine.runner import Runner
from adapters.engine.sampling import SamplingParams
from adapters.engine.speculative import (
    DraftBatch,
    DraftError,
    MTPDraft,
    OracleDraft,
    accept_greedy,
    cut_emission,
)
from adapters.forward.graph_verify import GraphVerifier, VerifyKeys
from adapters.forward.mtp import (
    MTPDrafter,
    reference_mtp_draft,
    reference_mtp_logits,
    resume_hidden,
)
from adapters.forward.paged import build_step, run_step
from adapters.memory.pools import KVPools
from adapters.model import ops
from adapters.model.model import final_hidden
from adapters.model.model_config import preset
from adapters.model.reference import DenseKeys, reference_generate
from adapters.model.weights import init_weights
from shadowradix import InvalidRequestError, ShadowRadixCache

pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")

#: window 16, C4 (overlapped, sparse) + C16 (dense): short sequences cross many groups/windows
CFG = preset("tiny", **SMALL, window=16, compress_ratios=(0, 4, 16, 4))
STEM = np.random.default_rng(7).integers(0, 256, 40).tolist()
#: prompts sharing prefixes (hits once the first ones finished), around the group boundaries
PROMPTS = [STEM[:9], STEM[:21] + [3, 1], STEM[:33], STEM[:21] + [9], STEM[:4]]
NEW = 10


_one_thread = pytest.fixture(autouse=True, scope="module")(one_thread)


@functools.cache
def weights(cfg=CFG):
    return init_weights(cfg, "cpu", torch.float64)


@functools.cache
def _ref(prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    return tuple(reference_generate(weights(), list(prompt), n))


def ref(prompt: list[int], n: int = NEW) -> list[int]:
    return list(_ref(tuple(prompt), n))


def table(n: int = NEW) -> dict[tuple[int, ...], list[int]]:
    """The target's greedy continuation of every prompt: what `OracleDraft` perturbs."""
    return {tuple(p): ref(p, n) for p in PROMPTS}


def ref_hidden(tokens: list[int]) -> torch.Tensor:
    """The main model's hidden state at the last position of ``tokens``, from scratch."""
    ids = torch.tensor(tokens)
    return final_hidden(weights(), ids, torch.arange(len(tokens)), DenseKeys(CFG, len(tokens)))[-1]


def assert_clean(runner: Runner) -> None:
    assert runner.num_pending == 0
    st = runner.cache.stats()
    assert st.num_requests == 0 and st.full.held_pages == 0 and st.swa.held_pages == 0
    runner.cache.check_invariants()


@pytest.fixture
def make_runner():
    made: list[Runner] = []

    def make(page=4, full_pages=None, swa_pages=None, chunk=7, k=3, speculative=True, **kw):
        full = full_pages * page if full_pages else 64 * 8
        swa = swa_pages * page if swa_pages else -(-(chunk + CFG.window + 6 * page) // page) * page
        cc = CFG.cache_config(
            page_size=page,
            full_capacity=full,
            swa_capacity=swa,
            debug=True,
            speculative=speculative,
        )
        if k is not None:
            kw["speculative_tokens"] = k
        r = Runner(
            CFG,
            cc,
            device="cpu",
            dtype=torch.float64,
            weights=weights(),
            chunk_tokens=chunk,
            **kw,
        )
        made.append(r)
        return r

    yield make
    for r in made:
        assert_clean(r)


def run_all(runner: Runner, prompts, params) -> list[list[int]]:
    """Submits one prompt per step (later ones hit what earlier ones cached), runs to the end;
    outputs in prompt order."""
    ids, finished = [], []
    for p in prompts:
        ids.append(runner.submit(p, params))
        finished += runner.step()
    done = {r.request_id: r for r in finished + runner.run()}
    return [done[i].output for i in ids]


# -- the MTP layer ------------------------------------------------------------------------------


def test_mtp_weights_come_from_their_own_generator() -> None:
    """Turning the MTP layer on adds its weights and changes no main weight."""
    with_mtp, without = weights(), init_weights(preset("tiny", **SMALL, window=16,
        compress_ratios=(0, 4, 16, 4), mtp=False), "cpu", torch.float64)  # fmt: skip
    assert without.mtp is None and with_mtp.mtp is not None
    assert torch.equal(with_mtp.embed, without.embed) and torch.equal(with_mtp.head, without.head)
    for a, b in zip(with_mtp.layers, without.layers):
        assert torch.equal(a.w_q, b.w_q) and torch.equal(a.w_down, b.w_down)
    assert not torch.equal(with_mtp.mtp.layer.w_q, with_mtp.layers[0].w_q)
    assert with_mtp.mtp.proj.shape == (2 * CFG.hidden, CFG.hidden)


def test_reference_mtp_draft_starts_from_the_reference_mtp_logits() -> None:
    """The dense draft's first step is the MTP row of the pending token (same definition, two
    code paths): bit-identical fp32 logits."""
    tokens = STEM[:23]
    drafts, logits = reference_mtp_draft(weights(), tokens, 2)
    assert torch.equal(logits[0], reference_mtp_logits(weights(), tokens)[-1])
    assert drafts[0] == int(logits[0].argmax())


class CheckedMTP(MTPDraft):
    """`MTPDraft` checking every proposal against the dense reference: the draft tokens and
    their logits (bit-identical), and the runner's kept hidden state (within 1e-13)."""

    def __init__(self) -> None:
        super().__init__()
        self.checked = 0

    def propose(self, batch: DraftBatch) -> list[list[int]]:
        return self._checked(batch, super().propose(batch))

    def propose_device(self, batch: DraftBatch) -> torch.Tensor:
        out = super().propose_device(batch)
        self._checked(batch, out.tolist())
        return out

    def _checked(self, batch: DraftBatch, out):
        assert self.drafter is not None and self.drafter.last_logits is not None
        assert batch.hidden is not None
        for i, (p, o) in enumerate(zip(batch.prompts, batch.outputs)):
            toks, logits = reference_mtp_draft(weights(), p + o, batch.num_tokens)
            assert out[i] == toks
            assert torch.equal(self.drafter.last_logits[i], logits), f"request {i}: MTP logits"
            torch.testing.assert_close(batch.hidden[i], ref_hidden(p + o[:-1]), rtol=0, atol=1e-13)
            self.checked += 1
        return out


@pytest.mark.parametrize("page,graph", [(1, False), (4, True), (8, False), (16, True)])
def test_mtp_drafts_equal_the_dense_reference(make_runner, page: int, graph: bool) -> None:
    """Paged MTP drafts (committed window from the pool, drafted keys in temporaries) and the
    hidden state the runner keeps across verify + rollback equal the dense reference, also for
    requests resuming on a prefix hit (the page's kept hidden state)."""
    draft = CheckedMTP()
    r = make_runner(page=page, k=3, draft=draft, graph_decode=graph)
    params = SamplingParams(max_new_tokens=8)
    outs = [o.output for o in r.generate(PROMPTS[1:3], params)]  # the second one hits
    outs += run_all(r, [PROMPTS[0], PROMPTS[3]], params)  # a batch
    assert outs == [ref(p, 8) for p in PROMPTS[1:3] + [PROMPTS[0], PROMPTS[3]]]
    assert draft.checked >= 12
    assert r.cache.stats().hit_tokens > 0


# -- greedy equality ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "page,k,rate,graph",
    [
        (4, 3, 0.0, False),
        (4, 3, 1.0, True),
        (1, 2, 0.5, True),
        (8, 8, 0.8, False),
        (16, 5, 1.0, False),
        (2, 1, 0.3, True),
        (8, 4, 0.9, True),
    ],
)
def test_speculation_equals_plain_greedy(make_runner, page, k, rate, graph) -> None:
    """Oracle drafts at acceptance 0 %, 30 % .. 100 %: the output is the reference's greedy
    output and the plain runner's; acceptance and tokens per forward follow the rate."""
    params = SamplingParams(max_new_tokens=NEW)
    plain = run_all(make_runner(page=page, k=None), PROMPTS, params)
    r = make_runner(page=page, k=k, draft=OracleDraft(table(), rate, seed=k), graph_decode=graph)
    assert run_all(r, PROMPTS, params) == plain == [ref(p) for p in PROMPTS]
    st = r.spec.stats
    assert st.emitted_tokens == r.stats.decode_tokens
    if rate == 0.0:
        assert st.accepted_tokens == 0 and st.mean_acceptance_length == 1.0
    if rate == 1.0 and not r.stats.preemptions:  # all accepted, but for max_new_tokens cuts
        assert st.request_steps == len(PROMPTS) * -(-(NEW - 1) // (k + 1))
    assert st.tokens_per_forward >= st.mean_acceptance_length >= 1.0


def test_mtp_speculation_with_paged_and_graph_verify(make_runner) -> None:
    params = SamplingParams(max_new_tokens=NEW)
    for graph in (False, True):
        r = make_runner(page=4, k=2, graph_decode=graph)  # the default draft: the MTP layer
        assert isinstance(r.spec.draft, MTPDraft)
        assert run_all(r, PROMPTS, params) == [ref(p) for p in PROMPTS]


@pytest.mark.parametrize("k", [1, 4])
def test_stop_tokens_and_length_cuts(make_runner, k: int) -> None:
    """A stop token inside an accepted run ends the output right there, and max_new_tokens
    cuts a run short; the cache keeps exactly prompt + output[:-1] (finish inserts it)."""
    prompts = PROMPTS[:3]
    params = [
        SamplingParams(max_new_tokens=NEW, stop_token=ref(prompts[0])[5]),
        SamplingParams(max_new_tokens=1),
        SamplingParams(max_new_tokens=NEW, stop_token=ref(prompts[2])[1]),
    ]
    r = make_runner(page=4, k=k, draft=OracleDraft(table(), 1.0))
    finished: list[list[int]] = []
    finish = r.cache.finish
    r.cache.finish = lambda req: (finished.append(req.tokens), finish(req))  # type: ignore
    res = r.generate(prompts, params)
    for got, p, sp in zip(res, prompts, params):
        want = ref(p)[: sp.max_new_tokens]
        if sp.stop_token is not None:
            want = want[: want.index(sp.stop_token) + 1]
        assert got.output == want
        assert got.finish_reason == ("stop" if sp.stop_token is not None else "length")
        assert p + got.output[:-1] in finished  # what the cache held when it finished


def test_preemption_under_speculation(make_runner) -> None:
    """A full pool barely above one request: verify steps preempt (drafts need pages too),
    and every output still equals the reference."""
    params = SamplingParams(max_new_tokens=NEW)
    r = make_runner(
        page=4, full_pages=16, swa_pages=9, k=4, draft=OracleDraft(table(), 0.7), max_running=4
    )
    r.share_prefills = False  # the prompts' common prefix would be prefilled once, no pressure
    outs = r.generate(PROMPTS, params)
    assert [o.output for o in outs] == [ref(p) for p in PROMPTS]
    assert r.stats.preemptions > 0


# -- graph verify against the paged verify ------------------------------------------------------


def _verify_both_ways(cache, pools, ver, reqs, chunks, since=()) -> None:
    """Draft ``chunks`` onto ``reqs``, run the verify step through the paged forward and through
    `GraphVerifier` from the same pool contents: logits equal, every pool row equal (except the
    sentinel rows, which padding writes); the verifier's writes are kept. ``since``: the
    page-table deltas since the last verify (rollbacks)."""
    alloc = cache.extend_draft_batch(reqs, chunks)
    saved = [t.clone() for t in _all_pools(pools)]
    plans = [cache.read_plan(r, start=s) for r, s in zip(reqs, alloc.starts)]
    step = build_step(CFG, alloc, plans, np.array(sum(chunks, [])), "cpu")
    want = run_step(weights(), pools, step, None)
    paged = [t.clone() for t in _all_pools(pools)]
    for t, before in zip(_all_pools(pools), saved):
        t.copy_(before)
    got, _ = ver.verify(reqs, chunks, deltas=[*since, *alloc.deltas])
    assert torch.equal(got, want)
    for a, b in zip(_all_pools(pools), paged):
        torch.testing.assert_close(a[:-1], b[:-1], rtol=0, atol=1e-13)


def _verify_world(page: int, batch: int = 4):
    cc = CFG.cache_config(
        page_size=page, full_capacity=512, swa_capacity=256, debug=True, speculative=True
    )
    cache = ShadowRadixCache(cc)
    pools = KVPools(CFG, cc, "cpu", torch.float64)
    ver = GraphVerifier(weights(), pools, cc, batch, cc.full_capacity, 4, min_context_bucket=8)
    return cache, pools, ver


def _prefill(cache, pools, reqs) -> None:
    chunks = [r.prompt_remaining.tolist() for r in reqs]
    alloc = cache.extend_batch(reqs, chunks)
    plans = [cache.read_plan(r, start=s) for r, s in zip(reqs, alloc.starts)]
    run_step(
        weights(), pools, build_step(CFG, alloc, plans, np.array(sum(chunks, [])), "cpu"), None
    )


@pytest.mark.parametrize("page", [1, 4, 16])
def test_graph_verify_step_equals_paged_step(page: int) -> None:
    """One verify step of several requests (positions across group and page ends): logits and
    every pool row written by `GraphVerifier` equal the paged forward of the same `Allocation`."""
    cache, pools, ver = _verify_world(page)
    reqs = [cache.admit(STEM[:n]) for n in (13, 30, 3)]
    _prefill(cache, pools, reqs)
    _verify_both_ways(cache, pools, ver, reqs, [[5, 6, 7, 8], [9, 10, 11, 12], [1, 2, 3, 4]])
    for r in reqs:
        cache.rollback(r, 2)
        cache.finish(r)


@pytest.mark.parametrize("page", [4, 16])
def test_graph_verify_fused_compressor_layout_is_safe(monkeypatch, page: int) -> None:
    """The CUDA path stores the step's ring rows before gathering each completing group's rows
    (one Flash Compressor kernel). Run that layout on the CPU (the kernel's torch reference):
    T = max_draft_len rows per request, groups completing inside the step, and the result
    equals the paged step, so no stored row overwrote a carried one."""
    monkeypatch.setattr(VerifyKeys, "_compress", VerifyKeys._compress_fused_on_cpu, raising=False)
    cc = CFG.cache_config(
        page_size=page, full_capacity=512, swa_capacity=256, debug=True, speculative=True
    )
    t_len = cc.max_draft_len or 9
    cache, pools = ShadowRadixCache(cc), KVPools(CFG, cc, "cpu", torch.float64)
    ver = GraphVerifier(weights(), pools, cc, 4, cc.full_capacity, t_len, min_context_bucket=8)
    reqs = [cache.admit(STEM[:n]) for n in (13, 30, 7)]
    _prefill(cache, pools, reqs)
    since: list = []
    for rnd in range(3):
        chunks = [[(7 * rnd + 3 * i + j) % 256 for j in range(t_len)] for i in range(3)]
        _verify_both_ways(cache, pools, ver, reqs, chunks, since)
        since = [d for r in reqs for d in cache.rollback(r, t_len // 2).deltas]
    for r in reqs:
        cache.finish(r)


def test_graph_verify_uploads_again_the_pages_of_a_rejected_draft() -> None:
    """A rejected draft's pages go back to the allocator and another request takes them: the
    next verify of the first request must use its new page ids, not the device table's stale
    ones (whose slots now belong to the other request)."""
    cache, pools, ver = _verify_world(page=2)
    a, b = cache.admit(STEM[:5]), cache.admit(STEM[10:17])
    _prefill(cache, pools, [a, b])
    _verify_both_ways(cache, pools, ver, [a], [[1, 2, 3, 4]])
    back = cache.rollback(a, 3)  # keeps one token: the pages of positions 7, 8 go back
    taken = cache.extend(b, [7, 7, 7, 7])  # b takes them
    assert taken.num_tokens == 4
    since = [*back.deltas, *taken.deltas]
    _verify_both_ways(cache, pools, ver, [a, b], [[5, 6, 7, 8], [1, 1, 1, 1]], since)
    for r in (a, b):
        cache.rollback(r, 4)
        cache.finish(r)


def _all_pools(pools: KVPools) -> list[torch.Tensor]:
    return (
        pools.swa
        + list(pools.compressed.values())
        + list(pools.ring.values())
        + list(pools.index_keys.values())
        + list(pools.index_ring.values())
    )


# -- pure helpers -------------------------------------------------------------------------------


def test_accept_greedy_and_cut_emission() -> None:
    emitted, accepted = accept_greedy([[1, 2, 3], [4, 5, 6], [7, 8, 9]],
                                      [[1, 2, 3, 0], [9, 5, 6, 1], [7, 8, 1, 2]])  # fmt: skip
    assert emitted == [[1, 2, 3, 0], [9], [7, 8, 1]] and accepted == [3, 0, 2]
    assert cut_emission([1, 2, 3, 0], 2, None) == [1, 2]
    assert cut_emission([1, 2, 3, 0], 9, 2) == [1, 2]
    assert cut_emission([1, 2, 3], 9, 5) == [1, 2, 3]


def test_oracle_draft_acceptance_is_controlled(make_runner) -> None:
    """Drafts are the table's next tokens, each kept with probability ``accept_rate`` and
    replaced by a different token otherwise; seeded."""
    cont = {(1, 2): list(range(10, 40))}
    drafts = []
    for _ in range(2):
        r = make_runner(k=4, draft=OracleDraft(cont, 0.75, seed=3))
        batch = DraftBatch((), ([1, 2], [1, 2], [9]), ([10] * 5, [10] * 28, [1]), None, 4)
        drafts.append([r.spec.draft.propose(batch) for _ in range(500)])
    assert drafts[0] == drafts[1]  # the seed fixes them
    kept = [sum(t == u for t, u in zip(d[0], range(15, 19))) for d in drafts[0]]
    assert 0.72 < sum(kept) / 2000 < 0.78 and min(kept) == 0 and max(kept) == 4
    assert all(0 <= t < CFG.vocab_size for d in drafts[0] for t in sum(d, []))
    assert sum(d[1][:2] == [38, 39] for d in drafts[0]) > 200  # past the table: unknown
    with pytest.raises(ValueError):
        OracleDraft({}, 1.5)


# -- errors -------------------------------------------------------------------------------------


def test_runner_rejects_unsupported_speculation(make_runner) -> None:
    oracle = OracleDraft(table(), 1.0)
    with pytest.raises(ValueError, match="speculative=True"):
        make_runner(k=2, speculative=False)
    with pytest.raises(ValueError, match="max_draft_len"):
        make_runner(page=16, k=9)  # C4 at page 16: max_draft_len 9 < k + 1
    with pytest.raises(ValueError, match=">= 1"):
        make_runner(k=0)
    with pytest.raises(ValueError, match="verify step of 9 tokens"):  # the chunk fits, k + 1 not
        make_runner(page=4, chunk=3, swa_pages=7, k=8)
    with pytest.raises(ValueError, match="speculative_tokens"):
        make_runner(k=None, draft=oracle)
    no_mtp = preset("tiny", **SMALL, window=16, compress_ratios=(0, 4, 16, 4), mtp=False)
    cc = no_mtp.cache_config(page_size=4, full_capacity=256, swa_capacity=128, speculative=True)
    with pytest.raises(ValueError, match="MTP"):
        Runner(no_mtp, cc, device="cpu", chunk_tokens=16, speculative_tokens=2)
    Runner(no_mtp, cc, device="cpu", chunk_tokens=16, speculative_tokens=2, draft=oracle)


def test_submit_rejects_overlong_requests(make_runner) -> None:
    r = make_runner(page=4, full_pages=16, k=3, draft=OracleDraft(table(), 1.0))
    with pytest.raises(InvalidRequestError, match="draft"):  # 60 + 2 + 3 draft > 64
        r.submit([1] * 60, SamplingParams(max_new_tokens=2))
    r.submit([1] * 59, SamplingParams(max_new_tokens=2))
    r.run()


class BadDraft(OracleDraft):
    def __init__(self, bad) -> None:
        super().__init__({}, 1.0)
        self.bad = bad

    def propose(self, batch: DraftBatch) -> list[list[int]]:
        return self.bad(batch)


@pytest.mark.parametrize(
    "bad",
    [
        lambda b: [[1, 2]] * len(b.prompts),  # too short
        lambda b: [[1, 2, 3]],  # one draft for several requests
        lambda b: [[1, 2, 300]] * len(b.prompts),  # outside the vocabulary
        lambda b: [[1, 2.0, 3]] * len(b.prompts),  # not ints
        lambda b: "abc",
    ],
)
def test_bad_drafts_raise_draft_error_before_touching_the_cache(make_runner, bad) -> None:
    r = make_runner(k=3, chunk=16, draft=BadDraft(bad))
    r.share_prefills = False  # admitted together even where their prompts share a prefix
    for p in (PROMPTS[0], PROMPTS[4]):  # both prefilled in one step: they decode together
        r.submit(p, SamplingParams(max_new_tokens=4))
    with pytest.raises(DraftError):
        for _ in range(20):
            r.step()
    assert all(q.num_draft == 0 for q in r.cache.requests)
    r.cache.check_invariants()
    for seq in list(r._running):  # let the fixture's clean check pass
        r.cache.abort(seq.req)
        seq.request = None
    r._running.clear()


# -- the benchmark ------------------------------------------------------------------------------


def test_speculative_bench_runs(tmp_path, monkeypatch, capsys) -> None:
    """bench/speculative.py checks greedy equality, then times; a tiny run stays runnable."""
    path = Path(__file__).resolve().parents[1] / "bench/speculative.py"
    spec = importlib.util.spec_from_file_location("bench_speculative", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_speculative", bench)
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.json"
    argv = "--batches 2 --ks 2 --sources oracle:1.0,mtp --prompt-len 40 --new-tokens 6 "
    argv += f"--check-tokens 4 --page-size 16 --chunk-tokens 64 --json {out}"
    monkeypatch.setattr(sys, "argv", ["speculative.py", *argv.split()])
    threads = torch.get_num_threads()
    try:
        assert bench.main() == 0
    finally:
        torch.set_num_threads(threads)
    rows = json.loads(out.read_text())["rows"]
    assert json.loads(out.read_text())["meta"]["command"].startswith("python")  # where it came from
    assert [(r["source"], r["k"], r["batch"]) for r in rows] == [
        ("oracle:1.0", 2, 2),
        ("mtp", 2, 2),
    ]
    assert rows[0]["acceptance_rate"] == 1.0 and rows[0]["agree"] == 1.0
    assert "equal the plain run" in capsys.readouterr().out


def test_misuse_of_the_building_blocks_raises_clearly() -> None:
    cc = CFG.cache_config(page_size=4, full_capacity=256, swa_capacity=128, speculative=True)
    plain_pools = KVPools(CFG, cc, "cpu", torch.float64)
    with pytest.raises(ValueError, match="mtp=True"):
        GraphVerifier(weights(), plain_pools, cc, 2, 256, 3, mtp=True)
    with pytest.raises(ValueError, match="mtp=True"):
        MTPDrafter(weights(), plain_pools, cc, 2, 256, 3)
    no_mtp = init_weights(preset("tiny", **SMALL, window=16, compress_ratios=(0, 4, 16, 4),
                                 mtp=False), "cpu", torch.float64)  # fmt: skip
    with pytest.raises(ValueError, match="no MTP layer"):
        reference_mtp_logits(no_mtp, [1, 2, 3])
    with pytest.raises(RuntimeError, match="not bound"):
        MTPDraft().propose(DraftBatch((), ([1],), ([2],), torch.zeros(1, CFG.hidden), 2))
    cache, pools = ShadowRadixCache(cc), KVPools(CFG, cc, "cpu", torch.float64, mtp=True)
    r = cache.admit(STEM[:6])
    cache.extend(r, STEM[:6])
    with pytest.raises(RuntimeError, match="mid-page"):
        resume_hidden(pools, r, 6, 4)  # hidden states are kept at page ends only
    assert torch.equal(resume_hidden(pools, r, 4, 4), pools.page_hidden[r.swa_pages[0]])
    ver = GraphVerifier(weights(), pools, cc, 2, 256, 3)
    cache.extend_draft(r, [1, 2, 3])
    with pytest.raises(ValueError, match="exactly 3 tokens"):
        ver.verify([r], [[1, 2]], deltas=())
    cache.rollback(r, 3)
    cache.finish(r)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_shared_rows_index_logits_equal_per_query_scores(dtype) -> None:
    """The verify step scores each request's keys in place for its T queries (``qrow`` maps a
    query row to its request's page row): the same values as `ops.index_scores` over
    per-query copies of the keys."""
    gen = torch.Generator().manual_seed(3)
    b, t_len, hi, di, e = 3, 4, 2, 16, 10
    q = torch.randn(b * t_len, hi, di, generator=gen).to(dtype)
    w = torch.randn(b * t_len, hi, generator=gen).to(dtype)
    pool = torch.randn(b * e + 1, di, generator=gen).to(dtype)
    table = torch.randperm(b * e, generator=gen).view(b, e)
    qrow = torch.arange(b).repeat_interleave(t_len)
    rows = kernels.PoolRows(table, torch.full((b * t_len,), e), qrow)
    want = ops.index_scores(q, w, pool[table].repeat_interleave(t_len, dim=0))
    torch.testing.assert_close(kernels.index_logits(q, w, pool, rows), want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("graph", [False, True])
def test_speculation_with_v41_sharing_and_tail_only(graph: bool) -> None:
    """Paged and graph verify on a V4.1 shared model after tail-only prefills equal the
    tail-only oracle. Request B resumes at position 296 of A's 300-token chunk, whose later
    layers computed only positions 172..299: B's verify windows reach 170 and 171, which they
    must mask (the late-SWA mask). MTP drafts with tail-only are refused."""
    from adapters.model.model_config import preset as _preset
    from adapters.model.reference import reference_tail_only_generate, tail_only_computed

    shared = _preset("tiny-shared", hidden=32, head_dim=16, rope_dim=4, index_dim=8, index_topk=4)
    cc = shared.cache_config(page_size=8, full_capacity=8 * 128, swa_capacity=8 * 96,
                             speculative=True)  # fmt: skip
    with pytest.raises(ValueError, match="tail-only"):
        Runner(shared, cc, graph_decode=graph, speculative_tokens=2, chunk_tokens=64,
               tail_only=True)  # fmt: skip
    w = init_weights(shared, "cpu", torch.float64)
    a = np.random.default_rng(5).integers(0, 256, 300).tolist()
    b = a[:297]
    flags_a = tail_only_computed([300], shared.window)
    want_a = reference_tail_only_generate(w, a, flags_a, 1)
    want_b = reference_tail_only_generate(w, b, flags_a[:296] + [True], 6)
    table = {tuple(a): want_a, tuple(b): want_b}
    runner = Runner(shared, cc, weights=w, graph_decode=graph, speculative_tokens=2,
                    chunk_tokens=300, tail_only=True,
                    draft=OracleDraft(table, accept_rate=0.7, seed=1))  # fmt: skip
    assert runner.generate([a], SamplingParams(max_new_tokens=1))[0].output == want_a
    valid = runner.pools.late_swa_valid
    assert valid is not None
    for layer in range(shared.last_kv_source + 1, shared.num_layers):  # unmasked reads show
        runner.pools.swa[layer][~valid] = 1e3
    out = runner.generate([b], SamplingParams(max_new_tokens=6))[0]
    assert out.cached_tokens == 296 and out.output == want_b and out.approximate
    assert want_b != reference_generate(w, b, 6)  # the holes did change it
    assert (runner.spec.verifier is not None) == graph
