"""Overlap scheduling (#14 item 3): the host schedules decode step N+1 while step N runs, learns
N's tokens one step late, and applies stop tokens one step late. On the CPU there is no
asynchrony but the logic is the same: greedy outputs, finish reasons and the cache's contents
equal a serialised run's (stops at every step, ``max_new_tokens=1``, requests joining and
leaving, prefill and decode mixed, preemption, failures); what cannot overlap runs serialised,
visibly."""

from __future__ import annotations

import argparse
import functools
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from small_models import CFG

from adapters.cli.run_command import summary
from adapters.engine.runner import FailureStage, Runner
from adapters.engine.sampling import SamplingParams

PAGE = 16


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _runner(overlap: bool, full_pages: int = 80, **kw) -> Runner:
    cc = CFG.cache_config(page_size=PAGE, full_capacity=PAGE * full_pages,
                          swa_capacity=PAGE * 32, debug=True)  # fmt: skip
    kw = {"chunk_tokens": 64, "max_running": 4, "graph_decode": True, **kw}
    runner = Runner(CFG, cc, device="cpu", dtype=torch.float64, overlap=overlap, **kw)
    runner.share_prefills = False
    return runner


def _prompts(lengths, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, n).tolist() for n in lengths]


def _tree(runner: Runner) -> tuple:
    """The cache's contents, page ids aside: every tree page as (its token prefix, SWA live),
    and the pools' accounting."""
    pages = set()
    for node in runner.cache._tree.nodes():
        path = np.concatenate([n.tokens for n in node.path_from_root() if not n.is_root])
        first = len(path) - len(node.tokens)
        for j in range(node.num_pages):
            end = first + (j + 1) * PAGE
            pages.add((tuple(path[:end].tolist()), j >= node.live_from))
    st = runner.cache.stats()
    return pages, st.full, st.swa


def _both(prompts, params, **kw):
    """The results of a serialised and an overlapped run, after checking their caches agree."""
    runs = []
    for overlap in (False, True):
        runner = _runner(overlap, **kw)
        results = runner.generate(prompts, params)
        runner.cache.check_invariants()
        assert runner.num_pending == 0 and runner.cache.requests == ()
        runs.append((runner, results))
    (plain, a), (late, b) = runs
    assert [(r.output, r.finish_reason) for r in a] == [(r.output, r.finish_reason) for r in b]
    assert _tree(plain) == _tree(late)
    assert plain.stats.generated_tokens == late.stats.generated_tokens
    assert late.stats.overlapped_steps > 0 and plain.stats.overlapped_steps == 0
    return plain, late, a


PROMPTS = _prompts((30, 200, 45, 100, 17, 64))


@functools.cache
def _clean() -> list[list[int]]:
    """Every prompt's 12 greedy tokens, serialised (computed once, inside a test: one thread)."""
    return [r.output for r in _runner(False).generate(PROMPTS, SamplingParams(max_new_tokens=12))]


def _stop_at(k: int, output: list[int]) -> int | None:
    """A stop token whose first occurrence in ``output`` is at index ``k``."""
    return output[k] if k < len(output) and output[k] not in output[:k] else None


def test_stop_tokens_at_every_step_end_as_without_overlap() -> None:
    """Request i stops at its output index i (0: the prefill's token); max_new_tokens varies
    from 1 on; the long prompt is prefilled in chunks while the others decode; max_running
    makes requests join as others leave."""
    params = [
        SamplingParams(max_new_tokens=m, stop_token=_stop_at(k, out))
        for k, (m, out) in enumerate(zip((12, 12, 12, 1, 12, 7), _clean()))
    ]
    assert sum(p.stop_token is not None for p in params) >= 4
    plain, late, results = _both(PROMPTS, params, max_running=3)
    reasons = [r.finish_reason for r in results]
    assert reasons.count("stop") >= 4 and "length" in reasons
    assert [len(r.output) for r in results][3] == 1
    # a stop seen one step late: its request had been launched again, that token dropped
    assert late.stats.late_stop_tokens > 0 and plain.stats.late_stop_tokens == 0


def test_requests_joining_mid_run() -> None:
    """Requests submitted while others decode (with the step in flight) get the tokens they
    get alone."""
    extra = _prompts((40, 90, 20), seed=1)
    outputs = []
    for overlap in (False, True):
        runner = _runner(overlap)
        got = {}
        for i, prompt in enumerate(PROMPTS[:3] + extra):
            runner.submit(prompt, SamplingParams(max_new_tokens=5 + i))
            for _ in range(2):
                got.update({r.request_id: r.output for r in runner.step()})
        got.update({r.request_id: r.output for r in runner.run()})
        runner.cache.check_invariants()
        outputs.append(got)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 6


def test_preemption_of_a_request_in_flight() -> None:
    """A full pool small enough that decode extends preempt: the victim's token from the step
    in flight is read back first, and every output is the uncontended one."""
    params = SamplingParams(max_new_tokens=12)
    plain, late, results = _both(PROMPTS[:4], params, full_pages=19)
    assert late.stats.preemptions > 0 and plain.stats.preemptions > 0
    # each victim requeued with its last token: recomputed as a prompt token, not decoded again
    for counter in ("preemptions", "prefill_tokens", "decode_tokens"):
        assert getattr(plain.stats, counter) == getattr(late.stats, counter), counter
    assert [r.output for r in results] == _clean()[:4]


def test_a_failed_launch_fails_its_requests_only() -> None:
    """The third decode launch raises: its requests fail with the tokens of the step before it
    kept; the others (still prefilling) finish as in a clean run."""
    params = SamplingParams(max_new_tokens=12)
    runner = _runner(True)
    step, launches = runner.decoder.step, []

    def failing(requests, tokens, deltas):
        launches.append({r.id for r in requests})
        if len(launches) == 3:
            raise RuntimeError("injected")
        return step(requests, tokens, deltas)

    runner.decoder.step = failing  # type: ignore[method-assign]
    results = runner.generate(PROMPTS, params)
    failed = [r for r in results if r.finish_reason == "error"]
    assert failed and all(r.failure.stage is FailureStage.DECODE for r in failed)
    assert all(len(r.output) == 3 for r in failed)  # prefill's, then two launches read back
    for res, clean in zip(results, _clean()):
        assert res.output == clean[: len(res.output)]
        assert res.finish_reason == "error" or res.output == clean
    assert runner.stats.failed_requests == len(failed) < len(PROMPTS)
    assert runner.num_pending == 0 and runner.cache.requests == ()
    runner.cache.check_invariants()


def test_what_cannot_overlap_runs_serialised_visibly() -> None:
    """A sampled (non-greedy) request, or an ``on_logits`` hook, serialises the decode steps
    it takes part in (counted); outputs are unchanged, seeded sampling included."""
    params = [SamplingParams(max_new_tokens=8, temperature=0.8, seed=3)] + [
        SamplingParams(max_new_tokens=14)
    ] * 2
    plain, late, _ = _both(PROMPTS[:3], params)
    assert late.stats.serialised_steps > 0 and plain.stats.serialised_steps == 0
    runner, seen = _runner(True), []
    runner.on_logits = lambda results, logits: seen.append(len(results))
    runner.generate(PROMPTS[:2], SamplingParams(max_new_tokens=4))
    assert runner.stats.overlapped_steps == 0 and runner.stats.serialised_steps > 0 and seen


def test_the_option_says_what_it_covers() -> None:
    assert _runner(True).paths.scheduling == "overlapped"
    default = Runner(CFG, CFG.cache_config(page_size=PAGE, full_capacity=PAGE * 64,
                     swa_capacity=PAGE * 24), device="cpu", chunk_tokens=64,
                     graph_decode=True)  # fmt: skip
    assert default.paths.scheduling == "serialised"  # default: with CUDA graphs only
    res = default.generate([[1, 2, 3]], None)
    line = next(x for x in summary(default, res, 1.0).splitlines() if x.startswith("paths:"))
    assert "decode eager (serialised)" in line
    for kw, what in (({"graph_decode": False}, "the paged"),):
        with pytest.raises(ValueError, match=f"needs the graph decoder: {what}"):
            _runner(True, **{"graph_decode": None, **kw})
    cc = CFG.cache_config(page_size=PAGE, full_capacity=PAGE * 80, swa_capacity=PAGE * 32,
                          speculative=True)  # fmt: skip
    with pytest.raises(ValueError, match="speculative"):
        Runner(CFG, cc, device="cpu", chunk_tokens=64, graph_decode=True, speculative_tokens=2,
               overlap=True)  # fmt: skip


def test_the_overhead_bench_runs_both_modes_interleaved() -> None:
    """bench/runner_overhead.py's measurement on the CPU (the lead runs it on the H200): both
    modes, the whole batch decoding in every timed step, the same tokens."""
    path = Path(__file__).resolve().parents[1] / "bench/runner_overhead.py"
    spec = importlib.util.spec_from_file_location("runner_overhead", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = argparse.Namespace(device="cpu", batch=2, prompt_len=20, steps=2, page_size=PAGE,
                              chunk_tokens=64, overlap="both", reps=1)  # fmt: skip
    out = bench.run(args, CFG)
    assert out["outputs_identical"] and set(out["summary"]) == {"on", "off"}
    assert [r["overlap"] for r in out["rows"]] == [False, True]
    assert all(r["decode_batch"] == [2, 2] for r in out["rows"])
    assert "overlapped" in out["config"]["paths"]["on"]
