"""The runner serving hits by encoder-side bounded replay (``CacheConfig(bounded_replay=True)``).

Every replayed result must equal the explicit replay oracle (adapters/model/replay_reference.py):
greedy tokens, and the logits of the first generated position bit for bit (float64 on the CPU);
it must be flagged ``approximate``, and every unflagged result must equal the cold dense
reference (the flag hides nothing). Every runner here runs over a debug cache
(``check_invariants`` after every mutating call) and is checked again after every step.
"""

from __future__ import annotations

import argparse
import functools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from small_models import CFG, SHORT, SHORT_SHARED, SMALL, one_thread

from adapters.cli.main import add_run_parser
from adapters.cli.run_command import build_runner, summary
from adapters.engine.runner import GenerationResult, Runner
from adapters.engine.sampling import SamplingParams
from adapters.model.reference import reference_generate, reference_logits
from adapters.model.replay_reference import SegmentedReference, replay_reference_generate
from adapters.model.weights import init_weights
from shadowradix import CacheConfig, ConfigError, WindowSource

pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")


_one_thread = pytest.fixture(autouse=True, scope="module")(one_thread)


@functools.cache
def weights_for(cfg):
    return init_weights(cfg, "cpu", torch.float64)


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def make_runner(cfg=CFG, page=16, full_pages=200, swa_pages=40, chunk=37, **kw) -> Runner:
    cc = cfg.cache_config(
        page_size=page,
        full_capacity=page * full_pages,
        swa_capacity=page * swa_pages,
        bounded_replay=True,
        debug=True,
    )
    kw.setdefault("graph_decode", False)
    return Runner(
        cfg,
        cc,
        device="cpu",
        dtype=torch.float64,
        weights=weights_for(cfg),
        chunk_tokens=chunk,
        **kw,
    )


def run_checked(runner: Runner, prompts, params) -> list[GenerationResult]:
    """`generate` with the cache's invariants checked after every step."""

    def check(r: Runner, done) -> None:
        r.cache.check_invariants()
        assert len(r.cache.requests) == len(r._running)

    return runner.generate(prompts, params, on_step=check)


def assert_drained(runner: Runner) -> None:
    st = runner.cache.stats()
    assert runner.num_pending == 0 and st.num_requests == 0
    assert st.full.held_pages == 0 and st.swa.held_pages == 0
    runner.cache.check_invariants()


def first_logits(runner: Runner) -> dict[int, torch.Tensor]:
    """Captures the logits of every request's first generated position."""
    seen: dict[int, torch.Tensor] = {}

    def hook(results: list[GenerationResult], logits: torch.Tensor) -> None:
        for res, row in zip(results, logits):
            if not res.output:
                seen[res.request_id] = row.clone()

    runner.on_logits = hook
    return seen


# -- replayed hits equal the oracle ---------------------------------------------------------------


@pytest.mark.parametrize(
    "page,chunk,graph",
    [(1, 37, False), (4, 37, True), (16, 37, False), (16, 300, True), (64, 50, False)],
)
def test_replayed_hits_equal_oracle_are_flagged_and_differ_from_cold(
    page: int, chunk: int, graph: bool
) -> None:
    """A cold request caches a 300-token prefix; every window is tombstoned; three requests
    sharing the prefix arrive together: their replays are batched (and sliced when the chunk
    budget is smaller than the window), then they prefill and decode (paged or graph)."""
    swa = -(-(3 * (128 + chunk) + 8 * page) // page) + 4
    runner = make_runner(page=page, full_pages=-(-3000 // page), swa_pages=swa, chunk=chunk,
                         max_running=4, graph_decode=graph)  # fmt: skip
    prefix = tokens(1, 300)
    first = run_checked(runner, [prefix], SamplingParams(max_new_tokens=2))[0]
    assert not first.approximate and first.output == reference_generate(runner.weights, prefix, 2)
    runner.cache.evict(swa_tokens=10**6)
    prompts = [prefix + [k] + tokens(10 + k, 20 + 9 * k) for k in range(3)]
    matches = [runner.cache.match_prefix(p[:-1]) for p in prompts]
    assert all(m.window is WindowSource.REPLAY for m in matches)
    seen = first_logits(runner)
    n = 5
    results = run_checked(runner, prompts, SamplingParams(max_new_tokens=n))
    for p, m, res in zip(prompts, matches, results):
        assert res.approximate and res.cached_tokens == m.hit_len == m.prefix_len - 128
        assert res.output == replay_reference_generate(
            runner.weights, p, m.prefix_len, m.replay_start, n
        )
        oracle = SegmentedReference(runner.weights)
        oracle.extend(p[: m.prefix_len])
        oracle.replay(m.replay_start)
        want = oracle.extend(p[m.prefix_len :])[-1].float()
        assert torch.equal(seen[res.request_id], want), "first logits == the oracle, bit for bit"
        cold = reference_logits(runner.weights, p)[-1].float()
        assert float((seen[res.request_id] - cold).abs().max()) > 1e-9
    st = runner.stats
    assert (st.replayed_hits, st.replayed_tokens, st.approximate_results) == (3, 3 * 128, 3)
    assert st.prefill_tokens == 300 + sum(len(p) - m.prefix_len for p, m in zip(prompts, matches))
    cs = runner.cache.stats()
    assert (cs.replayed_hits, cs.replayed_tokens) == (3, 3 * 128)
    assert_drained(runner)


@pytest.mark.parametrize("page,graph", [(4, False), (16, True)])
def test_small_swa_pool_replays_and_flags_honestly(page: int, graph: bool) -> None:
    """Six 200-token system prompts, each cached by a cold first request, then follow-ups
    arriving round-robin over the groups: the small SWA pool tombstones the cached windows, so
    follow-ups are served by live hits (exact) or replayed hits. Every flagged result equals
    the replay oracle over the exact cached prefix, every unflagged one the cold reference."""
    groups = [tokens(100 + g, 200) for g in range(6)]
    swa = -(-(2 * (128 + 37) + 8 * page) // page)
    runner = make_runner(page=page, full_pages=-(-6000 // page), swa_pages=swa, chunk=37,
                         max_running=2, graph_decode=graph)  # fmt: skip
    n = 4
    params = SamplingParams(max_new_tokens=n)
    firsts = run_checked(runner, groups, params)
    assert not any(r.approximate for r in firsts)
    follow = [groups[k % 6] + [k] + tokens(200 + k, 5 + k % 4) for k in range(12)]
    results = run_checked(runner, follow, params)
    cached = 200 // page * page
    for p, res in zip(follow, results):
        if res.approximate:
            want = replay_reference_generate(runner.weights, p, cached, cached - 128, n)
        else:
            want = reference_generate(runner.weights, p, n)
        assert res.output == want, (len(p), res.cached_tokens, res.approximate)
    st = runner.stats
    assert st.preemptions == 0, "a preempted request's lineage would need the oracle's fork"
    assert st.replayed_hits >= 3, st
    assert st.approximate_results == sum(r.approximate for r in results) == st.replayed_hits
    assert runner.cache.stats().evicted.nodes_tombstoned > 0
    assert_drained(runner)


def test_hisparse_with_replay_equals_resident_and_oracle() -> None:
    """HiSparse (C4 KV in a host mirror, a device buffer of a few pages): the replay is cut
    into slices whose working set fits the buffer; outputs equal the resident runner's and the
    oracle."""
    prefix = tokens(3, 300)
    prompts = [prefix + [k] + tokens(30 + k, 25) for k in range(2)]
    outs = []
    for pages in (None, SMALL["index_topk"] + 9):
        runner = make_runner(page=16, swa_pages=40, chunk=64, hisparse_pages=pages)
        run_checked(runner, [prefix], SamplingParams(max_new_tokens=2))
        runner.cache.evict(swa_tokens=10**6)
        res = run_checked(runner, prompts, SamplingParams(max_new_tokens=4))
        assert all(r.approximate for r in res) and runner.stats.replayed_hits == 2
        outs.append([r.output for r in res])
        if runner.offload is not None:
            assert runner.offload.stats.swap_in_pages > 0
            runner.offload.drain()
            runner.offload.coordinator.check_invariants()
        assert_drained(runner)
    assert outs[0] == outs[1]
    for p, out in zip(prompts, outs[0]):
        assert out == replay_reference_generate(weights_for(CFG), p, 288, 160, 4)


def test_preempted_replayed_request_is_requeued_and_stays_flagged() -> None:
    """Replayed requests that outgrow the full pool while decoding are preempted (requeued,
    re-admitted later); every result is flagged, the pools drain."""
    prefix = tokens(4, 40)
    runner = make_runner(cfg=SHORT, page=4, full_pages=50, swa_pages=40, chunk=16, max_running=3)
    run_checked(runner, [prefix], SamplingParams(max_new_tokens=2))
    runner.cache.evict(swa_tokens=10**6)
    prompts = [prefix + [k] + tokens(40 + k, 20) for k in range(3)]
    res = run_checked(runner, prompts, SamplingParams(max_new_tokens=60))
    assert runner.stats.preemptions > 0 and runner.stats.replayed_hits >= 3
    assert all(r.finish_reason == "length" and len(r.output) == 60 for r in res)
    assert all(r.approximate for r in res)
    assert_drained(runner)


# -- unsupported combinations and the CLI ---------------------------------------------------------


def test_replay_with_speculation_is_refused_by_the_config() -> None:
    with pytest.raises(ConfigError, match="bounded_replay cannot be combined with speculative"):
        CacheConfig(
            page_size=16,
            full_capacity=16 * 40,
            swa_capacity=16 * 20,
            speculative=True,
            bounded_replay=True,
        )
    runner = make_runner()  # a replaying runner is accepted (the runner refused it before)
    assert runner.cache.config.bounded_replay and not runner.cache.config.speculative


def test_cli_bounded_replay_flag_and_summary() -> None:
    parser = argparse.ArgumentParser()
    add_run_parser(parser.add_subparsers(dest="command"))
    argv = ["run", "--bounded-replay", "--model", "tiny", "--device", "cpu", "--page-size", "16"]
    argv += ["--layers", "4"]
    args = parser.parse_args(argv + ["--swa-tokens", "1024", "--chunk-tokens", "64"])
    runner = build_runner(args)
    assert runner.cache.config.bounded_replay
    prefix = tokens(5, 200)
    params = SamplingParams(max_new_tokens=2)
    done = runner.generate([prefix], params)
    assert "bounded replay" not in summary(runner, done, 1.0)
    runner.cache.evict(swa_tokens=10**6)
    done += runner.generate([prefix + [1, 2, 3]], params)
    text = summary(runner, done, 1.0)
    assert "bounded replay (approximate): 1 replayed hits, 128 window tokens recomputed" in text
    assert "1 of 2 results approximate" in text


# -- model-based: random arrivals, steps and window tombstoning -----------------------------------

#: group prefixes, cached exactly by a warm-up (the SHORT model: window 16, C4 + C16)
GROUPS = [tokens(300 + n, n) for n in (24, 37, 50)]


class ReplayRunnerMachine(RuleBasedStateMachine):
    """A replaying runner under random arrivals and SWA tombstoning. Every suffix starts with
    a marker token no other request uses, and the full pool never evicts, so every request
    reuses (at most) its group prefix's pages, computed exactly by the warm-up: a replayed
    request's oracle is then `replay_reference_generate` over its admission match.

    After every rule: the cache's invariants; every unflagged finished result equals the cold
    reference; every flagged one was admitted by a replay, and (if never preempted) equals the
    replay oracle."""

    replays_checked = {False: 0, True: 0}  # by V4.1 sharing

    def __init__(self) -> None:
        super().__init__()
        self.runner: Runner | None = None
        self.submitted: dict[int, tuple[list[int], int]] = {}
        self.admissions: dict[tuple[int, ...], list] = {}
        self.unchecked: list[GenerationResult] = []
        self.markers = iter(range(256))

    @initialize(
        page=st.sampled_from([1, 2, 4, 8]),
        chunk=st.sampled_from([3, 7, 16]),
        max_running=st.integers(1, 3),
        extra_swa=st.integers(0, 12),
        graph=st.booleans(),
        shared=st.booleans(),
    )
    def setup(self, page, chunk, max_running, extra_swa, graph, shared) -> None:
        self.cfg = SHORT_SHARED if shared else SHORT  # V4.1 sharing, or every layer its own
        swa = -(-(chunk + SHORT.window + 2 * page) // page) + extra_swa // page
        self.runner = make_runner(cfg=self.cfg, page=page, full_pages=-(-4000 // page),
                                  swa_pages=swa, chunk=chunk, max_running=max_running,
                                  graph_decode=graph)  # fmt: skip
        for g in GROUPS:  # max_new_tokens=1 commits (and caches) the prompt only
            assert not self.runner.generate([g], SamplingParams(max_new_tokens=1))[0].approximate
        admit = self.runner.cache.admit

        def recording(tokens_, match=None):
            self.admissions.setdefault(tuple(int(t) for t in tokens_), []).append(match)
            return admit(tokens_, match)

        self.runner.cache.admit = recording  # type: ignore[method-assign]

    @rule(group=st.integers(0, len(GROUPS) - 1), suffix=st.integers(1, 6), n=st.integers(1, 4))
    def submit(self, group, suffix, n) -> None:
        assert self.runner is not None
        marker = next(self.markers)
        prompt = GROUPS[group] + [marker] + tokens(marker, suffix - 1)
        rid = self.runner.submit(prompt, SamplingParams(max_new_tokens=n))
        self.submitted[rid] = (prompt, n)

    @precondition(lambda self: self.runner is not None and self.runner.num_pending > 0)
    @rule(n=st.integers(1, 4))
    def step(self, n) -> None:
        assert self.runner is not None
        for _ in range(n):
            self.unchecked += self.runner.step()

    @precondition(lambda self: self.runner is not None)
    @rule()
    def tombstone_windows(self) -> None:
        assert self.runner is not None
        self.runner.cache.evict(swa_tokens=10**6)  # what other traffic does to a small pool

    @invariant()
    def consistent(self) -> None:
        if self.runner is None:
            return
        self.runner.cache.check_invariants()
        assert len(self.runner.cache.requests) == len(self.runner._running)
        while self.unchecked:
            self._check(self.unchecked.pop())

    def _check(self, res: GenerationResult) -> None:
        prompt, n = self.submitted[res.request_id]
        assert res.finish_reason == "length" and len(res.output) == n
        w = weights_for(self.cfg)
        if not res.approximate:
            assert res.output == reference_generate(w, prompt, n), "unflagged yet not exact"
            return
        matches = self.admissions[tuple(prompt)]
        assert matches[0].is_replay or res.preemptions, "flagged without a replay"
        if res.preemptions == 0:
            m = matches[0]
            want = replay_reference_generate(w, prompt, m.prefix_len, m.replay_start, n)
            assert res.output == want
            ReplayRunnerMachine.replays_checked[self.cfg is SHORT_SHARED] += 1

    def teardown(self) -> None:
        if self.runner is None:
            return
        for _ in range(2_000):
            if not self.runner.num_pending:
                break
            self.unchecked += self.runner.step()
        self.consistent()
        assert_drained(self.runner)


_profile = settings.default
TestReplayRunnerMachine = ReplayRunnerMachine.TestCase
TestReplayRunnerMachine.settings = settings(
    _profile,
    max_examples=40 if _profile.max_examples > 150 else 6,
    stateful_step_count=30 if _profile.max_examples > 150 else 12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def test_machine_really_replays() -> None:
    """The machine checks replayed results against the oracle, with and without sharing."""
    before = dict(ReplayRunnerMachine.replays_checked)
    run_state_machine_as_test(
        ReplayRunnerMachine,
        settings=settings(
            max_examples=6,
            stateful_step_count=15,
            derandomize=True,
            database=None,  # derandomized guards replay no saved examples of other runs
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    after = ReplayRunnerMachine.replays_checked
    assert after[False] > before[False] and after[True] > before[True], (before, after)
