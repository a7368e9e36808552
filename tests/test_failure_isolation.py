"""Failure isolation (#14 item 4): a forward that raises (injected here by wrapping the
runner's forward for one step) finishes its own requests with ``finish_reason="error"`` and a
typed `RequestFailure`, releases their cache state (``check_invariants`` passes, nothing is
held), lets the other requests finish with the tokens of a run without the failure, and
`run` / `generate` return instead of raising. The CLI prints one line per failed request."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from small_models import CFG

from adapters.cli.main import main
from adapters.engine.emission import Emission
from adapters.engine.forward import Forward
from adapters.engine.runner import FailureStage, Runner
from adapters.engine.sampling import SamplingParams
from adapters.engine.speculative import OracleDraft
from shadowradix import CapacityError

PAGE = 16


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Injected(RuntimeError):
    pass


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 256, n).tolist()


def _runner(**kw) -> Runner:
    spec = "speculative_tokens" in kw
    cc = CFG.cache_config(page_size=PAGE, full_capacity=PAGE * 80, swa_capacity=PAGE * 32,
                          debug=True, speculative=spec)  # fmt: skip
    kw = {"chunk_tokens": 64, "max_running": 4, **kw}
    runner = Runner(CFG, cc, device="cpu", dtype=torch.float32, **kw)
    runner.share_prefills = False
    return runner


def _assert_clean(runner: Runner) -> None:
    st = runner.cache.stats()
    assert runner.num_pending == 0 and runner.cache.requests == ()
    assert st.full.held_pages == 0 and st.swa.held_pages == 0
    runner.cache.check_invariants()


def _fail_once(runner: Runner, when, error: Exception | None = None) -> list[set[int]]:
    """Makes the first forward whose (seqs, chunks) satisfy ``when`` raise ``error``; returns
    a list that then holds the request ids of that forward."""
    failed: list[set[int]] = []
    forward = runner._forward

    def injected(seqs, chunks, *args, **kw):
        if not failed and when(seqs, chunks):
            failed.append({s.result.request_id for s in seqs})
            raise error or Injected("injected")
        return forward(seqs, chunks, *args, **kw)

    runner._forward = injected  # type: ignore[method-assign]
    return failed


PROMPTS = [_tokens(1, 30), _tokens(2, 200), _tokens(3, 30), _tokens(4, 100)]
PARAMS = SamplingParams(max_new_tokens=6)


def _clean_outputs() -> list[list[int]]:
    return [r.output for r in _runner().generate(PROMPTS, PARAMS)]


def _check_isolated(runner, results, failed_ids, stage, clean, error_type=Injected) -> None:
    assert len(results) == len(PROMPTS) and failed_ids
    for i, res in enumerate(results):
        if res.request_id in failed_ids:
            assert res.finish_reason == "error" and res.failure is not None
            assert res.failure.stage is stage and isinstance(res.failure.exception, error_type)
            assert res.error == res.failure.message and "\n" not in res.error
            assert res.output == clean[i][: len(res.output)]  # tokens before it failed stay
        else:
            assert res.finish_reason == "length" and res.output == clean[i]
    assert runner.stats.failed_requests == len(failed_ids)
    _assert_clean(runner)


def test_a_prefill_forward_that_raises_fails_its_requests_only() -> None:
    clean = _clean_outputs()
    runner = _runner()

    def second_chunk(seqs, chunks) -> bool:  # of the long prompt: its first one is published
        return any(s.result.request_id == 1 and s.req.length > len(c) for s, c in zip(seqs, chunks))

    failed = _fail_once(runner, second_chunk)
    results = runner.generate(PROMPTS, PARAMS)
    assert 1 in failed[0] and len(failed[0]) < len(PROMPTS)
    _check_isolated(runner, results, failed[0], FailureStage.PREFILL, clean)
    again = runner.generate([PROMPTS[1]], PARAMS)[0]  # what it had published stays cached
    assert again.cached_tokens >= 32 and again.output == clean[1]
    _assert_clean(runner)


@pytest.mark.parametrize("graph_decode", [False, True])
def test_a_decode_forward_that_raises_fails_its_requests_only(graph_decode: bool) -> None:
    clean = _clean_outputs()
    runner = _runner(graph_decode=graph_decode)
    failed: list[set[int]] = []
    step_of = runner._graph_forward if graph_decode else None

    def decoding(seqs, chunks=None) -> bool:  # the third decode step of the short prompts
        return all(len(s.result.output) == 3 for s in seqs) and 0 in {
            s.result.request_id for s in seqs
        }

    if graph_decode:

        def graph(seqs, tokens, deltas):
            if not failed and decoding(seqs):
                failed.append({s.result.request_id for s in seqs})
                raise Injected("injected")
            return step_of(seqs, tokens, deltas)

        runner._graph_forward = graph  # type: ignore[method-assign]
    else:
        failed = _fail_once(runner, lambda seqs, chunks: decoding(seqs) and len(chunks[0]) == 1)
    results = runner.generate(PROMPTS, PARAMS)
    assert failed and 1 not in failed[0]  # the long prompt was still prefilling
    _check_isolated(runner, results, failed[0], FailureStage.DECODE, clean)
    assert all(len(results[i].output) == 3 for i in failed[0])


def test_a_failed_speculative_verify_releases_its_drafts() -> None:
    clean = _clean_outputs()
    runner = _runner(speculative_tokens=2, draft=OracleDraft({}, 0.0))
    failed = _fail_once(runner, lambda seqs, chunks: len(chunks[0]) == 3 and
                        runner.cache.requests[0].num_draft > 0)  # fmt: skip
    results = runner.generate(PROMPTS, PARAMS)
    _check_isolated(runner, results, failed[0], FailureStage.DECODE, clean)


def test_a_request_the_failed_step_had_finished_keeps_its_result(monkeypatch) -> None:
    """Two requests decode together; the step where the first reaches its length raises while
    emitting the second's token: the first's result is returned all the same."""
    emit = Emission._emit

    def raising(self, seq, token):
        if seq.result.request_id == 1 and len(seq.result.output) == 2:
            raise Injected("injected")
        return emit(self, seq, token)

    monkeypatch.setattr(Emission, "_emit", raising)
    runner = _runner()
    params = [SamplingParams(max_new_tokens=3), SamplingParams(max_new_tokens=6)]
    for prompt, p in zip(PROMPTS[::2], params):
        runner.submit(prompt, p)
    results = {r.request_id: r for _ in range(20) for r in runner.step()}
    assert results[0].finish_reason == "length" and len(results[0].output) == 3
    assert results[1].finish_reason == "error" and len(results[1].output) == 2
    _assert_clean(runner)


def test_a_capacity_error_stays_a_typed_failure() -> None:
    """One request runs, so nothing can be preempted for it: the `CapacityError` of its extend
    is its failure, typed; the next request runs as usual."""
    runner = _runner(max_running=1)
    extend = runner.cache.extend_batch
    calls = []

    def short(requests, chunks):
        calls.append(len(chunks))
        if len(calls) == 3:
            raise CapacityError("full", needed_pages=1, available_pages=0)
        return extend(requests, chunks)

    runner.cache.extend_batch = short  # type: ignore[method-assign]
    first, second = runner.generate(PROMPTS[:2], PARAMS)
    assert first.finish_reason == "error" and isinstance(first.failure.exception, CapacityError)
    assert first.failure.exception.pool == "full"  # what a caller can act on
    assert first.error == (
        "decode failed: CapacityError: full pool exhausted: need 1 page(s), only 0 free or "
        "evictable"
    )
    assert second.finish_reason == "length" and second.output == _clean_outputs()[1]
    _assert_clean(runner)


def test_an_assertion_error_is_not_isolated() -> None:
    """A broken internal invariant is a bug, not a request's failure: it is raised."""
    runner = _runner()
    _fail_once(runner, lambda seqs, chunks: True, AssertionError("broken"))
    runner.submit(PROMPTS[0], PARAMS)
    with pytest.raises(AssertionError, match="broken"):
        runner.step()


def test_the_cli_prints_one_line_per_failed_request_and_keeps_the_others(
    monkeypatch, capsys: pytest.CaptureFixture[str]
) -> None:
    boom = [256, *b"boom"]
    forward = Forward._forward

    def injected(self, seqs, chunks, *args, **kw):
        if any(s.result.prompt[:5] == boom and len(c) > 1 for s, c in zip(seqs, chunks)):
            raise Injected("injected")
        return forward(self, seqs, chunks, *args, **kw)

    monkeypatch.setattr(Forward, "_forward", injected)
    argv = ["run", "hello", "boom please", "bye", "--max-new-tokens", "3", "--device", "cpu"]
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert re.findall(r"^\[\d\] error: .*$", err, re.M) == [
        "[1] error: prefill failed: Injected: injected"
    ]
    assert re.search(r"^\[0\] +(length|stop) ", out, re.M)
    assert re.search(r"^\[2\] +(length|stop) ", out, re.M)
    assert "requests 3," in out
