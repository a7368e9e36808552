"""Per-request priorities (#14 item 2): a higher priority is admitted first and preempted last;
a waiting request preempts lower-priority running ones for room, never one of its own priority
or higher; when an extend runs out of pages the victim is the lowest-priority, most recently
admitted request. Outputs never depend on the order (greedy, per-request samplers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from small_models import CFG

from adapters.engine.runner import Runner, SchedulePolicy
from adapters.engine.sampling import SamplingParams
from shadowradix import InvalidRequestError

PAGE = 16


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 256, n).tolist()


def _runner(full_pages: int = 60, swa_pages: int = 30, **kw) -> Runner:
    cc = CFG.cache_config(
        page_size=PAGE, full_capacity=PAGE * full_pages, swa_capacity=PAGE * swa_pages
    )
    kw = {"chunk_tokens": 64, **kw}
    runner = Runner(CFG, cc, device="cpu", dtype=torch.float32, **kw)
    runner.share_prefills = False
    return runner


def _check_clean(runner: Runner) -> None:
    assert runner.num_pending == 0 and runner.cache.requests == ()
    runner.cache.check_invariants()


@pytest.mark.parametrize("schedule", list(SchedulePolicy))
def test_a_higher_priority_is_admitted_first(schedule: SchedulePolicy) -> None:
    runner = _runner(max_running=1, schedule=schedule)
    params = SamplingParams(max_new_tokens=3)
    low = [runner.submit(_tokens(i, 40), params) for i in range(2)]
    high = runner.submit(_tokens(9, 40), params, priority=5)
    assert [r.request_id for r in runner.run()] == [high, *low]
    _check_clean(runner)


def _late_arrival(priority: int):
    """A long request runs alone (one running slot); a few steps in, another arrives."""
    runner = _runner(max_running=1)
    first_prompt, late_prompt = _tokens(1, 60), _tokens(2, 60)
    first = runner.submit(first_prompt, SamplingParams(max_new_tokens=20))
    for _ in range(4):
        assert runner.step() == []
    late = runner.submit(late_prompt, SamplingParams(max_new_tokens=3), priority=priority)
    results = {r.request_id: r for _ in range(100) for r in runner.step()}  # bounded: no livelock
    _check_clean(runner)
    solo = _runner().generate([first_prompt], SamplingParams(max_new_tokens=20))[0]
    return runner, results[first], results[late], solo


def test_a_higher_priority_arrival_preempts_a_lower_running_request() -> None:
    runner, first, late, solo = _late_arrival(priority=1)
    assert first.preemptions == 1 and late.preemptions == 0
    assert runner.stats.preemptions == 1
    assert first.output == solo.output  # preempted, recomputed, the same tokens


def test_an_equal_priority_arrival_waits() -> None:
    runner, first, late, _ = _late_arrival(priority=0)
    assert first.preemptions == 0 and runner.stats.preemptions == 0


def _pressure(priorities: list[int] | None):
    """Pools barely above one request's need (as test_runner's pressure test): extends run out
    of pages and preempt. Records each victim's priority beside the running ones'."""
    rng = np.random.default_rng(5)
    system = rng.integers(0, 256, 150).tolist()
    prompts = [system + rng.integers(0, 256, int(k)).tolist() for k in rng.integers(5, 50, 6)]
    runner = _runner(full_pages=14, swa_pages=15, chunk_tokens=37, max_running=4)
    victims: list[tuple[int, int, list[int]]] = []
    requeue = runner._requeue

    def observed(victim) -> None:
        running = [s.priority for s in runner._running]
        victims.append((victim.result.request_id, victim.priority, running))
        requeue(victim)

    runner._requeue = observed  # type: ignore[method-assign]
    results = runner.generate(prompts, SamplingParams(max_new_tokens=8), priorities=priorities)
    _check_clean(runner)
    return results, victims


@pytest.mark.parametrize("priority", [0, 1])
def test_memory_preemption_takes_the_lowest_priority_before_the_youngest(priority: int) -> None:
    """Two requests that cannot both grow to their end in the full pool: the later one is the
    youngest, preempted when priorities are equal, spared when its priority is higher."""
    runner = _runner(full_pages=14, max_running=4)
    params = SamplingParams(max_new_tokens=40)
    older = runner.submit(_tokens(5, 100), params)
    runner.step()
    younger = runner.submit(_tokens(6, 100), params, priority=priority)
    preempted = {r.request_id: r.preemptions for r in runner.run()}
    assert preempted == ({older: 0, younger: 1} if priority == 0 else {older: 1, younger: 0})
    _check_clean(runner)


def test_victims_under_pressure_are_never_above_a_running_priority() -> None:
    plain, plain_victims = _pressure(None)
    assert plain_victims, "the pools must run short"
    youngest = plain_victims[0][0]  # equal priorities: the most recently admitted goes
    assert youngest == max(r.request_id for r in plain if r.request_id <= 3)
    priorities = [0] * 6
    priorities[youngest] = 3
    ranked, victims = _pressure(priorities)
    assert victims and ranked[youngest].preemptions == 0
    for _, priority, running in victims:
        assert priority == min(running)  # never a higher one while a lower one runs
    assert [r.output for r in ranked] == [r.output for r in plain]


@pytest.mark.parametrize("bad", [True, 1.5, "1", None])
def test_a_priority_must_be_an_int(bad) -> None:
    runner = _runner()
    with pytest.raises(InvalidRequestError, match="priority"):
        runner.submit([1, 2, 3], priority=bad)
    assert runner.num_pending == 0
    with pytest.raises(InvalidRequestError, match="priorities"):
        runner.generate([[1, 2], [3, 4]], priorities=[1])
    assert runner.submit([1, 2, 3], priority=np.int64(-2)) == 0  # NumPy ints are ints
