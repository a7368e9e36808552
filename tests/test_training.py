"""Training (#15): the training forward is the reference's maths, the indexer learns only from
its KL loss, the loss falls on the fixture, runs are deterministic and resume exactly."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from adapters.forward.mtp import reference_mtp_logits
from adapters.model.model import final_hidden
from adapters.model.reference import DenseKeys
from adapters.model.weights import init_weights
from adapters.model.weights_file import from_state_dict, load_weights, save_weights, state_dict
from adapters.training.corpus import FIXTURE_DIR, load_split
from adapters.training.data import TokenData
from adapters.training.forward import losses, torch_references, train_forward
from adapters.training.keys import TrainKeys, window_mask
from adapters.training.loop import TrainConfig, init_params, train
from tests.small_models import SHORT, SHORT_SHARED


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("cfg", [SHORT, SHORT_SHARED], ids=["unshared", "shared"])
def test_the_training_forward_is_the_reference_forward_in_fp64(cfg) -> None:
    """Window blocks, compressed entries, the indexer's top-k and the sink, batched: every
    sequence's hidden states equal `DenseKeys`' (the runner's oracle), MTP logits too. 70
    tokens cross 4 windows of 16, 4 C16 groups and 17 C4 entries (top-k 8)."""
    weights = init_weights(cfg, dtype=torch.float64)
    tokens = _tokens(2, 70)
    positions = torch.arange(70).repeat(2)
    with torch_references():
        hidden = final_hidden(weights, tokens.reshape(-1), positions, TrainKeys(cfg, 2, 70))
        out = train_forward(weights, tokens)
        for b in range(2):
            ref = final_hidden(weights, tokens[b], torch.arange(70), DenseKeys(cfg, 70))
            torch.testing.assert_close(hidden.view(2, 70, -1)[b], ref, rtol=1e-12, atol=1e-12)
            mtp = reference_mtp_logits(weights, tokens[b])
            torch.testing.assert_close(out.mtp_logits[b], mtp, rtol=1e-5, atol=1e-5)


def test_window_mask_is_the_sliding_window() -> None:
    w, t = 4, 11
    mask = window_mask(t, w, torch.device("cpu"))
    for q in range(t):
        cols = mask[q].nonzero()[:, 0].tolist()
        positions = [(q // w - 1) * w + c for c in cols]
        assert positions == list(range(max(0, q - w + 1), q + 1))


def _grads(cfg, params, loss) -> dict[str, bool]:
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return {n: g is not None and bool(g.abs().sum() > 0) for n, g in zip(params, grads)}


def test_the_indexer_learns_only_from_its_kl_loss() -> None:
    """The main and MTP losses reach no indexer weight; the KL loss reaches only indexer weights
    (its inputs are detached); the compressed entries get gradients through the selection."""
    params = init_params(SHORT, torch.device("cpu"))
    tokens = _tokens(2, 48)
    out = train_forward(from_state_dict(SHORT, params), tokens)
    main = losses(out, tokens, mtp_weight=0.3, aux_weight=0.0).total
    reached = _grads(SHORT, params, main)
    indexer = {n for n in params if ".indexer." in n}
    assert indexer and not any(reached[n] for n in indexer)
    assert reached["layers.1.compressor.w_kv"] and reached["layers.2.compressor.w_kv"]
    assert reached["mtp.proj"] and reached["embed"]
    out = train_forward(from_state_dict(SHORT, params), tokens)
    kl = _grads(SHORT, params, out.aux_loss)
    assert {n for n, hit in kl.items() if hit} == indexer


def _fixture_config(**kw) -> TrainConfig:
    base = dict(steps=12, batch=4, seq_len=64, lr=3e-3, warmup=2, log_every=1, eval_bytes=1024)
    return TrainConfig(**{**base, **kw})


def test_loss_falls_on_the_fixture_and_the_saved_file_round_trips(tmp_path: Path) -> None:
    corpus = load_split(FIXTURE_DIR, verify=False)
    result = train(_fixture_config(), corpus, torch.device("cpu"), model=SHORT, log=lambda s: None)
    first, last = result.log[0]["bits_per_byte"], result.log[-1]["bits_per_byte"]
    assert last < first - 2.0, (first, last)
    assert result.heldout is not None and result.heldout.bits_per_byte < first - 2.0
    path = tmp_path / "w.safetensors"
    sha = save_weights(result.weights, path)
    loaded = load_weights(path, SHORT, sha256=sha)
    for name, t in state_dict(result.weights).items():
        assert torch.equal(state_dict(loaded)[name], t), name
    chunk = TokenData(corpus.heldout, 64).chunks(63)[0][None]
    a, b = train_forward(result.weights, chunk), train_forward(loaded, chunk)
    assert torch.equal(a.logits, b.logits)


def test_runs_are_deterministic_and_a_resumed_run_equals_the_uninterrupted_one(
    tmp_path: Path,
) -> None:
    corpus = load_split(FIXTURE_DIR, verify=False)
    tc, cpu = _fixture_config(steps=4, batch=2), torch.device("cpu")
    kw = dict(model=SHORT, evaluate_at_end=False, log=lambda s: None)
    whole = train(tc, corpus, cpu, **kw)
    again = train(tc, corpus, cpu, **kw)
    ckpt = tmp_path / "run.pt"
    part = train(tc, corpus, cpu, checkpoint=ckpt, stop_at=2, **kw)
    assert part.stopped_early and part.steps_done == 2
    with pytest.raises(ValueError, match="another run"):
        train(replace(tc, lr=1e-3), corpus, cpu, resume=ckpt, **kw)
    resumed = train(tc, corpus, cpu, resume=ckpt, **kw)
    assert resumed.steps_done == 4 and not resumed.stopped_early
    differs = False
    for name, t in state_dict(whole.weights).items():
        assert torch.equal(state_dict(again.weights)[name], t), name
        assert torch.equal(state_dict(resumed.weights)[name], t), name
        differs |= not torch.equal(state_dict(part.weights)[name], t)
    assert differs  # the last two steps changed the weights
