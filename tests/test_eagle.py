"""The EAGLE draft head (#15 item 4): its draft source proposes valid drafts, speculation with it
changes no greedy output, training is deterministic and beats a random head on acceptance, the
file round-trips and refuses another target; the shared trained preset fails loudly."""

from __future__ import annotations

import functools
import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from small_models import SMALL, one_thread

from adapters.engine.drafts import DraftBatch, DraftContext, SampledDraft
from adapters.engine.eagle_draft import EagleDraft
from adapters.engine.runner import Runner
from adapters.engine.sampling import SamplingParams
from adapters.model import weights_file
from adapters.model.eagle import (
    EagleConfig,
    draft_chain,
    init_eagle,
    load_eagle,
    load_shipped_eagle,
    save_eagle,
)
from adapters.model.model_config import preset
from adapters.model.weights import init_weights
from adapters.model.weights_file import WeightsError, from_state_dict, load_shipped, state_dict
from adapters.training.corpus import FIXTURE_DIR, load_split
from adapters.training.eagle import train_eagle
from adapters.training.loop import TrainConfig, train

#: window 16, C4 + C16: short prompts cross windows and groups
CFG = preset("tiny", **SMALL, window=16, compress_ratios=(0, 4, 16, 4))
CORPUS = load_split(FIXTURE_DIR, verify=False)
TC = TrainConfig(eagle=True, steps=20, batch=4, seq_len=96, lr=3e-3, warmup=3, log_every=10,
                 eval_bytes=512, eagle_depth=3)  # fmt: skip


_one_thread = pytest.fixture(autouse=True, scope="module")(one_thread)


@functools.cache
def target(dtype=torch.float64):
    """CFG trained for 8 steps on the fixture: its distributions favour frequent bytes (a
    random-weight target's greedy continuations are random bytes, which no head can learn)."""
    if dtype != torch.float32:
        w = target(torch.float32)
        return from_state_dict(CFG, {n: t.to(dtype) for n, t in state_dict(w).items()})
    tc = TrainConfig(steps=8, batch=4, seq_len=96, lr=3e-3, warmup=2, log_every=5)
    return train(tc, CORPUS, torch.device("cpu"), model=CFG, evaluate_at_end=False,
                 log=lambda s: None).weights  # fmt: skip


@functools.cache
def trained():
    """A head trained for the float32 target on the fixture (20 steps of 4 x 96 bytes)."""
    return train_eagle(TC, CORPUS, torch.device("cpu"), target(torch.float32), log=lambda s: None)


def _runner(k, draft, batch=3):
    cc = CFG.cache_config(page_size=4, full_capacity=4 * 128, swa_capacity=4 * 40, debug=True,
                          speculative=k is not None)  # fmt: skip
    return Runner(CFG, cc, device="cpu", dtype=torch.float64, weights=target(), chunk_tokens=16,
                  max_running=batch, speculative_tokens=k, draft=draft)  # fmt: skip


def _prompts(n=3, length=40):
    text = CORPUS.heldout
    return [list(text[i * 200 : i * 200 + length]) for i in range(n)]


def test_drafts_have_the_right_shape_and_follow_the_chain() -> None:
    head = init_eagle(EagleConfig.for_target(CFG), dtype=torch.float64)
    source = EagleDraft(head)
    source.bind(DraftContext(target(), None, None, 4, 3, False))  # type: ignore[arg-type]
    hidden = torch.randn(2, CFG.hidden, dtype=torch.float64)
    batch = DraftBatch((None, None), ([1, 2], [3]), ([5], [6, 7]), hidden, 3)  # type: ignore[arg-type]
    drafts = source.propose(batch)
    assert isinstance(drafts, list) and [len(d) for d in drafts] == [3, 3]
    assert all(0 <= t < CFG.vocab_size for d in drafts for t in d)
    tokens, logits, _ = draft_chain(target(), head, hidden, torch.tensor([5, 7]), 3)
    assert drafts == tokens.tolist()
    assert torch.equal(logits.argmax(-1), tokens)  # greedy: each step's argmax, fed back
    uniforms = torch.rand(2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    sampled = source.propose(replace(batch, temperatures=(1.0, 0.0), uniforms=uniforms))
    assert isinstance(sampled, SampledDraft) and sampled.probs.shape == (2, 3, CFG.vocab_size)
    assert sampled.tokens[1] == drafts[1]  # the greedy request stays greedy
    torch.testing.assert_close(sampled.probs.sum(-1), torch.ones(2, 3, dtype=torch.float64))


def test_a_head_of_another_width_is_refused_at_bind() -> None:
    head = init_eagle(EagleConfig(hidden=CFG.hidden * 2, vocab_size=CFG.vocab_size))
    with pytest.raises(WeightsError, match="do not fit"):
        EagleDraft(head).bind(DraftContext(target(), None, None, 2, 2, False))  # type: ignore[arg-type]


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_speculation_with_the_eagle_head_equals_plain_decode(k) -> None:
    prompts, params = _prompts(), SamplingParams(max_new_tokens=12)
    plain = [r.output for r in _runner(None, None).generate(prompts, params)]
    runner = _runner(k, EagleDraft(trained().weights))
    spec = [r.output for r in runner.generate(prompts, params)]
    assert spec == plain
    assert runner.spec is not None and runner.spec.stats.drafted_tokens > 0


def _acceptance(head) -> float:
    runner = _runner(3, EagleDraft(head))
    runner.generate(_prompts(4, 48), SamplingParams(max_new_tokens=24))
    assert runner.spec is not None
    return runner.spec.stats.acceptance_rate


def test_a_trained_head_beats_a_random_head_on_acceptance() -> None:
    result = trained()
    random_head = init_eagle(EagleConfig.for_target(CFG, seed=TC.seed))
    first, last = result.log[0], result.log[-1]
    assert last["kl"] < first["kl"], (first, last)
    assert result.heldout.agreement[0] > 0.5, result.heldout
    a_trained, a_random = _acceptance(result.weights), _acceptance(random_head)
    assert a_trained > a_random + 0.3, (a_trained, a_random)


def test_eagle_training_is_deterministic_and_resumes_exactly(tmp_path: Path) -> None:
    tc, cpu = replace(TC, steps=4, batch=2, seq_len=48), torch.device("cpu")
    kw = dict(evaluate_at_end=False, log=lambda s: None)
    whole = train_eagle(tc, CORPUS, cpu, target(torch.float32), **kw)
    again = train_eagle(tc, CORPUS, cpu, target(torch.float32), **kw)
    ckpt = tmp_path / "eagle.pt"
    train_eagle(tc, CORPUS, cpu, target(torch.float32), checkpoint=ckpt, stop_at=2, **kw)
    other = init_weights(CFG, "cpu", torch.float32)
    with pytest.raises(ValueError, match="another run"):
        train_eagle(tc, CORPUS, cpu, other, resume=ckpt, **kw)
    resumed = train_eagle(tc, CORPUS, cpu, target(torch.float32), resume=ckpt, **kw)
    for name, t in whole.weights.tensors().items():
        assert torch.equal(again.weights.tensors()[name], t), name
        assert torch.equal(resumed.weights.tensors()[name], t), name


def test_the_head_file_round_trips_and_refuses_another_target(tmp_path: Path, monkeypatch) -> None:
    head = trained().weights
    path = tmp_path / "head.safetensors"
    sha = save_eagle(head, target(torch.float32), path)
    loaded = load_eagle(path, target(torch.float64), sha256=sha)  # any dtype of the same weights
    for name, t in head.tensors().items():
        assert torch.equal(loaded.tensors()[name].float(), t), name
    with pytest.raises(WeightsError, match="trained for other weights"):
        load_eagle(path, init_weights(replace(CFG, seed=3)))
    with pytest.raises(WeightsError, match="SHA-256"):
        load_eagle(path, target(), sha256="0" * 64)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="corrupt"):
        load_eagle(path, target())
    ship = weights_file.ShippedWeights(str(tmp_path / "absent.safetensors"), None)
    monkeypatch.setitem(weights_file.SHIPPED_EAGLE, CFG.name, ship)
    with pytest.raises(WeightsError, match="not there"):
        load_shipped_eagle(target())


def test_the_shared_trained_preset_fails_loudly_until_its_file_exists(monkeypatch) -> None:
    model = preset("tiny-shared-trained")
    assert model.kv_sources and model.last_kv_source is not None  # tail-only applies
    assert replace(model, name="tiny-shared") == preset("tiny-shared")
    shipped = weights_file.SHIPPED[model.name]
    if not shipped.path.exists() or shipped.sha256 is None:
        with pytest.raises(WeightsError):
            load_shipped(model)
    monkeypatch.setitem(weights_file.SHIPPED, model.name, replace(shipped, file="absent"))
    with pytest.raises(WeightsError, match="not there"):
        load_shipped(model)


def test_sampled_speculation_with_the_eagle_head_is_reproducible() -> None:
    """Temperature 0.8: the head's `SampledDraft` goes through rejection sampling; the same
    seeds give the same outputs (the distribution itself is the rejection tests' business)."""
    params = SamplingParams(max_new_tokens=10, temperature=0.8, seed=5)
    runs = []
    for _ in range(2):
        runner = _runner(2, EagleDraft(trained().weights))
        runs.append([r.output for r in runner.generate(_prompts(2), params)])
        assert runner.spec is not None and runner.spec.stats.accepted_tokens > 0
    assert runs[0] == runs[1] and all(len(o) == 10 for o in runs[0])


def test_the_bench_builds_eagle_sources_and_refuses_a_missing_head(monkeypatch) -> None:
    path = Path(__file__).resolve().parents[1] / "bench/speculative.py"
    spec = importlib.util.spec_from_file_location("bench_speculative_eagle", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_speculative_eagle", bench)  # its dataclasses need it
    spec.loader.exec_module(bench)
    head = bench.eagle_head("eagle:random", target(), None)
    assert isinstance(bench.source("eagle:random", {}, 0, head), EagleDraft)
    assert bench.eagle_head("mtp", target(), None) is None
    with pytest.raises(WeightsError, match="no shipped EAGLE head"):
        bench.eagle_head("eagle", target(), None)  # CFG has none: never a random head instead
    if not weights_file.SHIPPED["tiny-shared-trained"].path.exists():
        with pytest.raises(WeightsError, match="not there"):
            bench._weights(preset("tiny-shared-trained"), "cpu", torch.float32)
