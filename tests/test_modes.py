"""Every pair of the runner's modes (and the triples that matter) either works and is tested
here, or is refused with `UnsupportedModeError` (adapters/engine/modes.py, docs/runner.md
"Mode combinations").

A working combination runs one workload on a tiny fp64 model on the CPU: requests ``A`` (32
tokens, longer than the window of 16: tail-only skips some) and ``C`` (12 tokens, priority 1,
sampled under ``SAMPLING``) together, then ``B``, which extends 28 tokens of ``A``: a live hit
on ``A``'s pages whose last window reaches the rows tail-only never wrote (poisoned, so an
unmasked read shows), or, under bounded replay (every window tombstoned first), a replayed
hit.
Greedy outputs must equal the dense oracle: the exact model's, the tail-only oracle's for the
chunks the runner ran (`reference_tail_only_generate`), the replay oracle's for a replayed
hit. With lossy cache formats (the fp64 oracles know none), or for a sampled request, outputs
must equal a plain runner's with the same formats and seeds. Every result an approximation
touched, and only those, is flagged. Under speculation with temperature > 0 (rejection
sampling: the target's distribution, not the same tokens) the sampled request is checked for
shape only; tests/test_rejection_sampling.py checks its distribution.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
import torch
from small_models import SMALL, one_thread

from adapters.engine.budget_runner import budget_runner, enable_rebalance
from adapters.engine.drafts import OracleDraft
from adapters.engine.modes import (
    COMBINATIONS,
    REFUSED,
    REQUIRES,
    TRIPLES,
    Mode,
    Modes,
    Support,
    UnsupportedModeError,
    check_modes,
    combination,
    refusals,
)
from adapters.engine.runner import Runner, SchedulePolicy
from adapters.engine.sampling import SamplingParams
from adapters.forward.memory_plan import step_memory
from adapters.memory.formats import CacheFormat
from adapters.memory.pools import pool_bytes
from adapters.model.model_config import preset
from adapters.model.reference import (
    reference_generate,
    reference_tail_only_generate,
    tail_only_computed,
)
from adapters.model.replay_reference import replay_reference_generate
from adapters.model.weights import init_weights
from shadowradix import ConfigError, WindowSource

pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")

M = Mode
#: window 16; KV sources 1 (C4) and 2 (C16), index source 1; layers 3 and 4 after the last
#: source (tail-only skips them); index_dim 32 so that FP4 indexer keys apply
SHARED = preset(
    "tiny-shared",
    **{**SMALL, "index_dim": 32, "window": 16, "compress_ratios": (0, 4, 16, 4, 0)},
    kv_sources=(1, 2),
    index_sources=(1,),
)
PLAIN = SHARED.unshared()
PAGE, FULL, SWA, CHUNK, NEW = 4, 512, 256, 64, 2
#: re-balanced pools: a budget of 48 full + 256 SWA tokens, split 5 SWA per full token to
#: start with, so A's admission beside C starves the full pool and re-balances once
REBALANCED = (48, 256, 5.0)
RNG = np.random.default_rng(17)
A = RNG.integers(0, 256, 32).tolist()
C = RNG.integers(0, 256, 12).tolist()
B = A[:28] + RNG.integers(0, 256, 2).tolist()  # its last window reaches A's holes
FORMATS = {M.INDEX_FP8: ("index_format", CacheFormat.FP8),
           M.INDEX_FP4: ("index_format", CacheFormat.FP4),
           M.SWA_FP8: ("swa_format", CacheFormat.FP8)}  # fmt: skip
#: modes that decide what the outputs are (the rest only execute them)
DEFINING = frozenset({M.SHARING, M.SAMPLING, *FORMATS})


_one_thread = pytest.fixture(autouse=True, scope="module")(one_thread)


@functools.cache
def weights(model):
    return init_weights(model, "cpu", torch.float64)


def closure(modes: frozenset[Mode]) -> frozenset[Mode]:
    """``modes`` with what each needs to be on at all (overlap: graph decode, ...)."""
    out = set(modes)
    for mode, (needed, _) in REQUIRES.items():
        if mode in out:
            out.add(needed)
    return frozenset(out)


@functools.cache
def oracle(model, prompt: tuple[int, ...]) -> list[int]:
    return reference_generate(weights(model), list(prompt), NEW)


def runner_kwargs(modes: frozenset[Mode]) -> dict[str, object]:
    """`Runner` arguments turning ``modes`` on (and nothing else)."""
    model = SHARED if M.SHARING in modes else PLAIN
    kw: dict[str, object] = {"graph_decode": M.GRAPH_DECODE in modes}
    if M.HISPARSE in modes:  # swap-ins, cut chunks; a paged verify step's 3 queries fit
        paged_verify = M.GRAPH_DECODE not in modes and (
            M.SPECULATION in modes or M.MTP_DRAFT in modes
        )
        topk = SMALL["index_topk"]
        kw["hisparse_pages"] = 3 * topk + 2 if paged_verify else topk + 1
    if M.OVERLAP in modes:
        kw["overlap"] = True
    if M.TAIL_ONLY in modes:
        kw["tail_only"] = True
    if M.SPECULATION in modes or M.MTP_DRAFT in modes:
        kw["speculative_tokens"] = 2
        if M.MTP_DRAFT not in modes:  # drafts that are often right: accepts and rejects
            table = {tuple(p): oracle(model, tuple(p)) for p in (A, B, C)}
            kw["draft"] = OracleDraft(table, accept_rate=0.7, seed=1)
    if M.MEMORY_BUDGET in modes:  # cuts A's 32-token chunk to 24 tokens
        kw["memory_budget"] = step_memory(model, torch.float64).peak(24, 48)
    if M.FCFS in modes:
        kw["schedule"] = SchedulePolicy.FCFS
    if M.MULTI_STREAM in modes:
        kw["multi_stream"] = True
    for mode, (name, fmt) in FORMATS.items():
        if mode in modes:
            kw[name] = fmt
    return kw


def build(modes: frozenset[Mode]) -> Runner:
    """A runner with exactly ``modes`` on: a `budget_runner` under ``REBALANCE``."""
    model = SHARED if M.SHARING in modes else PLAIN
    spec = M.SPECULATION in modes or M.MTP_DRAFT in modes
    cache = dict(bounded_replay=M.BOUNDED_REPLAY in modes, speculative=spec)
    kw = runner_kwargs(modes)
    common = dict(device="cpu", weights=weights(model), chunk_tokens=CHUNK, max_running=4)
    if M.REBALANCE not in modes:
        cc = model.cache_config(page_size=PAGE, full_capacity=FULL, swa_capacity=SWA, **cache)
        return Runner(model, cc, dtype=torch.float64, **common, **kw)  # type: ignore[arg-type]
    full, swa, ratio = REBALANCED
    cc = model.cache_config(page_size=PAGE, full_capacity=full, swa_capacity=swa)
    fmts = {k: v for k, v in kw.items() if k.endswith("_format")}
    budget = pool_bytes(model, cc, torch.float64, **fmts)  # type: ignore[arg-type]
    return budget_runner(
        model,
        budget,
        ratio,
        page_size=PAGE,
        dtype=torch.float64,
        cache_kwargs=cache,
        **common,
        **kw,
    )  # type: ignore[arg-type]


def workload(runner: Runner, modes: frozenset[Mode]):
    """Runs A and C together, then B; returns the results, B's match, the chunk sizes of every
    prefill forward per request (tail-only runners)."""
    chunks: dict[int, list[int]] = {}
    if runner.tail_only:
        count = runner._count_tail

        def spy(seqs, cs):
            for seq, chunk in zip(seqs, cs):
                chunks.setdefault(seq.result.request_id, []).append(len(chunk))
            count(seqs, cs)

        runner._count_tail = spy  # type: ignore[method-assign]
    temperature = 0.8 if M.SAMPLING in modes else 0.0
    params = [SamplingParams(NEW), SamplingParams(NEW, temperature=temperature, seed=5)]
    a, c = runner.generate([A, C], params, priorities=[0, 1])
    valid, last = runner.pools.late_swa_valid, runner.model.last_kv_source
    if valid is not None and last is not None and M.SWA_FP8 not in modes:
        holes = (~valid).nonzero().flatten()  # rows the later layers never wrote: +-1e3 by
        poison = torch.where(holes % 2 == 0, 1e3, -1e3)  # slot, so some row's score is huge
        for layer in range(last + 1, runner.model.num_layers):  # and an unmasked read shows
            runner.pools.swa[layer][holes] = poison[:, None].to(runner.pools.swa[layer].dtype)
    if M.BOUNDED_REPLAY in modes:
        runner.cache.evict(swa_tokens=10**6)  # every window tombstoned: B's hit replays
    match = runner.cache.match_prefix(B[:-1])
    (b,) = runner.generate([B], SamplingParams(NEW))
    return (a, b, c), match, chunks


@functools.cache
def plain_outputs(defining: frozenset[Mode]) -> tuple[list[int], ...]:
    """A, B, C of a runner with only the output-defining modes of a combination on."""
    results, _, _ = workload(build(defining), defining)
    return tuple(r.output for r in results)


def check(modes: frozenset[Mode]) -> None:
    runner = build(modes)
    (a, b, c), match, chunks = workload(runner, modes)
    assert all(r.finish_reason == "length" and len(r.output) == NEW for r in (a, b, c))
    w, model = runner.weights, runner.model
    lossy = bool(modes & set(FORMATS))
    tail = M.TAIL_ONLY in modes
    replayed = match.window is WindowSource.REPLAY
    assert replayed == (M.BOUNDED_REPLAY in modes)
    skipped = tail and any(n > model.window for n in chunks.get(a.request_id, []))
    assert a.approximate == skipped
    assert b.approximate == (replayed or skipped), (b.approximate, replayed, skipped)
    assert not c.approximate
    if not lossy:
        flags_a = tail_only_computed(chunks[a.request_id], model.window) if tail else None
        if flags_a is not None:
            assert a.output == reference_tail_only_generate(w, A, flags_a, NEW)
        else:
            assert a.output == oracle(model, tuple(A))
        if replayed:  # B's own 6 tokens are within the window: no skipping after the replay
            want_b = replay_reference_generate(w, B, match.prefix_len, match.replay_start, NEW)
        elif flags_a is not None:
            hit = b.cached_tokens
            flags_b = flags_a[:hit] + tail_only_computed(chunks[b.request_id], model.window)
            want_b = reference_tail_only_generate(w, B, flags_b, NEW)
        else:
            want_b = oracle(model, tuple(B))
        assert b.output == want_b
    elif not (tail or replayed):  # lossy formats: equal to the plain runner of those formats
        plain = plain_outputs(modes & DEFINING)
        assert [a.output, b.output] == list(plain[:2])
    sampled_spec = M.SAMPLING in modes and (M.SPECULATION in modes)
    if not sampled_spec:  # C never reuses or skips anything: the plain runner's C
        assert c.output == plain_outputs(modes & DEFINING)[2]
    assert all(0 <= t < model.vocab_size for t in c.output)
    if M.REBALANCE in modes and M.MEMORY_BUDGET not in modes:  # (under the budget this
        assert runner.stats.rebalances > 0  # workload happens not to starve a pool)
    assert runner.num_pending == 0
    runner.cache.check_invariants()


WORKING = sorted(
    (tuple(sorted(c.modes, key=list(Mode).index)) for c in COMBINATIONS.values() if c.works),
    key=lambda ms: [list(Mode).index(m) for m in ms],
)


@pytest.mark.parametrize("modes", WORKING, ids=lambda ms: "+".join(m.name for m in ms))
def test_a_combination_that_works(modes: tuple[Mode, ...]) -> None:
    check(closure(frozenset(modes)))


def test_the_table_has_every_pair_and_says_why() -> None:
    pairs = {frozenset(p) for p in itertools.combinations(Mode, 2)}
    assert pairs | {frozenset(t) for t in TRIPLES} == set(COMBINATIONS)
    assert all(c.why for c in COMBINATIONS.values())
    assert combination(M.TAIL_ONLY, M.BOUNDED_REPLAY).support is Support.APPROXIMATE
    assert combination(M.GRAPH_DECODE, M.SPECULATION).support is Support.EXACT
    assert combination(M.INDEX_FP8, M.INDEX_FP4).support is Support.ONE_OPTION
    for pair in REFUSED:
        assert combination(*pair).support is Support.REFUSED
    for triple in TRIPLES:  # a listed triple contains no refused pair
        assert combination(*triple).works


def _refused_build(pair: tuple[Mode, Mode]) -> Runner:
    modes = frozenset(pair)
    if M.MTP_DRAFT in modes:
        modes = modes | {M.SPECULATION}
    return build(modes)


@pytest.mark.parametrize("pair", list(REFUSED), ids=lambda p: f"{p[0].name}+{p[1].name}")
def test_a_refused_pair_raises_before_anything_is_allocated(pair, monkeypatch) -> None:
    """The pair on (and what it needs): `UnsupportedModeError` naming it (or an earlier refused
    pair it implies), raised before the cache or a pool exists; speculation with bounded
    replay is refused by `CacheConfig` already."""
    assert any(e.modes == pair for e in refusals(Modes(frozenset(pair), 2, 16)))
    with pytest.raises(UnsupportedModeError) as raised:
        check_modes(Modes(frozenset(pair), 2, 16))
    assert pair[0].value in str(raised.value) and pair[1].value in str(raised.value)
    if M.BOUNDED_REPLAY in pair:
        with pytest.raises(ConfigError, match="bounded_replay cannot be combined"):
            _refused_build(pair)
        return

    def allocated(*args, **kwargs):
        raise AssertionError("allocated before the modes were checked")

    monkeypatch.setattr("adapters.engine.runner.ShadowRadixCache", allocated)
    monkeypatch.setattr("adapters.engine.budget_runner.budget_cache_config", allocated)
    with pytest.raises(UnsupportedModeError) as raised:
        _refused_build(pair)
    assert raised.value.modes in REFUSED and set(raised.value.modes) <= set(pair) | {M.SPECULATION}


def test_what_a_mode_needs_and_the_verify_length_under_tail_only() -> None:
    """Overlap without graph decode, tail-only without sharing: refused, typed; a verify step
    longer than the window under tail-only would run tail-only: refused."""
    with pytest.raises(UnsupportedModeError, match="needs the graph decoder: the paged"):
        Runner(PLAIN, PLAIN.cache_config(page_size=PAGE, full_capacity=FULL, swa_capacity=SWA),
               device="cpu", graph_decode=False, overlap=True, chunk_tokens=CHUNK)  # fmt: skip
    with pytest.raises(UnsupportedModeError, match="kv_sources"):
        build(frozenset({M.TAIL_ONLY}))
    modes = Modes(frozenset({M.TAIL_ONLY, M.SHARING, M.SPECULATION}), 16, 16)
    with pytest.raises(UnsupportedModeError, match="verify step of 17 tokens"):
        check_modes(modes)
    assert check_modes(Modes(modes.active, 15, 16)) is not None


def test_enable_rebalance_on_a_hisparse_runner_is_refused() -> None:
    runner = build(frozenset({M.HISPARSE}))
    with pytest.raises(UnsupportedModeError, match="HiSparse with run-time pool re-balance is"):
        enable_rebalance(runner, 10**9)
    assert runner.pool_balance is None


def test_runner_modes_resolve_the_defaults() -> None:
    runner = build(frozenset({M.SHARING, M.TAIL_ONLY, M.SPECULATION}))
    assert runner.modes.active == {M.SHARING, M.TAIL_ONLY, M.SPECULATION}
    assert M.GRAPH_DECODE not in build(frozenset({M.HISPARSE})).modes
