"""``shadowradix run`` (the README's main job) end to end, and its error exits."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from adapters.cli import DEFAULT_QUESTIONS, main


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_run_default_prompts_prints_completions_and_summary(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["run", "--max-new-tokens", "4", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert "decode" in err and "prefill" in err  # the progress bar goes to stderr
    completions = re.findall(r"^\[(\d+)\] +(length|stop) \(hit (\d+) tok\)", out, re.M)
    assert sorted(int(i) for i, _, _ in completions) == list(range(len(DEFAULT_QUESTIONS)))
    assert sum(int(hit) for _, _, hit in completions) > 0  # the shared system prompt is reused
    ratio = float(re.search(r"prompt hit ratio ([0-9.]+)", out).group(1))
    assert 0.3 < ratio < 1.0
    for field in ("tokens/s", "pools: full", "evictions:", "preemptions", "forward"):
        assert field in out


def test_run_prompts_from_arguments_and_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text("first line prompt\n\nsecond line prompt\n", encoding="utf-8")
    argv = ["run", "hello", "--file", str(path), "--max-new-tokens", "3", "--device", "cpu"]
    assert main(argv + ["--arrival-steps", "0"]) == 0
    out = capsys.readouterr().out
    assert "requests 3," in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "x", "--device", "tpu"], "not a device"),
        (["run", "x", "--device", "mps"], "unsupported device type"),
        (["run", "x", "--model", "huge"], "unknown model preset"),
        (["run", "x", "--temperature", "-1"], "temperature"),
        (["run", "x", "--chunk-tokens", "100000"], "SWA pool"),
        (["run", "x", "--file", "/nonexistent/prompts.txt"], "No such file"),
        (["run", "x", "--hisparse-pages", "3"], "cannot hold"),
    ],
)
def test_run_bad_arguments_exit_2_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_run_with_hisparse_reports_its_buffer(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", "--max-new-tokens", "4", "--device", "cpu", "--hisparse-pages", "40"]
    assert main(argv + ["--quiet"]) == 0
    out = capsys.readouterr().out
    assert "HiSparse: 40 device pages per C4 layer" in out


def test_cli_speculative(capsys) -> None:
    """``shadowradix run --speculative K`` drafts with the MTP layer and reports acceptance;
    with bounded replay it exits 2 with the reason (the seeds: no speculation with replay)."""
    from adapters.cli import main

    argv = ["run", "hello there", "--device", "cpu", "--max-new-tokens", "6", "--quiet"]
    assert main(argv + ["--speculative", "2"]) == 0
    out = capsys.readouterr().out
    assert "speculative decoding: k=2" in out and "mean acceptance length" in out
    assert main(argv + ["--speculative", "2", "--bounded-replay"]) == 2
    assert "speculative" in capsys.readouterr().err


def test_a_refused_prompt_does_not_stop_the_others(capsys: pytest.CaptureFixture[str]) -> None:
    """A prompt longer than the full pool is refused with its reason; the next one still runs,
    and the exit status says something was refused."""
    long = "x" * 300
    argv = ["run", long, "hello", "--max-new-tokens", "3", "--device", "cpu",
            "--full-tokens", "256", "--swa-tokens", "1024", "--chunk-tokens", "64"]  # fmt: skip
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert re.search(r"\[0\] refused: .*exceeds the full pool", err)
    assert re.search(r"^\[1\] +(length|stop)", out, re.M)
    assert "prefill" in err  # long prompts show prefill progress


@pytest.mark.parametrize("bad", ["0", "-1"])
def test_bad_memory_budget_is_an_error(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "hi", "--device", "cpu", "--memory-budget-gib", bad]) == 2
    assert "--memory-budget-gib must be positive" in capsys.readouterr().err
