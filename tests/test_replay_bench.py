"""bench/replay.py stays runnable and its figures mean what they say (no timing asserted)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("replay_bench", ROOT / "bench/replay.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["replay_bench"] = module
    spec.loader.exec_module(module)
    return module


def test_replay_bench_tiny_float64(bench, tmp_path: Path, capsys) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path / "replay.json"
    argv = "--groups 2 --waves 1 --prefix-len 200 --suffix-len 10 --decode 3 --measure 2"
    argv += f" --page-size 16 --chunk-tokens 128 --dtype float64 --device cpu --oracle --json {out}"
    try:
        assert bench.main(argv.split()) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(out.read_text())
    exact, replay = report["prefill"]["exact"], report["prefill"]["replay"]
    # every window tombstoned before the wave: exact reuse finds nothing, replay reuses 192 - 128
    assert exact["hit_ratio"] == 0 and exact["replayed_hits"] == 0
    assert replay["replayed_hits"] == 2 and replay["hit_tokens"] == 2 * (192 - 128)
    assert replay["computed_tokens"] == 2 * (210 - 192 + 128) < exact["computed_tokens"]
    div = report["divergence"]
    assert div["exact"]["max_abs_logit_diff"] == 0.0  # float64: recomputation is bit-identical
    assert div["replay"]["max_abs_logit_diff"] > 0 and div["replay"]["requests"] == 2
    assert report["oracle"] == {"requests": 2, "max_abs_logit_diff": 0.0}  # bit-identical
    text = capsys.readouterr().out
    assert "replay speed-up" in text and "vs cold prefill" in text
    assert "replay vs its oracle" in text
    assert "nothing to compare" in bench.table(report | {"divergence": {}, "oracle": {}})
