"""``shadowradix run`` (the README's main job) end to end, and its error exits."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import torch

from adapters.cli.main import DEFAULT_QUESTIONS, main


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
        (["run", "x", "--device", "tpu"], "--device 'tpu': not a usable device"),
        (["run", "x", "--device", "mps"], "--device 'mps': not a usable device"),
        (["run", "x", "--model", "huge"], "--model: invalid choice: 'huge'"),
        (["run", "x", "--model", ""], "--model: invalid choice: ''"),
        (["run", "x", "--file", ""], "--file: an empty path"),
        (["run", "x", "--pool-budget-gib", "inf"], "--pool-budget-gib: inf must be finite"),
        (["run", "x", "--memory-budget-gib", "inf"], "--memory-budget-gib: inf must be finite"),
        (["run", "x", "--memory-budget-gib", "abc"], "'abc' is not a number"),
        (["run", ""], "an empty prompt"),
        (["run", "x", "--seed", str(2**62)], "is above"),
        (["demo", "--full-tokens", "64"], "full pool exhausted"),
        (["run", "x", "--temperature", "inf"], "--temperature: inf must be finite"),
        (["run", "x", "--seed", "9" * 30], "--seed: " + "9" * 30 + " is above"),
        (["run", "x", "--arrival-steps", "99999999"], "--arrival-steps: 99999999 is above"),
        (["run", "x", "--device", "cpu", "--hisparse-pages", "99999999999"],
         "lower --hisparse-pages"),
        (["demo", "--conversations", "100000000"], "--conversations: 100000000 is above"),
        (["run", "x", "--temperature", "-1"], "temperature"),
        (["run", "x", "--chunk-tokens", "100000"], "--chunk-tokens 100000: "),
        (["run", "x", "--file", "/nonexistent/prompts.txt"], "No such file"),
        (["run", "x", "--hisparse-pages", "3"], "cannot hold"),
        (["run", "x", "--layers", "0"], "--layers: 0 is below 1"),
        (["run", "x", "--layers", "-1"], "--layers: -1 is below 1"),
        (["run", "x", "--layers", "100"], "hold all 6 layers"),
        (["run", "x", "--layers", "3"], "use --model tiny (random weights)"),
        (["run", "x", "--model", "tiny", "--layers", "100"], "has 6 layers"),
        (["run", "x", "--max-new-tokens", "0"], "--max-new-tokens: 0 is below 1"),
        (["run", "x", "--page-size", "lots"], "'lots' is not an integer"),
        (["run", "x", "--page-size", "3"], "--page-size: 3 is not a power of two"),
        (["run", "x", "--temperature", "nan"], "--temperature"),
        (["run", "x", "--full-tokens", "100000000000000"], "the pools need"),
        (["run", "x", "--speculative", "0"], "--speculative: 0 is below 1"),
        (["run", "x", "--arrival-steps", "-2"], "--arrival-steps: -2 is below 0"),
        (["run", "x", "--bogus"], "unrecognized arguments: --bogus"),
        (["run", "x", "--pool-budget-gib", "0"], "--pool-budget-gib: 0 must be > 0"),
        (["run", "x", "--pool-budget-gib", "1e-6"], "--pool-budget-gib 1e-06: "),
        (["run", "x", "--pool-budget-gib", "1", "--swa-tokens", "4096"], "drop --full-tokens"),
        (["run", "x", "--pool-budget-gib", "1", "--hisparse-pages", "8"], "HiSparse"),
        (["run", "x", "--swa-full-ratio", "0.5"], "--swa-full-ratio needs --pool-budget-gib"),
        (["run", "x", "--draft", "eagle"], "--draft needs --speculative K"),
        (["run", "x", "--model", "tiny", "--speculative", "2", "--draft", "eagle"],
         "an EAGLE head needs trained weights"),
        (["run", "x", "--model", "tiny-shared", "--tail-only", "--speculative", "2"],
         "with tail-only prefill is not supported: the MTP layer reads"),
        (["run", "x", "--model", "tiny", "--tail-only"],
         "tail-only prefill needs V4.1 cross-layer sharing"),
        (["demo", "--page-size", "3"], "--page-size: 3 is not a power of two"),
        (["demo", "--conversations", "0"], "--conversations: 0 is below 1"),
        (["demo", "--turns", "0"], "--turns: 0 is below 1"),
        (["demo", "--swa-tokens", "64", "--page-size", "16"], "--swa-tokens 64: "),
        ([], "required: command"),
    ],
)
def test_run_bad_arguments_exit_2_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_an_empty_prompt_file_is_an_error_not_the_built_in_prompts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "empty.txt"
    path.write_text("\n  \n", encoding="utf-8")
    assert main(["run", "--file", str(path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "no prompts" in err and err.count("\n") == 1


def test_a_file_that_is_not_utf8_names_itself(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bin.dat"
    path.write_bytes(b"\xfd\xfe\xff prompt\n")
    assert main(["run", "--file", str(path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: not UTF-8 text" in err and err.count("\n") == 1


def test_version_and_interrupt(monkeypatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``--version`` prints the installed version; Ctrl-C during a run is one line and 130."""
    assert main(["--version"]) == 0
    assert re.match(r"shadowradix \S+$", capsys.readouterr().out.strip())

    def interrupted(args, texts):
        raise KeyboardInterrupt

    monkeypatch.setattr("adapters.cli.run_command.run_command", interrupted)
    assert main(["run", "x", "--device", "cpu"]) == 130
    assert capsys.readouterr().err == "shadowradix run: interrupted\n"


def test_progress_counts_decode_tokens_as_they_come(capsys: pytest.CaptureFixture[str]) -> None:
    """The bar's decode share grows every step (not when a request finishes) and closes at
    100 % even when prompt tokens were reused."""
    from adapters.cli.run_command import _Progress

    bar = _Progress(prompt_tokens=10, output_tokens=8, quiet=False)
    bar.update(prefilled=10, decoded=0)
    bar.update(prefilled=10, decoded=3)
    assert (bar.prefilled, bar.decoded, bar.bar.n) == (10, 3, 13)
    bar.update(prefilled=10, decoded=100)  # never past the total
    assert bar.decoded == 8
    bar.finish()
    assert bar.bar.n == bar.bar.total


def test_tail_only_summary_has_no_bounded_replay_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", "hello there", "general kenobi", "--model", "tiny-shared", "--tail-only",
            "--device", "cpu", "--max-new-tokens", "3", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "tail-only prefill" in out and "bounded replay" not in out


def test_run_with_hisparse_reports_its_buffer(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", "--max-new-tokens", "4", "--device", "cpu", "--hisparse-pages", "40"]
    assert main(argv + ["--quiet"]) == 0
    out = capsys.readouterr().out
    assert "HiSparse: 40 device pages per C4 layer" in out
    assert "decode paged" in out and "in graph steps" not in out  # auto: paged with HiSparse


@pytest.mark.parametrize("extra", [["--hisparse-pages", "40"],
                                   ["--hisparse-pages", "98", "--speculative", "2"]])  # fmt: skip
def test_graph_decode_on_with_hisparse(capsys: pytest.CaptureFixture[str], extra) -> None:  # type: ignore[no-untyped-def]
    """``--graph-decode on --hisparse-pages N``: decode (or verify) steps through the graph
    decoder's residency (eager on the CPU), the same greedy tokens as the paged path."""
    argv = ["run", "In the beginning God created", "--device", "cpu", "--max-new-tokens", "12",
            *extra]  # fmt: skip
    assert main(argv + ["--graph-decode", "off"]) == 0
    paged = capsys.readouterr().out
    assert main(argv + ["--graph-decode", "on"]) == 0
    graph = capsys.readouterr().out
    assert "HiSparse in graph steps:" in graph and "in graph steps" not in paged
    completion = [line for line in paged.splitlines() if line.startswith("[0] ")]
    assert completion and completion == [ln for ln in graph.splitlines() if ln.startswith("[0] ")]
    if "--speculative" not in extra:
        assert "decode eager" in graph and "decode paged" in paged


def test_cli_speculative(capsys) -> None:
    """``shadowradix run --speculative K`` drafts with the MTP layer and reports acceptance;
    with bounded replay it exits 2 with the reason (the seeds: no speculation with replay)."""
    from adapters.cli.main import main

    argv = ["run", "hello there", "--device", "cpu", "--max-new-tokens", "6", "--quiet"]
    assert main(argv + ["--speculative", "2"]) == 0
    out = capsys.readouterr().out
    assert "speculative decoding: k=2" in out and "mean acceptance length" in out
    assert main(argv + ["--speculative", "2", "--bounded-replay"]) == 2
    assert "speculative" in capsys.readouterr().err
    assert main(argv + ["--speculative", "2", "--draft", "eagle"]) == 0
    assert "speculative decoding: k=2 (EAGLE head)" in capsys.readouterr().out


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


@pytest.mark.parametrize(
    ("bad", "why"),
    [("0", "must be > 0"), ("-1", "must be a number >= 0"), ("1e400", "must be finite"),
     ("nan", "must be a number >= 0")],
)
def test_bad_memory_budget_is_an_error(
    bad: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "hi", "--device", "cpu", "--memory-budget-gib", bad]) == 2
    err = capsys.readouterr().err
    assert f"--memory-budget-gib: {bad} {why}" in err and err.count("\n") == 1


def test_run_within_a_pool_budget(capsys: pytest.CaptureFixture[str]) -> None:
    """``--pool-budget-gib`` sizes both pools from the budget (their bytes at most it) at the
    ``--swa-full-ratio`` split, and the header says so."""
    from adapters.cli.main import add_run_parser
    from adapters.cli.run_command import build_runner

    parser = argparse.ArgumentParser()
    add_run_parser(parser.add_subparsers(dest="command"))
    budget = 0.004
    args = parser.parse_args(["run", "x", "--device", "cpu", "--pool-budget-gib", str(budget),
                              "--swa-full-ratio", "0.25", "--chunk-tokens", "64"])  # fmt: skip
    runner = build_runner(args)
    assert runner.pools.nbytes().total <= budget * 2**30
    cfg = runner.cache.config
    assert cfg.swa_capacity == pytest.approx(0.25 * cfg.full_capacity, rel=0.1)
    assert runner.pool_balance is not None  # re-balanced at run time
    argv = ["run", "hi", "--device", "cpu", "--max-new-tokens", "3", "--quiet",
            "--pool-budget-gib", str(budget), "--chunk-tokens", "64"]  # fmt: skip
    assert main(argv) == 0
    assert f"(from {budget:g} GiB, re-balanced at run time)" in capsys.readouterr().out


def test_equal_prompts_sample_their_own_continuations(capsys: pytest.CaptureFixture[str]) -> None:
    """Prompt i samples with --seed + i: two equal prompts at a temperature differ, and the
    run is reproducible."""
    argv = ["run", "And God said", "And God said", "--device", "cpu", "--temperature", "1.5",
            "--max-new-tokens", "24", "--seed", "3", "--arrival-steps", "0"]  # fmt: skip
    outs = []
    for _ in range(2):
        assert main(argv) == 0
        out = capsys.readouterr().out
        outs.append(re.findall(r"^\[(\d)\] \S+ \(hit \d+ tok\): (.*)$", out, re.M))
    assert outs[0] == outs[1]  # reproducible
    texts = dict(outs[0])
    assert texts["0"] != texts["1"]  # each prompt its own sample
