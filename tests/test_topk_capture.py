"""Indexer top-k capture and forced replay (docs/runner.md, "Top-k capture and forced replay").

A capture is what the reference's indexer selects at every computed position; replayed on
another model's weights (whose indexer would choose otherwise) it is reproduced exactly and the
logits equal the reference forced the same way, bit for bit in float64. With a prefix-cache hit
only the computed positions are captured (``first_position``). Bad captures are refused at
submit with a typed error, nothing queued.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch
from small_models import SHORT_SHARED, fp64_weights, one_thread

from adapters.engine.runner import Runner, UnsupportedRequestError
from adapters.engine.sampling import SamplingParams
from adapters.forward.topk_capture import TopkCapture, TopkCaptureError
from adapters.model.model import forward
from adapters.model.model_config import ModelConfig
from adapters.model.reference import DenseKeys, reference_logits

pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")

#: window 16, (0, 4, 16, 4, 16, 4, 0, 4), indexer layers 1 and 5, top-4; candidates on
CFG = dataclasses.replace(
    SHORT_SHARED, index_topk=4, candidate_source=1, candidate_blocks=4, candidate_block=2
)
OTHER = dataclasses.replace(CFG, seed=1)  # other weights: the indexer chooses otherwise
PROMPT = np.random.default_rng(5).integers(0, 256, 70).tolist()
NEW = 6


_one_thread = pytest.fixture(autouse=True, scope="module")(one_thread)


weights = fp64_weights


def runner(cfg: ModelConfig, graph_decode: bool = False, tail_only: bool = False) -> Runner:
    cc = cfg.cache_config(page_size=8, full_capacity=640, swa_capacity=256, debug=True)
    return Runner(
        cfg, cc, device="cpu", dtype=torch.float64, weights=weights(cfg), chunk_tokens=24,
        max_running=4, graph_decode=graph_decode, tail_only=tail_only,
    )  # fmt: skip


def reference_selection(cfg: ModelConfig, tokens: list[int], forced=None) -> DenseKeys:
    keys = DenseKeys(cfg, len(tokens), forced)
    with torch.no_grad():
        forward(weights(cfg), torch.tensor(tokens), torch.arange(len(tokens)), keys)
    return keys


def as_forced(capture: TopkCapture) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for layer in capture.layers:
        entries, valid = capture.forced(layer, np.arange(capture.num_positions))
        out[layer] = (torch.from_numpy(entries), torch.from_numpy(valid))
    return out


def assert_capture_is(capture: TopkCapture, keys: DenseKeys, first: int) -> None:
    """Row t of each layer: the reference's valid picks at position first + t, in order."""
    for layer in capture.layers:
        idx, valid = keys.selection[layer]
        for t in range(capture.num_positions):
            want = idx[first + t][valid[first + t]].tolist()
            got = capture.entries[layer][t, : capture.counts[layer][t]].tolist()
            assert got == want, (layer, first + t)


@functools.cache
def rollout() -> tuple[list[int], TopkCapture]:
    res = runner(CFG).generate([PROMPT], SamplingParams(max_new_tokens=NEW, capture_topk=True))[0]
    assert res.finish_reason == "length" and res.topk is not None
    return res.prompt + res.output, res.topk


def test_capture_is_the_indexers_selection() -> None:
    tokens, cap = rollout()
    assert cap.first_position == 0 and cap.num_positions == len(PROMPT) + NEW - 1
    assert cap.layers == (1, 5) and cap.topk == 4 and list(cap.tokens) == tokens
    assert dict(cap.index_source) == {1: 1, 3: 1, 5: 5, 7: 5}
    assert all(cap.entries[i].dtype == np.int32 for i in cap.layers)
    assert_capture_is(cap, reference_selection(CFG, tokens[:-1]), 0)


def test_replay_on_other_weights_reproduces_the_capture() -> None:
    """Graph decode (eager on the CPU) is on: capture / replay steps run paged."""
    tokens, cap = rollout()
    own = reference_selection(OTHER, tokens[:-1])  # what OTHER's indexer would pick
    assert any(
        not torch.equal(own.selection[5][0][t][own.selection[5][1][t]],
                        torch.from_numpy(cap.entries[5][t, : cap.counts[5][t]]).long())
        for t in range(cap.num_positions)
    )  # fmt: skip
    run = runner(OTHER, graph_decode=True)
    rows: list[torch.Tensor] = []
    run.on_logits = lambda results, logits: rows.append(logits.clone())
    params = SamplingParams(max_new_tokens=NEW, capture_topk=True, replay_topk=cap)
    res = run.generate([PROMPT], params)[0]
    assert res.finish_reason == "length" and res.topk is not None
    for layer in cap.layers:  # the re-run selected exactly what was captured
        assert np.array_equal(res.topk.entries[layer], cap.entries[layer])
        assert np.array_equal(res.topk.counts[layer], cap.counts[layer])
    seq = res.prompt + res.output
    want = reference_logits(weights(OTHER), seq[:-1], as_forced(cap))[len(PROMPT) - 1 :]
    assert torch.equal(torch.cat(rows), want)
    unforced = reference_logits(weights(OTHER), seq[:-1])[len(PROMPT) - 1 :]
    assert not torch.equal(want, unforced)


def test_capture_after_a_prefix_hit_holds_the_computed_positions_only() -> None:
    run = runner(CFG)
    run.generate([PROMPT[:50] + [7, 8, 9]], SamplingParams(max_new_tokens=2))
    res = run.generate([PROMPT], SamplingParams(max_new_tokens=NEW, capture_topk=True))[0]
    cap = res.topk
    assert res.cached_tokens == 48 and cap is not None and cap.first_position == 48
    assert cap.num_positions == len(PROMPT) + NEW - 1 - 48
    assert_capture_is(cap, reference_selection(CFG, (res.prompt + res.output)[:-1]), 48)
    with pytest.raises(TopkCaptureError, match="position 48"):  # cannot drive a run from 0
        run.submit(PROMPT, SamplingParams(max_new_tokens=NEW, replay_topk=cap))


def test_export_round_trip_and_bad_captures(tmp_path) -> None:
    _, cap = rollout()
    np.savez(tmp_path / "cap.npz", **cap.to_arrays())
    back = TopkCapture.from_arrays(np.load(tmp_path / "cap.npz"))
    assert back.digest == cap.digest and back.layers == cap.layers
    arrays = cap.to_arrays()
    beyond = dict(arrays, entries_5=arrays["entries_5"].copy())
    beyond["entries_5"][10, 0] = 3  # position 10 sees entries 0 and 1 only
    with pytest.raises(TopkCaptureError, match="beyond"):
        TopkCapture.from_arrays(beyond)
    with pytest.raises(TopkCaptureError, match="entries"):
        TopkCapture.from_arrays(dict(arrays, entries_1=arrays["entries_1"][:, :2]))
    with pytest.raises(TopkCaptureError, match="not a top-k capture"):
        TopkCapture.from_arrays({k: v for k, v in arrays.items() if k != "counts_1"})
    run = runner(CFG)
    unshared = runner(CFG.unshared())  # indexer layers 1, 3, 5, 7
    with pytest.raises(TopkCaptureError, match="layers"):
        unshared.submit(PROMPT, SamplingParams(max_new_tokens=NEW, replay_topk=cap))
    with pytest.raises(TopkCaptureError, match="positions"):
        run.submit(PROMPT, SamplingParams(max_new_tokens=NEW + 5, replay_topk=cap))
    with pytest.raises(TopkCaptureError, match="prompt"):
        run.submit(PROMPT[1:], SamplingParams(max_new_tokens=NEW, replay_topk=cap))
    assert run.num_pending == 0 and unshared.num_pending == 0
    tail = runner(CFG, tail_only=True)
    with pytest.raises(UnsupportedRequestError, match="tail-only"):
        tail.submit(PROMPT, SamplingParams(capture_topk=True))
