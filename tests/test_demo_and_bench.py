"""The README's main job and the benchmark stay runnable (no timing is asserted)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from shadowradix import CacheConfig
from shadowradix.cli import main
from shadowradix.demo import DemoTrace, run_demo

ROOT = Path(__file__).resolve().parents[1]


def test_demo_reuses_earlier_turns() -> None:
    rows = run_demo(
        CacheConfig(page_size=16, full_capacity=16 * 1024, swa_capacity=16 * 256),
        DemoTrace(conversations=6, turns=3, system_len=96, user_len=20, reply_len=12, batch=4),
    )
    assert [r.turn for r in rows] == [1, 2, 3]
    for row in rows[1:]:
        # every later turn resends its history: at least the previous turn's full pages hit
        assert row.hit_tokens / row.prompt_tokens > 0.7
    assert rows[0].hit_tokens > 0  # the shared system prompts


def test_cli_demo_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--conversations", "4", "--turns", "2", "--page-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "hit ratio" in out and "overall hit ratio" in out


def test_trace_replay_bench_runs_and_hits() -> None:
    spec_ = importlib.util.spec_from_file_location("trace_replay", ROOT / "bench/trace_replay.py")
    assert spec_ is not None and spec_.loader is not None
    bench = importlib.util.module_from_spec(spec_)
    sys.modules["trace_replay"] = bench
    spec_.loader.exec_module(bench)
    spec = bench.TraceSpec(
        num_requests=60, num_groups=2, prefix_len=256, unique_len=64, decode_len=8, batch=8
    )
    result = bench.replay_trace(bench.config_for(64, 8192, 2048, False), spec, materialize=True)
    # 2 groups: all but the first request of each group reuse the 256-token prefix
    assert result.hit_ratio == pytest.approx(58 * 256 / (60 * 320), abs=1e-9)
    assert result.preemptions == 0
