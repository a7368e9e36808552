"""``shadowradix`` errors a user can trigger name the flag they typed (never an API argument
such as ``chunk_tokens``), ``--file -`` reads standard input, and ``--device`` is checked up
front against the devices this machine has."""

from __future__ import annotations

import io
import re

import pytest
import torch

from adapters.cli.main import main

#: an API name (``chunk_tokens``, ``swa_capacity=512``) in a message shown to a CLI user
API_NAME = re.compile(r"\b[a-z]+_[a-z_]+\b")
FAST = ["--device", "cpu", "--max-new-tokens", "2", "--quiet"]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not API_NAME.search(err), err
    return err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "x", "--page-size", "3"], "--page-size: 3 is not a power of two from 1 to 256"),
        (["run", "x", "--page-size", "512"], "--page-size: 512 is not a power of two"),
        (["demo", "--page-size", "48"], "--page-size: 48 is not a power of two"),
        (["run", "x", "--full-tokens", "100"],
         "--full-tokens 100: not a whole number of pages (a multiple of --page-size 64)"),
        (["run", "x", "--page-size", "128", "--full-tokens", "64"],
         "--full-tokens 64: not a whole number of pages (a multiple of --page-size 128)"),
        (["run", "x", "--swa-tokens", "100"], "--swa-tokens 100: not a whole number of pages"),
        (["demo", "--full-tokens", "1"], "--full-tokens 1: not a whole number of pages"),
        (["demo", "--swa-tokens", "100"], "--swa-tokens 100: not a whole number of pages"),
        (["run", "x", "--swa-tokens", "64"],
         "--swa-tokens 64: one request's window needs 4 pages of 64 tokens: at least 256"),
        (["demo", "--page-size", "256", "--swa-tokens", "512"],
         "--swa-tokens 512: one request's window needs 3 pages of 256 tokens: at least 768"),
        (["run", "x", "--chunk-tokens", "8000"],
         "--chunk-tokens 8000: a chunk plus its window needs 8256 SWA tokens, more than "
         "--swa-tokens 8192: lower --chunk-tokens or raise --swa-tokens"),
        (["run", "x", "--pool-budget-gib", "0.004", "--chunk-tokens", "100000"],
         "lower --chunk-tokens"),
        (["run", "x", "--speculative", "100"],
         "--speculative 100: verifies 101 tokens per step, more than the model's rings hold at "
         "--page-size 64 (9): at most --speculative 8"),
        (["run", "x", "--speculative", "2", "--bounded-replay"],
         "--bounded-replay cannot be combined with --speculative"),
        (["run", "x", "--hisparse-pages", "3"],
         "--hisparse-pages 3 cannot hold one query's top-32 pages plus the page it writes: "
         "at least 33"),
        (["run", "x", "--hisparse-pages", "64", "--speculative", "2"],
         "--hisparse-pages 64 cannot hold a verify step of --speculative 2: 3 queries' top-32 "
         "pages plus 2 written, at least 98"),
        (["run", "x", "--memory-budget-gib", "1e-30"], "--memory-budget-gib 1e-30: less than one"),
        (["run", "x", "--temperature", "1e300"],
         "--temperature 1e+300: must be 0 (greedy) or in [0.001, 1000]"),
        (["run", "x", "--pool-budget-gib", "1e-6"], "--pool-budget-gib 1e-06: the pools' "),
        (["run", "x", "--pool-budget-gib", "0.001"],
         "--pool-budget-gib 0.001: the SWA pool of 192 tokens holds fewer than"),
        (["run", "x", "--pool-budget-gib", "0.004", "--swa-full-ratio", "1e-9"],
         "--pool-budget-gib 0.004 --swa-full-ratio 1e-09: the SWA pool must be a positive "
         "multiple of --page-size 64"),
        (["run", "x", "--weights", "/nonexistent/w.safetensors"],
         "--weights /nonexistent/w.safetensors: No such file or directory"),
        (["run", "x", "--file", "/"], "--file /: Is a directory"),
    ],
)  # fmt: skip
def test_an_error_names_the_flag_the_user_typed(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if argv[0] == "run":
        argv = argv + ["--device", "cpu"]
    assert message in _one_line_error(argv, capsys)


def test_a_refused_prompt_names_the_flags_too(capsys: pytest.CaptureFixture[str]) -> None:
    """Refusals (exit 1, the other prompts run) say ``--memory-budget-gib`` and
    ``--max-new-tokens``, not ``memory_budget`` / ``max_new_tokens``."""
    assert main(["run", "x", *FAST, "--memory-budget-gib", "1e-9"]) == 1
    err = capsys.readouterr().err
    assert "[0] refused: " in err and "(raise --memory-budget-gib or free" in err
    argv = ["run", "x", *FAST, "--full-tokens", "256", "--swa-tokens", "1024",
            "--chunk-tokens", "64", "--max-new-tokens", "300"]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "prompt + --max-new-tokens (+ 0 draft tokens) = 302 tokens exceeds" in err
    assert not API_NAME.search(err)


def _stdin(monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data), encoding="latin-1"))


def test_file_dash_reads_prompts_from_standard_input(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One prompt per non-empty line, read as UTF-8 whatever the stream's encoding; CRLF
    lines lose their CR as a file's do."""
    _stdin(monkeypatch, "first prompt\r\n\n  \nsecond é prompt\n".encode())
    assert main(["run", "--file", "-", *FAST, "--arrival-steps", "0"]) == 0
    out = capsys.readouterr().out
    assert "requests 2," in out and "2 prompt(s)" in out
    seen: list[list[str]] = []
    monkeypatch.setattr("adapters.cli.run_command.run_command", lambda a, t: seen.append(t) or 0)
    _stdin(monkeypatch, "first prompt\r\n\n  \nsecond é prompt".encode())
    assert main(["run", "arg", "--file", "-"]) == 0
    assert seen == [["arg", "first prompt", "second é prompt"]]


def test_file_dash_without_a_byte_stream(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("only prompt\n"))
    assert main(["run", "extra", "--file", "-", *FAST, "--arrival-steps", "0"]) == 0
    assert "requests 2," in capsys.readouterr().out


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "standard input (--file -): no prompts (every line is empty)"),
        (b"\n \n", "standard input (--file -): no prompts (every line is empty)"),
        (b"\xfd\xfe\xff prompt\n", "standard input (--file -): not UTF-8 text (invalid start"),
    ],
)  # fmt: skip
def test_file_dash_checks_standard_input_like_a_file(
    data: bytes, message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _stdin(monkeypatch, data)
    assert message in _one_line_error(["run", "--file", "-", "--device", "cpu"], capsys)


def test_file_help_mentions_standard_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--help"]) == 0
    assert "'-': standard input" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("device", ["cpu:7", "cpu:1", "cuda", "cuda:0", "cuda:99", "cuda:-1",
                                    "tpu", "mps", "meta", "", "cpu;"])  # fmt: skip
def test_a_device_this_machine_lacks_is_refused_up_front(
    device: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    err = _one_line_error(["run", "x", "--device", device], capsys)
    assert f"--device {device!r}: not a usable device here" in err
    assert err.endswith("(usable: auto, cpu)\n")


def test_the_usable_gpus_are_listed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    err = _one_line_error(["run", "x", "--device", "cuda:2"], capsys)
    assert err.endswith(
        "--device 'cuda:2': not a usable device here (usable: auto, cpu, cuda, cuda:0, cuda:1)\n"
    )


@pytest.mark.parametrize("device", ["cpu", "cpu:0"])
def test_the_cpu_stays_a_device(device: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "x", *FAST, "--device", device]) == 0
    assert "on cpu" in capsys.readouterr().out
