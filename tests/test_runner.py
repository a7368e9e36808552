"""End-to-end tests of adapters/engine/runner.py: continuous batching over a `ShadowRadixCache` must
produce exactly the greedy tokens of the dense reference (float64 on the CPU: bit-identical
logits), whatever the chunking, batching, prefix reuse, eviction and preemption.

Every runner a test builds through the ``make_runner`` fixture is checked at teardown: nothing
pending, no active cache request, and ``check_invariants()`` passes (every cache here also runs
with ``debug=True``, i.e. check_invariants after every mutating call).

Tests named ``test_regression_*`` pin down bugs a review found in adapters/ (now fixed).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from small_models import CFG, SHORT

from adapters.engine.runner import GenerationResult, Runner
from adapters.engine.sampling import SamplingParams
from adapters.memory.device import DeviceError, resolve_device
from adapters.model.reference import reference_generate
from adapters.model.weights import init_weights
from shadowradix import InvalidRequestError

pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matrices: torch's intra-op threads only add synchronisation."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.cache
def weights_for(cfg):
    return init_weights(cfg, "cpu", torch.float64)


_REF: dict[tuple, list[int]] = {}


def ref(prompt: list[int], n: int, cfg=CFG) -> list[int]:
    """Greedy reference continuation (cached; a longer one answers shorter queries)."""
    key = (cfg, tuple(prompt))
    have = _REF.get(key, [])
    if len(have) < n:
        have = reference_generate(weights_for(cfg), list(prompt), n)
        _REF[key] = have
    return have[:n]


def rand_tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, 256, n).tolist()


def P(n: int, variant: int = 0) -> list[int]:
    """A fixed random prompt of length ``n``: tests share prompts, hence reference runs."""
    return rand_tokens(np.random.default_rng(1_000 * n + variant), n)


def assert_clean(runner: Runner) -> None:
    assert runner.num_pending == 0
    st = runner.cache.stats()
    assert st.num_requests == 0 and runner.cache.requests == ()
    assert st.full.held_pages == 0 and st.swa.held_pages == 0
    runner.cache.check_invariants()


@pytest.fixture
def make_runner():
    """Factory of float64 CPU runners over a debug cache; every runner is checked for a clean
    final state after the test."""
    made: list[Runner] = []

    def make(
        cfg=CFG,
        page=16,
        full_pages=64,
        swa_pages=24,
        chunk=37,
        max_running=8,
        graph_decode=False,
        share_prefills=True,
        **cache_kw,
    ) -> Runner:
        cc = cfg.cache_config(
            page_size=page,
            full_capacity=page * full_pages,
            swa_capacity=page * swa_pages,
            debug=True,
            **cache_kw,
        )
        r = Runner(
            cfg,
            cc,
            device="cpu",
            dtype=torch.float64,
            weights=weights_for(cfg),
            chunk_tokens=chunk,
            max_running=max_running,
            graph_decode=graph_decode,
        )
        assert (r.decoder is not None) == graph_decode
        r.share_prefills = share_prefills
        made.append(r)
        return r

    yield make
    for r in made:
        assert_clean(r)


def check_greedy(results: list[GenerationResult], prompts: list[list[int]], n: int, cfg=CFG):
    assert len(results) == len(prompts)
    for i, (res, p) in enumerate(zip(results, prompts)):
        assert res.prompt == p
        assert res.error is None and res.finish_reason == "length", (i, res.finish_reason)
        assert res.output == ref(p, n, cfg), f"request {i} (len {len(p)}) != reference"


# -- prefix reuse ---------------------------------------------------------------------------------


@pytest.mark.parametrize("graph_decode", [False, True], ids=["paged", "graph"])
def test_shared_system_prefix_in_waves(make_runner, graph_decode: bool) -> None:
    """Wave 1: the 200-token system prompt alone; once its prefill is done (published with
    cache_unfinished) wave 2 arrives while it is still decoding: system prompt + various user
    suffixes; they resume after 192 cached tokens (the deepest page boundary). Wave 3:
    follow-up turns (prompt + answer + new message) of wave 2 resume deeper. Every output
    equals the reference."""
    rng = np.random.default_rng(11)
    system = P(200, 1)
    runner = make_runner(
        full_pages=160, swa_pages=40, chunk=37, max_running=8, graph_decode=graph_decode
    )
    n = 8
    runner.submit(system, SamplingParams(max_new_tokens=n))
    done: list[GenerationResult] = []
    while runner.stats.decode_tokens == 0:  # until the system prompt's prefill completed
        done += runner.step()
    assert runner.cache.stats().cached_tokens >= 192
    wave2 = [system + rand_tokens(rng, k) for k in (1, 7, 20, 45, 60)]
    for p in wave2:
        runner.submit(p, SamplingParams(max_new_tokens=n))
    done += runner.run()
    by_id = {r.request_id: r for r in done}
    assert by_id[0].output == ref(system, n) and by_id[0].cached_tokens == 0
    res2 = [by_id[i + 1] for i in range(len(wave2))]
    check_greedy(res2, wave2, n)
    for r in res2:
        assert r.cached_tokens == 192, r.cached_tokens  # the deepest page boundary <= 200
    assert runner.cache.stats().hit_ratio > 0
    # wave 3: multi-turn follow-ups through generate()
    wave3 = [p + r.output + rand_tokens(rng, 9) for p, r in zip(wave2[:3], res2[:3])]
    res3 = runner.generate(wave3, SamplingParams(max_new_tokens=n))
    check_greedy(res3, wave3, n)
    for p, r in zip(wave2, res3):
        # the previous turn's window stays live at its last page boundary: a deeper hit
        assert r.cached_tokens >= (len(p) + n - 1) // 16 * 16 > 192
    st = runner.cache.stats()
    assert st.hit_tokens == sum(r.cached_tokens for r in res2 + res3)
    assert 0 < st.hit_ratio < 1


# -- chunking and batching ------------------------------------------------------------------------

# prompt lengths around page / group / window boundaries (one-token prompts: see the regression
# test)
LENGTHS = (3, 4, 5, 9, 16, 17, 127, 128, 129, 200, 257)
SHORT_LENGTHS = (2, 3, 4, 5, 8, 9, 17, 33, 64, 129)


@pytest.mark.parametrize(
    "page,chunk,lengths,graph_decode",
    [
        (16, 37, LENGTHS, False),
        (16, 37, LENGTHS, True),
        (4, 37, LENGTHS, False),
        (64, 37, LENGTHS, False),
        (1, 13, LENGTHS, False),
        (16, 1, SHORT_LENGTHS, False),
        (4, 3, SHORT_LENGTHS, False),
        (4, 3, SHORT_LENGTHS, True),
    ],
    ids=lambda v: "L" if isinstance(v, tuple) else str(v),
)
def test_chunked_prefill_odd_chunks(
    make_runner, page: int, chunk: int, lengths, graph_decode: bool
) -> None:
    """Chunked prefill with odd chunk sizes; several prompts share a step's chunk budget.
    Decode runs either through the general paged path or the `GraphDecoder` (slots computed
    from raw batch state; eager on the CPU)."""
    prompts = [P(n) for n in lengths]
    swa_tokens = 128 + 2 * chunk + 4 * page  # roomy: the SWA-bound case is tested below
    runner = make_runner(
        page=page,
        full_pages=-(-2400 // page),
        swa_pages=2 * -(-swa_tokens // page),
        chunk=chunk,
        max_running=4,
        graph_decode=graph_decode,
    )
    results = runner.generate(prompts, SamplingParams(max_new_tokens=6))
    check_greedy(results, prompts, 6)
    assert runner.stats.prefill_tokens == sum(lengths)
    assert runner.stats.decode_tokens == 5 * len(prompts)  # the first token comes from prefill


def test_batched_decode(make_runner) -> None:
    """Six requests decode together: the decode forward batches >= 4 of them per step."""
    rng = np.random.default_rng(3)
    prompts = [rand_tokens(rng, n) for n in (5, 30, 64, 90, 131, 140)]
    runner = make_runner(full_pages=80, swa_pages=40, chunk=600 - 128 - 128, max_running=6)
    batch: list[int] = []
    last = [0]

    def on_step(r: Runner, done) -> None:
        batch.append(r.stats.decode_tokens - last[0])
        last[0] = r.stats.decode_tokens

    results = runner.generate(prompts, SamplingParams(max_new_tokens=10), on_step=on_step)
    check_greedy(results, prompts, 10)
    assert max(batch) == 6  # every request in one decode forward
    assert runner.stats.steps == len(batch) <= 11


def test_short_window_model(make_runner) -> None:
    """window 16 with C4 + C16 (many window/group rollovers per request), page 4, odd chunks,
    prefix reuse of a finished request's answer."""
    rng = np.random.default_rng(5)
    prompts = [rand_tokens(rng, n) for n in (3, 15, 16, 17, 33, 70)]
    runner = make_runner(cfg=SHORT, page=4, full_pages=200, swa_pages=100, chunk=11, max_running=4)
    res = runner.generate(prompts, SamplingParams(max_new_tokens=8))
    check_greedy(res, prompts, 8, SHORT)
    follow = [p + r.output + rand_tokens(rng, 5) for p, r in zip(prompts, res)]
    res2 = runner.generate(follow, SamplingParams(max_new_tokens=8))
    check_greedy(res2, follow, 8, SHORT)
    # the SWA pool is large enough that no window was tombstoned: each follow-up resumes at the
    # last page boundary of its previous turn's committed tokens (prompt + 7 decoded)
    assert runner.cache.stats().evicted.swa_pages == 0
    assert [r.cached_tokens for r in res2] == [(len(p) + 7) // 4 * 4 for p in prompts]


def test_short_window_model_under_swa_pressure(make_runner) -> None:
    """The same with a 24-page SWA pool: windows are tombstoned (hits lost), outputs exact."""
    rng = np.random.default_rng(6)
    prompts = [rand_tokens(rng, n) for n in (3, 15, 16, 17, 33, 70, 41, 90)]
    runner = make_runner(
        cfg=SHORT, page=4, full_pages=200, swa_pages=24, chunk=11, max_running=4, graph_decode=True
    )
    res = runner.generate(prompts, SamplingParams(max_new_tokens=8))
    check_greedy(res, prompts, 8, SHORT)
    follow = [p + r.output + rand_tokens(rng, 5) for p, r in zip(prompts, res)]
    check_greedy(runner.generate(follow, SamplingParams(max_new_tokens=8)), follow, 8, SHORT)
    assert runner.cache.stats().evicted.nodes_tombstoned > 0


# -- eviction and preemption ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "full_pages,swa_pages,preempts,graph_decode",
    [
        (14, 15, True, False),  # the full pool barely holds one request: eviction + preemption
        (60, 15, True, False),  # plenty of full pages; SWA holds about one request's window
        (16, 14, True, True),
        (20, 16, False, False),  # eviction only
    ],
)
def test_eviction_and_preemption_pressure(
    make_runner, full_pages: int, swa_pages: int, preempts: bool, graph_decode: bool
) -> None:
    """Pools barely above one request's need (page 16: a 200-token request + 8 new tokens needs
    13 full pages; one chunk of 37 plus the 128-window needs ~15 SWA pages): requests are
    preempted and cached prefixes evicted, yet outputs equal the reference. In-batch prefix
    sharing is off: with it the others wait for the first one's system prompt and the pools
    never run short (`test_prefix_sharing` covers it)."""
    rng = np.random.default_rng(5)
    system = rand_tokens(rng, 150)
    prompts = [system + rand_tokens(rng, int(k)) for k in rng.integers(5, 50, 6)]
    runner = make_runner(
        full_pages=full_pages,
        swa_pages=swa_pages,
        chunk=37,
        max_running=4,
        graph_decode=graph_decode,
        share_prefills=False,
    )
    results = runner.generate(prompts, SamplingParams(max_new_tokens=8))
    check_greedy(results, prompts, 8)
    ev = runner.cache.stats().evicted
    assert (runner.stats.preemptions > 0) == preempts
    assert runner.stats.preemptions == sum(r.preemptions for r in results)
    assert ev.full_pages + ev.swa_pages > 0
    assert runner.cache.stats().hit_tokens > 0  # the shared 150-token prefix was reused


def test_full_capacity_request_exactly_fits(make_runner) -> None:
    """prompt + max_new_tokens == full capacity is accepted and completes (alone or not)."""
    rng = np.random.default_rng(8)
    big = rand_tokens(rng, 16 * 14 - 6)
    small = rand_tokens(rng, 40)
    runner = make_runner(full_pages=14, swa_pages=16, chunk=37, max_running=4)
    results = runner.generate([small, big, small[:20]], SamplingParams(max_new_tokens=6))
    check_greedy(results, [small, big, small[:20]], 6)


# -- sampling -------------------------------------------------------------------------------------


def _sampled(make_runner, prompts, params, **kw) -> list[list[int]]:
    runner = make_runner(**kw)
    res = runner.generate(prompts, params)
    assert all(r.finish_reason == "length" for r in res)
    return [r.output for r in res]


def test_temperature_sampling_reproducible_and_seed_dependent(make_runner) -> None:
    rng = np.random.default_rng(21)
    prompts = [rand_tokens(rng, n) for n in (10, 40, 150)]
    hot = [SamplingParams(max_new_tokens=8, temperature=1.5, seed=7 + i) for i in range(3)]
    a = _sampled(make_runner, prompts, hot)
    b = _sampled(make_runner, prompts, hot)  # a separate runner
    assert a == b
    other = [SamplingParams(max_new_tokens=8, temperature=1.5, seed=1000 + i) for i in range(3)]
    assert _sampled(make_runner, prompts, other) != a
    # sampling really samples: not the greedy continuation
    assert any(out != ref(p, 8) for out, p in zip(a, prompts))


def test_sampling_preempted_requests_reproducible(make_runner) -> None:
    """Sampled outputs do not depend on whether a request was preempted."""
    rng = np.random.default_rng(22)
    system = rand_tokens(rng, 150)
    prompts = [system + rand_tokens(rng, k) for k in (5, 20, 35, 49)]
    params = [SamplingParams(max_new_tokens=8, temperature=0.9, seed=i) for i in range(4)]
    tight = make_runner(full_pages=14, swa_pages=15, chunk=37, max_running=4, share_prefills=False)
    res_tight = tight.generate(prompts, params)
    assert tight.stats.preemptions > 0
    roomy = make_runner(full_pages=100, swa_pages=40, chunk=37, max_running=4)
    res_roomy = roomy.generate(prompts, params)
    assert roomy.stats.preemptions == 0
    assert [r.output for r in res_tight] == [r.output for r in res_roomy]


def test_stop_token_ends_generation(make_runner) -> None:
    rng = np.random.default_rng(4)
    prompts = [rand_tokens(rng, n) for n in (12, 50, 130)]
    full = [ref(p, 10) for p in prompts]
    k = 3
    stop = full[0][k]
    first = full[0].index(stop)  # the stop token's first occurrence
    runner = make_runner()
    params = [SamplingParams(max_new_tokens=10, stop_token=stop)] + [
        SamplingParams(max_new_tokens=10, stop_token=None)
    ] * 2
    res = runner.generate(prompts, params)
    assert res[0].finish_reason == "stop"
    assert res[0].output == full[0][: first + 1] and res[0].output[-1] == stop
    for r, want in zip(res[1:], full[1:]):
        assert r.finish_reason == "length" and r.output == want
    # a stop token that never comes: runs to max_new_tokens
    never = next(t for t in range(256) if t not in full[1])
    res = runner.generate([prompts[1]], SamplingParams(max_new_tokens=10, stop_token=never))
    assert res[0].finish_reason == "length" and res[0].output == full[1]


# -- request validation ---------------------------------------------------------------------------

BAD_PROMPTS = {
    "empty": [],
    "negative": [-1],
    "vocab": [258],
    "vocab_mid": [5, 6, 300, 7],
    "not_ints": ["a", "b"],
    "none": None,
    "nan": [float("nan")],
}


@pytest.mark.parametrize("name", sorted(BAD_PROMPTS))
def test_submit_rejects_bad_prompt_and_changes_nothing(make_runner, name: str) -> None:
    runner = make_runner()
    runner.submit([1, 2, 3], SamplingParams(max_new_tokens=2))
    before = (runner.num_pending, list(runner._waiting), runner._next_id)
    with pytest.raises(InvalidRequestError):
        runner.submit(BAD_PROMPTS[name], SamplingParams(max_new_tokens=2))
    assert (runner.num_pending, list(runner._waiting), runner._next_id) == before
    res = runner.run()
    assert [r.output for r in res] == [ref([1, 2, 3], 2)]


def test_submit_rejects_request_beyond_full_capacity(make_runner) -> None:
    runner = make_runner(full_pages=14, swa_pages=16)
    cap = runner.cache.config.full_capacity
    pending = runner.num_pending
    with pytest.raises(InvalidRequestError, match="exceeds the full pool"):
        runner.submit([7] * (cap - 3), SamplingParams(max_new_tokens=4))
    with pytest.raises(InvalidRequestError):
        runner.submit([7] * (cap + 1), SamplingParams(max_new_tokens=1))
    assert runner.num_pending == pending
    runner.submit([7] * (cap - 4), SamplingParams(max_new_tokens=4))  # exactly fits
    assert runner.num_pending == pending + 1
    runner.run()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-1.0),
        dict(temperature=float("nan")),
        dict(temperature=float("inf")),
        dict(temperature="hot"),
        dict(max_new_tokens=0),
        dict(max_new_tokens=-3),
        dict(max_new_tokens=2.0),
        dict(max_new_tokens=True),
        dict(seed=1.5),
    ],
    ids=repr,
)
def test_bad_sampling_params_rejected(make_runner, kwargs) -> None:
    """Sampling parameters are validated when built (before any submit can queue them)."""
    runner = make_runner()
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)
    with pytest.raises(InvalidRequestError):
        SamplingParams(**{"max_new_tokens": 4, **kwargs})
    # and submit refuses anything that is not SamplingParams
    with pytest.raises(InvalidRequestError):
        runner.submit([1, 2, 3], kwargs)  # type: ignore[arg-type]
    assert runner.num_pending == 0


def test_generate_isolates_bad_prompts(make_runner) -> None:
    rng = np.random.default_rng(9)
    good = [rand_tokens(rng, n) for n in (20, 140, 7)]
    runner = make_runner(full_pages=20, swa_pages=16)
    cap = runner.cache.config.full_capacity
    prompts = [good[0], [], good[1], [5, 258], [3] * cap, good[2], [-2]]
    res = runner.generate(prompts, SamplingParams(max_new_tokens=5))
    assert len(res) == len(prompts)
    kinds = [r.finish_reason for r in res]
    assert kinds == ["length", "error", "length", "error", "error", "length", "error"]
    for r in res:
        if r.finish_reason == "error":
            assert r.error and r.output == [] and r.request_id == -1
    check_greedy([res[0], res[2], res[5]], good, 5)


# -- configuration and devices --------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_without_gpu_raises_device_error() -> None:
    cc = CFG.cache_config(page_size=16, full_capacity=16 * 20, swa_capacity=16 * 20)
    with pytest.raises(DeviceError, match="no CUDA GPU"):
        Runner(CFG, cc, device="cuda")
    with pytest.raises(DeviceError):
        resolve_device("cuda:0")
    assert resolve_device(None) == torch.device("cpu") == resolve_device("auto")


@pytest.mark.parametrize("device", ["tpu", "definitely-not-a-device", "meta", 3.5])
def test_resolve_device_rejects_unusable_devices(device) -> None:
    with pytest.raises(DeviceError):
        resolve_device(device)
    assert issubclass(DeviceError, ValueError)
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("page,chunk", [(1, 37), (16, 128), (64, 3)])
def test_smallest_accepted_swa_pool_prefills_a_long_prompt(make_runner, page, chunk) -> None:
    """The constructor's bound (chunk + window + 2 pages) is enough: a lone 520-token request
    prefills in chunks through an SWA pool of exactly that size (regression: before the runner
    published every chunk with cache_unfinished, the pool needed window + 2 chunks)."""
    swa_pages = -(-(chunk + CFG.window + 2 * page) // page)
    with pytest.raises(ValueError):  # one page less is refused up front
        make_runner(page=page, full_pages=-(-540 // page), swa_pages=swa_pages - 1, chunk=chunk)
    runner = make_runner(page=page, full_pages=-(-540 // page), swa_pages=swa_pages, chunk=chunk)
    prompt = [(7 * i) % 256 for i in range(520)]
    res = runner.generate([prompt], SamplingParams(max_new_tokens=2))
    assert res[0].output == ref(prompt, 2)


def test_runner_rejects_bad_construction() -> None:
    page = 16
    cc = CFG.cache_config(page_size=page, full_capacity=page * 20, swa_capacity=page * 12)
    # SWA 192 tokens cannot hold a 64-token chunk plus its 128-token window
    with pytest.raises(ValueError, match="lower chunk_tokens"):
        Runner(CFG, cc, device="cpu", dtype=torch.float64, chunk_tokens=64)
    with pytest.raises(ValueError):
        Runner(CFG, cc, device="cpu", dtype=torch.float64, chunk_tokens=0)
    with pytest.raises(ValueError):
        Runner(CFG, cc, device="cpu", dtype=torch.float64, chunk_tokens=8, max_running=0)
    # a cache config for another model (window / ratios) is refused
    with pytest.raises(ValueError, match="does not match"):
        Runner(SHORT, cc, device="cpu", dtype=torch.float64, chunk_tokens=8)
    with pytest.raises(DeviceError):
        Runner(CFG, cc, device="tpu", chunk_tokens=8)
    # bounded replay is executed (tests/test_replay_runner.py), with speculation refused by
    # CacheConfig


# -- bugs -----------------------------------------------------------------------------------------
# These use plain runners (not ``make_runner``): a buggy run may leave the runner dirty.


def plain_runner(chunk: int = 37) -> Runner:
    cc = CFG.cache_config(page_size=16, full_capacity=16 * 30, swa_capacity=16 * 30, debug=True)
    return Runner(
        CFG, cc, device="cpu", dtype=torch.float64, weights=weights_for(CFG), chunk_tokens=chunk
    )


# Regression (found by review, fixed): a one-token prompt makes Runner._admit call
# cache.match_prefix([]) -> InvalidRequestError out of step(); the request stays queued so every
# later step fails too (adapters/engine/runner.py _admit)
def test_regression_single_token_prompt() -> None:
    runner = plain_runner()
    res = runner.generate([[5], [1, 2, 3]], SamplingParams(max_new_tokens=3))
    assert [r.output for r in res] == [ref([5], 3), ref([1, 2, 3], 3)]


# Regression (found by review, fixed): Runner._validate converts tokens with int() and catches
# only TypeError/ValueError: an infinite token raises OverflowError (not InvalidRequestError),
# which also escapes generate()
def test_regression_infinite_token_rejected_as_invalid_request() -> None:
    runner = plain_runner()
    res = runner.generate([[1, 2, 3], [float("inf")]], SamplingParams(max_new_tokens=2))
    assert [r.finish_reason for r in res] == ["length", "error"]


# Regression (found by review, fixed): Runner._validate coerces non-int tokens with int(): 1.5 ->
# 1, True -> 1, '7' -> 7, the string '12' -> [1, 2] are silently accepted instead of raising
# InvalidRequestError ('must be a sequence of ints')
@pytest.mark.parametrize("prompt", [[1.5, 2.0], "12", ["7"], [True]], ids=repr)
def test_regression_non_integer_tokens_rejected(prompt) -> None:
    runner = plain_runner()
    with pytest.raises(InvalidRequestError):
        runner.submit(prompt, SamplingParams(max_new_tokens=1))


# Regression (found by review, fixed): Runner.generate zips prompts with a params sequence; a
# shorter params list silently drops the remaining prompts
def test_regression_generate_params_length_mismatch() -> None:
    runner = plain_runner()
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    try:
        res = runner.generate(prompts, [SamplingParams(max_new_tokens=2)])
    except (ValueError, InvalidRequestError):
        return  # refusing the mismatch would be fine too
    assert len(res) == len(prompts)


# Regression (found by review, fixed): Runner.generate after a direct submit(): run() returns the
# earlier request's result too and generate() raises KeyError (results[ids[res.request_id]]),
# losing that result
def test_regression_generate_after_submit() -> None:
    runner = plain_runner()
    runner.submit([1, 2, 3], SamplingParams(max_new_tokens=2))
    res = runner.generate([[4, 5, 6]], SamplingParams(max_new_tokens=2))
    assert [r.output for r in res] == [ref([4, 5, 6], 2)]
    earlier = runner.run()  # the request submitted before generate() is not lost
    assert [r.output for r in earlier] == [ref([1, 2, 3], 2)]


# Regression (found by review, fixed): SamplingParams accepts any finite temperature > 0; a
# subnormal one (5e-324) makes logits/T overflow and torch.multinomial raise RuntimeError mid-
# step (adapters/engine/sampling.py), leaving the request active
def test_regression_subnormal_temperature() -> None:
    runner = plain_runner()
    try:
        params = SamplingParams(max_new_tokens=2, temperature=5e-324)
    except InvalidRequestError:
        return  # rejecting it at validation would be a fix
    assert math.isfinite(params.temperature)
    res = runner.generate([[1, 2, 3]], params)
    assert res[0].finish_reason == "length"
