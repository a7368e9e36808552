"""The engine's scheduler is torch-free and decides alone: imported with torch blocked, it
admits, budgets chunks, allocates typed frozen batches and preempts over a bare core cache."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest

from adapters.engine.batch import BatchKind, with_logit_rows
from adapters.engine.runner_stats import RunnerStats
from adapters.engine.sampling import Sampler, SamplingParams
from adapters.engine.scheduler import Scheduler, SchedulerConfig
from adapters.engine.sequence import GenerationResult, _Seq
from shadowradix import CacheConfig, ShadowRadixCache

ROOT = Path(__file__).resolve().parents[1]
PAGE = 4


def _blocked(code: str) -> subprocess.CompletedProcess[str]:
    script = "import sys\nsys.modules['torch'] = None\n" + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_the_scheduler_imports_and_schedules_without_torch() -> None:
    got = _blocked(
        """
        from adapters.engine import batch, chunks, scheduler, sequence, waiting
        from shadowradix import CacheConfig, ShadowRadixCache
        cache = ShadowRadixCache(CacheConfig(page_size=4, full_capacity=64, swa_capacity=64,
                                             window=8, compress_ratios=(0, 4)))
        s = scheduler.Scheduler(cache, scheduler.SchedulerConfig(16, 2), __import__(
            "adapters.engine.runner_stats", fromlist=["RunnerStats"]).RunnerStats())
        assert "torch" not in {m.split(".")[0] for m in sys.modules if sys.modules[m]}
        print("ok")
        """
    )
    assert got.returncode == 0 and got.stdout.strip() == "ok", got.stderr
    # the check can fail: a module that needs torch does not import with it blocked
    bad = _blocked("import adapters.engine.model_runner\n")
    assert bad.returncode != 0 and "torch" in bad.stderr


def _scheduler(max_running: int = 2, full_pages: int = 16) -> Scheduler:
    cc = CacheConfig(page_size=PAGE, full_capacity=PAGE * full_pages, swa_capacity=PAGE * 16,
                     window=8, compress_ratios=(0, 4), debug=True)  # fmt: skip
    return Scheduler(ShadowRadixCache(cc), SchedulerConfig(16, max_running), RunnerStats())


def _seq(rid: int, prompt: list[int], max_new: int = 4, priority: int = 0) -> _Seq:
    params = SamplingParams(max_new_tokens=max_new)
    return _Seq(GenerationResult(rid, prompt), params, Sampler(params), priority=priority)


def test_admission_allocation_and_a_typed_frozen_batch() -> None:
    s = _scheduler()
    for i in range(3):
        s.waiting.push(_seq(i, list(range(1 + i, 11 + i))))
    s.admit()
    assert [q.result.request_id for q in s.running] == [0, 1] and len(s.waiting) == 1
    chunks = [q.req.prompt_remaining.tolist() for q in s.running]
    batch = s.allocate(BatchKind.PREFILL, s.running, chunks)
    assert batch is not None and batch.kind is BatchKind.PREFILL
    assert [len(c) for c in batch.chunks] == [10, 10] and batch.num_tokens == 20
    assert batch.last == (True, True) and batch.logit_rows == (9, 19)  # each prompt's last row
    assert batch.ready == [0, 1] and batch.deltas == batch.plan.deltas
    with pytest.raises(FrozenInstanceError):
        batch.kind = BatchKind.DECODE  # type: ignore[misc]
    s.cache.check_invariants()


def test_decode_and_verify_rows() -> None:
    s = _scheduler()
    s.waiting.push(_seq(0, list(range(1, 9))))
    s.admit()
    (q,) = s.running
    s.allocate(BatchKind.PREFILL, [q], [q.req.prompt_remaining.tolist()])
    q.result.output.append(7)
    decode = s.allocate(BatchKind.DECODE, [q], [[7]])
    assert decode is not None and decode.logit_rows == (0,) and decode.spans == (range(0, 1),)
    again = with_logit_rows(decode)
    assert again == decode  # derived from the batch alone


def test_a_waiting_request_preempts_a_lower_priority_one_through_the_requeue_seam() -> None:
    s = _scheduler(max_running=1)
    s.waiting.push(_seq(0, list(range(1, 9))))
    s.admit()
    seen = []
    requeue = s.requeue
    s.requeue = lambda victim: (seen.append(victim.result.request_id), requeue(victim))[1]
    s.waiting.push(_seq(1, list(range(20, 28)), priority=1))
    s.admit()
    assert seen == [0] and [q.result.request_id for q in s.running] == [1]
    assert s.stats.preemptions == 1 and [q.result.request_id for q in s.waiting] == [0]
    s.cache.check_invariants()
