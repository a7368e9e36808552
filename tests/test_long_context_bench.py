"""``bench/long_context.py`` end to end on the CPU (a smoke run of the GPU benchmark): real text
through the runner, a batch reusing the prompt, one JSON row per context."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("long_context", ROOT / "bench/long_context.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _main(monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    monkeypatch.setattr(sys, "argv", ["long_context.py", *args])
    return _bench().main()


def test_long_context_bench_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "lc.json"
    argv = ["--device", "cpu", "--model", "tiny", "--contexts", "200,300", "--batch", "2",
            "--new-tokens", "4", "--chunk", "128", "--json", str(out)]  # fmt: skip
    assert _main(monkeypatch, *argv) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["commit"] and "--contexts 200,300" in data["meta"]["command"]
    rows = data["rows"]
    assert [r["context"] for r in rows] == [200, 300]
    for r in rows:
        assert r["prefill_tokens_per_s"] > 0 and r["batch_decode_tokens_per_s"] > 0
        # the batch reused the cached prompt: far fewer than 3 prompts' worth were prefilled
        assert r["prefill_tokens"] < 2 * r["context"]
    assert rows[0]["decode_ratio_to_first"] == 1.0
    assert "warmup_ttft_s" not in rows[0]


def test_long_context_bench_compares_formats_side_by_side(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "formats.json"
    argv = ["--device", "cpu", "--model", "tiny", "--contexts", "200,300", "--kv-format",
            "bf16,fp8", "--new-tokens", "4", "--chunk", "128", "--json", str(out)]  # fmt: skip
    assert _main(monkeypatch, *argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["context"], r["kv_format"]) for r in rows] == [
        (200, "bf16"), (200, "fp8"), (300, "bf16"), (300, "fp8")
    ]  # fmt: skip
    by = {(r["context"], r["kv_format"]): r for r in rows}
    for c in (200, 300):
        ratio = by[c, "fp8"]["fp8_over_bf16"]["decode_tokens_per_s"]
        assert ratio == by[c, "fp8"]["decode_tokens_per_s"] / by[c, "bf16"]["decode_tokens_per_s"]
    assert by[300, "fp8"]["decode_ratio_to_first"] == (
        by[300, "fp8"]["decode_tokens_per_s"] / by[200, "fp8"]["decode_tokens_per_s"]
    )
    assert "fp8_over_bf16" not in by[200, "bf16"]
    with pytest.raises(SystemExit, match="bf16, fp8"):  # before any weights are built
        _main(monkeypatch, "--device", "cpu", "--kv-format", "fp4")
    with pytest.raises(SystemExit, match="kernels, torch or both"):
        _main(monkeypatch, "--device", "cpu", "--paths", "triton")


def test_long_context_bench_warm_prefills_another_prompt_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "warm.json"
    argv = ["--device", "cpu", "--model", "tiny", "--contexts", "200", "--warm",
            "--new-tokens", "3", "--chunk", "128", "--json", str(out)]  # fmt: skip
    assert _main(monkeypatch, *argv) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["warmup_ttft_s"] > 0 and row["ttft_s"] > 0
    assert row["prefill_tokens"] == 200  # a fresh runner: the warm-up prompt is not reused


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_long_context_bench_needs_a_gpu_by_default(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _main(monkeypatch) == 2
    assert "no CUDA device" in capsys.readouterr().out
