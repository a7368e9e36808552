"""``bench/report.py`` regenerates the tables of docs/benchmarks.md from the result files: the
long-context table from its JSON (ratios to the shortest prompt of the same format), the trace
replay table, and a refusal for anything else."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _report():
    spec = importlib.util.spec_from_file_location("report", ROOT / "bench/report.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["report"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_long_context_table_from_its_result_file() -> None:
    r = _report()
    data = json.loads((ROOT / "bench/results/long_context_final_h200.json").read_text())
    table = r.report(data).splitlines()
    assert len(table) == 2 + len(data["rows"])
    one_m_bf16 = next(x for x in table if x.startswith("| 1,048,576 | bf16"))
    assert "| 353.6 (1.01) | 7,801 (0.767) | 29.4 |" in one_m_bf16  # docs/benchmarks.md's row
    assert "| 4,096 | bf16 | 30.7 (23.5) | 133 | 349.5 | 10,170 | 4.7 |" in table


def test_trace_replay_table_and_refusal() -> None:
    r = _report()
    data = json.loads((ROOT / "bench/results/trace_replay.json").read_text())
    assert r.report(data).count("\n") == len(data) + 1
    with pytest.raises(SystemExit, match="not a"):
        r.report({"rows": []})
