"""``shadowradix run``'s progress bar as it happens (#14 item 6): it advances with the prompt
tokens a prefill computes and the output tokens each step generates (not when a request
finishes), and it stands at 100 % when the last request ends, before the bar is closed, also
when a request stops early at EOS and when prompt tokens were reused."""

from __future__ import annotations

import pytest
import torch

from adapters.cli.main import main
from adapters.cli.run_command import _Progress
from adapters.engine.emission import Emission
from adapters.model.tokenizer import EOS


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def bars(monkeypatch):
    """Records (n, total, requests finished so far) at every update, and (n, total) when the
    run closes the bar (before `_Progress.finish` forces 100 %)."""
    seen: dict[str, list] = {"updates": [], "closed": [], "finished": []}
    update, finished, finish = _Progress.update, _Progress.finished, _Progress.finish

    def on_update(self, prefilled, decoded):
        update(self, prefilled, decoded)
        seen["updates"].append((self.bar.n, self.bar.total, len(seen["finished"])))

    def on_finished(self, result, max_new):
        seen["finished"].append(result)
        finished(self, result, max_new)

    def on_finish(self):
        seen["closed"].append((self.bar.n, self.bar.total))
        finish(self)

    monkeypatch.setattr(_Progress, "update", on_update)
    monkeypatch.setattr(_Progress, "finished", on_finished)
    monkeypatch.setattr(_Progress, "finish", on_finish)
    return seen


def test_the_bar_advances_with_prefill_and_decode_as_they_happen(bars, capsys) -> None:
    long_prompt = "a long prompt " * 40  # 560 tokens: several 128-token chunks
    argv = ["run", long_prompt, "short one", "--max-new-tokens", "6", "--device", "cpu",
            "--chunk-tokens", "128", "--arrival-steps", "0"]  # fmt: skip
    assert main(argv) == 0
    updates = bars["updates"]
    before_any_result = [n for n, _, done in updates if done == 0]
    assert len(before_any_result) >= 4  # prefill chunks, then decode steps, all counted
    assert all(b > a for a, b in zip(before_any_result, before_any_result[1:]))
    assert before_any_result[0] > 0  # the first step's prefill already shows
    assert bars["closed"] == [(updates[-1][1], updates[-1][1])]  # 100 % before the close
    capsys.readouterr()


def test_the_bar_reaches_100_percent_on_an_early_eos(bars, monkeypatch, capsys) -> None:
    emit = Emission._emit

    def early_eos(self, seq, token):  # the first prompt stops at its second token
        if seq.result.request_id == 0 and len(seq.result.output) == 1:
            token = EOS
        return emit(self, seq, token)

    monkeypatch.setattr(Emission, "_emit", early_eos)
    argv = ["run", "stops early", "runs to the end", "--max-new-tokens", "12", "--device",
            "cpu"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "[0]   stop" in out and "[1] length" in out
    n, total = bars["closed"][0]
    assert n == total == 12 + 16 + 2 + 12  # both prompts (BOS first), 2 + 12 output tokens
    assert all(n <= total for n, total, _ in bars["updates"])


def test_reused_prompt_tokens_leave_the_total(bars, capsys) -> None:
    """The built-in prompts share a system prompt: what later ones reuse is never computed, so
    it leaves the total when they finish, and the bar still ends at 100 % by itself."""
    assert main(["run", "--max-new-tokens", "3", "--device", "cpu"]) == 0
    n, total = bars["closed"][0]
    reused = sum(r.cached_tokens for r in bars["finished"])
    assert reused > 0 and n == total
    capsys.readouterr()
