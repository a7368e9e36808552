"""Decoder-side tail-only prefill (V4.1 bounded replay, an approximation; docs/sharing.md).

In every prefill forward the layers after the last KV-source layer compute only the last W
tokens of each request's chunk. The dense oracle `reference_tail_only_logits` states the
semantics from scratch: given which positions the later layers computed, every computed
position's windows in those layers see only computed positions. The paged forward and the
runner (paged decode, graph decode, HiSparse) must equal it bit for bit in float64, also when a
reused prefix holds positions another request never computed; and it must differ from the
exact model, so the ``approximate`` flag is honest. Also: prompt logprobs (exact runner) and
the errors of unsupported combinations.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from small_models import one_thread
from test_model import TOKENS, Paged, assert_exact
from test_sharing import SHARED, SHORT_SHARED

from adapters.engine.runner import Runner, UnsupportedRequestError
from adapters.engine.sampling import SamplingParams
from adapters.forward.paged import build_step, run_step, run_tail_only_step
from adapters.memory.pools import KVPools
from adapters.model.model import forward_tail_only
from adapters.model.model_config import preset
from adapters.model.reference import (
    DenseKeys,
    reference_generate,
    reference_logits,
    reference_tail_only_generate,
    reference_tail_only_logits,
    tail_only_computed,
)
from adapters.model.weights import init_weights
from shadowradix import InvalidRequestError, WindowSource

pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")


_one_thread = pytest.fixture(autouse=True, scope="module")(one_thread)


@functools.cache
def weights(cfg):
    return init_weights(cfg, "cpu", torch.float64)


def tail_rows(chunks: list[list[int]], window: int) -> torch.Tensor:
    """Flat rows of the last ``window`` tokens of every chunk (what the runner computes)."""
    rows, end = [], 0
    for c in chunks:
        rows += range(end + max(0, len(c) - window), end + len(c))
        end += len(c)
    return torch.tensor(rows, dtype=torch.long)


class TailPaged(Paged):
    """`Paged` whose prefill steps run tail-only; decode steps (one token each) run in full."""

    def __init__(self, cfg, page: int, max_chunk: int, **kw) -> None:
        super().__init__(cfg, page, max_chunk, **kw)
        self.pools = KVPools(cfg, self.cc, "cpu", self.dtype, track_late_swa=True)

    def step(self, reqs, chunks: list[list[int]]) -> list[torch.Tensor]:
        """Logits of the tail rows of every chunk, per request."""
        alloc = self.cache.extend_batch(reqs, chunks)
        plans = [self.cache.read_plan(r, start=s) for r, s in zip(reqs, alloc.starts)]
        flat = np.fromiter((t for c in chunks for t in c), np.int64)
        st = build_step(self.cfg, alloc, plans, flat, "cpu")
        rows = tail_rows(chunks, self.cfg.window)
        logits = run_tail_only_step(self.weights, self.pools, st, rows, None)
        return list(torch.split(logits, [min(len(c), self.cfg.window) for c in chunks]))


# -- the oracle ------------------------------------------------------------------------------------


def test_tail_only_computed_flags() -> None:
    assert tail_only_computed([5, 3, 1], 4) == [False, True, True, True, True] + [True] * 4
    assert tail_only_computed([], 4) == []
    with pytest.raises(ValueError, match="computed flags"):
        reference_tail_only_logits(weights(SHARED), TOKENS[:10], [True] * 9)


def test_everything_computed_is_the_exact_model() -> None:
    """With every position computed, the tail-only oracle is the reference, bit for bit."""
    seq = TOKENS[:300]
    got = reference_tail_only_logits(weights(SHARED), seq, [True] * len(seq))
    assert torch.equal(got, reference_logits(weights(SHARED), seq))


def test_tail_only_differs_from_the_exact_model() -> None:
    """It is an approximation: one 300-token chunk (172 positions skipped past layer 2) moves
    the last position's logits, and the greedy continuation diverges."""
    seq, w = TOKENS[:300], weights(SHARED)
    approx = reference_tail_only_logits(w, seq, tail_only_computed([300], SHARED.window))
    assert float((approx[-1] - reference_logits(w, seq)[-1]).abs().max()) > 1e-3
    short = SHORT_SHARED
    prompt = TOKENS[:120]
    flags = tail_only_computed([120], short.window)
    got = reference_tail_only_generate(weights(short), prompt, flags, 8)
    assert got != reference_generate(weights(short), prompt, 8)


def test_tail_only_needs_kv_sources() -> None:
    """The cut needs a last KV source; the oracle never compresses a partial sequence."""
    plain = SHARED.unshared()
    ids = torch.tensor(TOKENS[:8])
    with pytest.raises(ValueError, match="kv_sources"):
        forward_tail_only(weights(plain), ids, torch.arange(8), DenseKeys(plain, 8), ids[:2])
    comp = weights(SHARED).layers[1].compressor
    with pytest.raises(ValueError, match="whole sequence"):
        DenseKeys(SHARED, 8).compress(torch.zeros(5, SHARED.hidden, dtype=torch.float64), comp, 4)


# -- paged == oracle (float64, bit for bit) --------------------------------------------------------


@pytest.mark.parametrize("page,schedule", [(16, [200, 200, 127]), (64, [300, 227]), (4, [129] * 5)])
def test_paged_tail_only_equals_oracle(page: int, schedule: list[int]) -> None:
    """A 527-token prompt in chunks longer than the window, then 3 decode steps (crossing 528
    and 529): every tail row and decode row equals the oracle for the positions the chunks
    computed."""
    seq = TOKENS[:530]
    eng = TailPaged(SHARED, page, max(schedule))
    req = eng.admit(seq[:527], reuse=False)
    got = [eng.prefill(req, schedule)]
    eng.cache.cache_unfinished(req)
    for t in seq[527:]:
        alloc = eng.cache.extend_batch([req], [[t]])
        plan = eng.cache.read_plan(req, start=alloc.starts[0])
        st = build_step(SHARED, alloc, [plan], np.array([t]), "cpu")
        got.append(run_step(eng.weights, eng.pools, st, None))
    sizes = [min(n, 527 - sum(schedule[:i])) for i, n in enumerate(schedule)]
    flags = tail_only_computed(sizes, SHARED.window) + [True] * 3
    want = reference_tail_only_logits(weights(SHARED), seq, flags)
    assert_exact(torch.cat(got), want, f"page {page}")
    eng.cache.finish(req)


def test_reused_prefix_with_holes_equals_oracle() -> None:
    """a prefills 250 tokens in one chunk: the later layers hold only positions 122..249. b
    resumes at 240, so its windows in those layers reach the holes 112..121. Their SWA rows are
    poisoned here: they must be masked, never read, exactly as the oracle with a's flags on the
    prefix says. b shares its steps with an unrelated request c."""
    page, w = 16, SHARED.window
    a = TOKENS[:250]
    b = TOKENS[:245] + TOKENS[300:460]
    c = TOKENS[100:400]
    eng = TailPaged(SHARED, page, max_chunk=250, full_tokens=1600)
    ra = eng.admit(a, reuse=False)
    eng.prefill(ra, [250])
    eng.cache.cache_unfinished(ra)
    swa_page = ra.swa_pages[112 // page - ra.swa_base]  # a's held window starts at page 7
    holes = swa_page * page + torch.arange(10)  # positions 112..121
    for layer in range(SHARED.last_kv_source + 1, SHARED.num_layers):
        eng.pools.swa[layer][holes] = 1e3
    match = eng.cache.match_prefix(b[:-1])
    assert match.prefix_len == 240 and match.window is WindowSource.LIVE
    rb = eng.cache.admit(b, match)
    rc = eng.admit(c, reuse=False)
    first_b, first_c = eng.step([rb, rc], [b[240:380], c[:150]])
    rest_b, rest_c = eng.step([rb, rc], [b[380:], c[150:]])
    flags_b = tail_only_computed([250], w)[:240] + tail_only_computed([140, 25], w)
    want_b = reference_tail_only_logits(weights(SHARED), b, flags_b)[-(w + 25) :]
    assert_exact(torch.cat((first_b, rest_b)), want_b, "b")
    want_c = reference_tail_only_logits(weights(SHARED), c, tail_only_computed([150, 150], w))
    assert_exact(torch.cat((first_c, rest_c)), want_c, "c")
    for r in (ra, rb, rc):
        eng.cache.finish(r)
    eng.cache.check_invariants()


def test_run_tail_only_step_needs_tracking() -> None:
    eng = Paged(SHARED, 16, 8)
    req = eng.admit(TOKENS[:8], reuse=False)
    alloc = eng.cache.extend_batch([req], [TOKENS[:8]])
    st = build_step(SHARED, alloc, [eng.cache.read_plan(req, start=0)], np.array(TOKENS[:8]), "cpu")
    with pytest.raises(ValueError, match="track_late_swa"):
        run_tail_only_step(eng.weights, eng.pools, st, torch.arange(8), None)
    eng.cache.finish(req)


# -- runner ----------------------------------------------------------------------------------------


def make_runner(cfg=SHORT_SHARED, chunk=40, page=8, **kw) -> Runner:
    cc = cfg.cache_config(page_size=page, full_capacity=640, swa_capacity=256, debug=True)
    kw.setdefault("tail_only", True)
    return Runner(
        cfg, cc, device="cpu", dtype=torch.float64, weights=weights(cfg), chunk_tokens=chunk,
        max_running=1, **kw,
    )  # fmt: skip


def poison_holes(runner: Runner) -> None:
    """Every SWA row the later layers do not hold gets a huge value: a read that is not masked
    would move the logits far enough to change greedy tokens."""
    valid = runner.pools.late_swa_valid
    assert valid is not None and runner.model.last_kv_source is not None
    for layer in range(runner.model.last_kv_source + 1, runner.model.num_layers):
        runner.pools.swa[layer][~valid] = 1e3


def record_chunks(runner: Runner) -> dict[int, list[int]]:
    """Spies on the runner's prefill forwards: chunk sizes per request id, in order."""
    sizes: dict[int, list[int]] = {}
    count = runner._count_tail  # called once per prefill forward of a tail-only runner

    def spy(seqs, chunks):
        for seq, chunk in zip(seqs, chunks):
            sizes.setdefault(seq.result.request_id, []).append(len(chunk))
        count(seqs, chunks)

    runner._count_tail = spy  # type: ignore[method-assign]
    return sizes


@pytest.mark.parametrize("mode", ["paged", "graph", "hisparse"])
def test_runner_equals_oracle_with_prefix_holes(mode: str) -> None:
    """a: 100 tokens in chunks of 40; b extends a's first 90 tokens and resumes at a's page
    boundary 88, whose window reaches a's holes 80..83 in the later layers. Both equal the
    oracle for the chunks they ran (HiSparse cuts chunks to its 6-page buffer), both are
    flagged approximate, the stats count the skipped tokens."""
    kw = {"graph_decode": mode == "graph"}
    if mode == "hisparse":
        kw["hisparse_pages"] = 6
    runner = make_runner(**kw)
    chunks = record_chunks(runner)
    w, window = weights(SHORT_SHARED), SHORT_SHARED.window
    rng = np.random.default_rng(7)
    a = rng.integers(0, 256, 100).tolist()
    b = a[:90] + rng.integers(0, 256, 30).tolist()
    res_a = runner.generate([a], SamplingParams(max_new_tokens=6))[0]
    flags_a = tail_only_computed(chunks[res_a.request_id], window)
    assert res_a.output == reference_tail_only_generate(w, a, flags_a, 6)
    poison_holes(runner)
    res_b = runner.generate([b], SamplingParams(max_new_tokens=6))[0]
    hit = res_b.cached_tokens
    assert hit == 88
    flags_b = flags_a[:hit] + tail_only_computed(chunks[res_b.request_id], window)
    assert res_b.output == reference_tail_only_generate(w, b, flags_b, 6)
    if mode != "hisparse":  # chunks of 40: b's first windows reach a's holes
        assert chunks[res_a.request_id] == [40, 40, 20] and not all(flags_b[hit - window : hit])
    # c resumes at 88 too with only 5 tokens left: its decode windows reach a's holes
    c = a[:90] + [7, 8, 9]
    poison_holes(runner)
    res_c = runner.generate([c], SamplingParams(max_new_tokens=4))[0]
    assert res_c.cached_tokens == 88
    flags_c = flags_a[:88] + tail_only_computed(chunks[res_c.request_id], window)
    assert res_c.output == reference_tail_only_generate(w, c, flags_c, 4)
    assert res_a.approximate and res_b.approximate and res_c.approximate
    skipped = [max(0, n - window) for ns in chunks.values() for n in ns]
    assert runner.stats.tail_skipped_tokens == sum(skipped) > 0
    assert runner.stats.tail_only_forwards == sum(n > 0 for n in skipped)
    runner.cache.check_invariants()


def test_runner_chunks_within_the_window_are_exact() -> None:
    """Chunks no longer than the window skip nothing: exact output, not flagged; a later hit
    on that prefix is not flagged either (nothing was ever skipped)."""
    runner = make_runner(chunk=16)
    prompt = TOKENS[:60]
    res = runner.generate([prompt, prompt + [1, 2, 3]], SamplingParams(max_new_tokens=6))
    assert res[0].output == reference_generate(weights(SHORT_SHARED), prompt, 6)
    assert res[1].cached_tokens > 0
    assert not res[0].approximate and not res[1].approximate
    assert runner.stats.tail_skipped_tokens == 0 and runner.stats.tail_only_forwards == 0


def test_runner_tail_only_rejections() -> None:
    """A model without sharing, or with nothing after its last KV source, cannot run tail-only;
    prompt logprobs under tail-only are refused at submit (typed, nothing queued)."""
    with pytest.raises(ValueError, match="kv_sources"):
        make_runner(cfg=SHORT_SHARED.unshared())
    last = preset("tiny", compress_ratios=(0, 4, 128), kv_sources=(1, 2), window=128)
    with pytest.raises(ValueError, match="no layer comes after"):
        make_runner(cfg=last, chunk=16, page=16)
    runner = make_runner()
    with pytest.raises(UnsupportedRequestError, match="prompt_logprobs"):
        runner.submit(TOKENS[:10], SamplingParams(prompt_logprobs=True))
    assert runner.num_pending == 0
    res = runner.generate([TOKENS[:10]], SamplingParams(prompt_logprobs=True))
    assert res[0].finish_reason == "error" and "tail-only" in res[0].error
    with pytest.raises(InvalidRequestError, match="prompt_logprobs must be a bool"):
        SamplingParams(prompt_logprobs=1)  # type: ignore[arg-type]


# -- prompt logprobs (exact runner) ----------------------------------------------------------------


def test_prompt_logprobs_equal_the_reference() -> None:
    """Every prompt token's log-probability from the chunked prefill forwards equals the
    reference's log-softmax; a request sharing a cached prefix still computes (and reports)
    its whole prompt, while a plain request next to it reuses the cache."""
    runner = make_runner(tail_only=False, chunk=24)
    w = weights(SHORT_SHARED)
    p1 = TOKENS[:73]  # last chunk of 1 token: its only row predicts no prompt token
    p2 = TOKENS[:50] + TOKENS[200:230]
    want = {}
    for p in (p1, p2):
        logp = torch.log_softmax(reference_logits(w, p).double(), dim=-1)
        want[len(p)] = [None] + [float(logp[i, p[i + 1]]) for i in range(len(p) - 1)]
    params = SamplingParams(max_new_tokens=3, prompt_logprobs=True)
    r1 = runner.generate([p1], params)[0]
    assert r1.prompt_logprobs == want[73]
    r2, r3 = runner.generate([p2, p2], [params, SamplingParams(max_new_tokens=3)])
    assert r2.prompt_logprobs == want[80] and r2.cached_tokens == 0
    assert r3.prompt_logprobs is None and r3.cached_tokens > 0
    assert r1.output == reference_generate(w, p1, 3) and r2.output == r3.output


# -- the benchmark stays runnable ----------------------------------------------------------------


def test_tail_only_bench_runs(tmp_path) -> None:
    """bench/tail_only.py on a short prompt (no timing asserted): tokens were skipped, the
    divergence and the memory saving are reported, the JSON is written."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "tail_only.py"
    spec = importlib.util.spec_from_file_location("tail_only_bench", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["tail_only_bench"] = bench
    spec.loader.exec_module(bench)
    out = tmp_path / "tail.json"
    argv = ["--device", "cpu", "--prompt-len", "200", "--requests", "1", "--chunk-tokens", "160"]
    argv += ["--decode-tokens", "2", "--repeats", "1", "--page-size", "16", "--json", str(out)]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["skipped_token_fraction"] == pytest.approx((160 - 128) / 200)
    assert result["exact_prefill_s"] > 0 and result["tail_only_prefill_s"] > 0
    assert result["approximate_flagged"] == 1.0 and result["max_logit_diff"] > 0
    saving = {m["model"]: m["cached_token_saving"] for m in result["memory"]}
    assert saving["tiny-shared"] > 0.7 and saving["flash-shared"] > 0.7


def test_cli_tail_only(capsys: pytest.CaptureFixture[str]) -> None:
    """``shadowradix run --tail-only`` on a shared preset reports what it skipped; on a model
    without sharing it exits 2 with the reason."""
    from adapters.cli.main import main

    prompt = "x" * 300  # one 256-token chunk, then 45 tokens (+ BOS)
    argv = ["run", prompt, "--model", "tiny-shared", "--device", "cpu", "--max-new-tokens", "2"]
    assert main(argv + ["--tail-only", "--quiet", "--full-tokens", "4096"]) == 0
    out = capsys.readouterr().out
    assert "tail-only prefill: 128 tokens skipped after layer 2 in 1 forwards" in out
    assert "1 of 1 results approximate" in out
    assert main(["run", "x", "--device", "cpu", "--tail-only"]) == 2
    assert "kv_sources" in capsys.readouterr().err
