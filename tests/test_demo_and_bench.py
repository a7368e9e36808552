"""The README's main job and the benchmark stay runnable (no timing is asserted)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from adapters.cli.demo import DemoTrace, run_demo
from adapters.cli.main import main
from shadowradix import CacheConfig

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
    bench = _load_bench("trace_replay")
    spec = bench.TraceSpec(
        num_requests=60, num_groups=2, prefix_len=256, unique_len=64, decode_len=8, batch=8
    )
    result = bench.replay_trace(bench.config_for(64, 8192, 2048, False), spec, materialize=True)
    # 2 groups: all but the first request of each group reuse the 256-token prefix
    assert result.hit_ratio == pytest.approx(58 * 256 / (60 * 320), abs=1e-9)
    assert result.preemptions == 0


def _load_bench(name: str):  # type: ignore[no-untyped-def]
    spec_ = importlib.util.spec_from_file_location(name, ROOT / f"bench/{name}.py")
    assert spec_ is not None and spec_.loader is not None
    bench = importlib.util.module_from_spec(spec_)
    sys.modules[name] = bench
    spec_.loader.exec_module(bench)
    return bench


def test_peer_trace_bench_runs_ours_and_hits(tmp_path: Path) -> None:
    """bench/peer_trace.py on a tiny trace, without the peers: every lifecycle mode serves every
    request, hits the whole group prefix after each group's first request, and writes its JSON."""
    bench = _load_bench("peer_trace")
    w = bench.Workload(reqs=24, groups=3, prefix=160, suffix=40, decode=20, kv_size=8192,
                       swa_size=4096)  # fmt: skip
    seqs = bench.make_workload(w)
    assert len(seqs) == 24 and all(len(s) == 220 for s in seqs)
    firsts = len({tuple(s[:160].tolist()) for s in seqs})
    ceiling = (24 - firsts) * 160 / (24 * 200)
    for arrays in ("lazy", "built"):
        for decode in ("chunk", "steps"):
            res = bench.run_ours(w, seqs, arrays, decode)
            assert res.skipped == 0 and res.hit_ratio == pytest.approx(ceiling, abs=1e-9)
    out = tmp_path / "peer.json"
    argv = ["--reqs=12", "--groups=2", "--prefix=160", "--suffix=40", "--decode=20", "--reps=1",
            "--kv-size=8192", "--swa-size=4096", "--no-peers", f"--json={out}"]  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert set(result["summary"]) >= {"lazy/chunk", "built/chunk"}
    assert result["meta"]["commit"] and result["meta"]["command"]


def test_peer_trace_parses_the_sglang_driver_output() -> None:
    bench = _load_bench("peer_trace")
    text = (
        "unified_swa[rust]      core=RustUnifiedTreeCore  reqs=2000 wall=1.96s req/s=1,018 "
        "prompt_hit=0.669 evict_calls=2685 skipped=0\n    match=49,585/s(n=2000)\n"
        "    full_ok=True swa_ok=True (full av=1409) sanity=pass (0.00s)\n"
        "plain                  core=RadixCache           reqs=2000 wall=1.36s req/s=1,473 "
        "prompt_hit=0.835 evict_calls=1325 skipped=0\n    match=1/s\n    full_ok=False (av=1)\n"
    )
    rows = bench.parse_driver_output(text)
    assert rows["unified_swa[rust]"] == dict(core="RustUnifiedTreeCore", requests_per_s=1018.0,
                                             hit_ratio=0.669, invariants_ok=True)  # fmt: skip
    assert rows["plain"]["requests_per_s"] == 1473.0 and rows["plain"]["invariants_ok"] is False


def test_sglang_gc_wrapper_collects_before_each_timed_run(tmp_path: Path) -> None:
    """bench/sglang_gc_driver.py runs a driver's main() unchanged, collecting before each run()."""
    fake = tmp_path / "driver.py"
    fake.write_text(
        "import gc, sys\n"
        "def run(tag):\n    print(tag, gc.get_count()[0], sys.argv[1:])\n"
        "def main():\n    keep = [[] for _ in range(3000)]\n    run('a')\n"
        "    keep += [[] for _ in range(600)]\n    run('b')\n"
    )
    wrapper = str(ROOT / "bench/sglang_gc_driver.py")
    out = subprocess.run([sys.executable, wrapper, str(fake), "--x"], capture_output=True,
                         text=True, check=True).stdout.split("\n")  # fmt: skip
    assert [line.split()[0] for line in out if line] == ["a", "b"]
    assert all(int(line.split()[1]) < 100 and "['--x']" in line for line in out if line)
    bench = _load_bench("peer_trace")
    cmd = bench.driver_command(bench.Workload(), Path("py"), Path("peers"), gc_collect=True)
    assert cmd[1].endswith("bench/sglang_gc_driver.py") and cmd[2] == "peers/sglang_swa_driver.py"
