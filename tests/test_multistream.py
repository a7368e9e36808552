"""Multi-stream attention prep in graph decode (`GraphKeys.prepare`, `side_stream`): on the CPU
the side stream's work runs inline before the q / kv projections, so these check that the
reordered step is the same step. Runners with ``multi_stream`` on and off emit the same greedy
tokens (and the reference's) in fp64, with V4.1 sharing and candidate sharing too, and with
HiSparse; every compressed layer of every decode step is prepared (not recomputed in
`attend`), and a prep fed the wrong input changes the tokens, so the equality can fail. A
non-bool value, or multi-stream without the graph decoder, is refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from small_models import SHORT, SHORT_SHARED, fp64_reference, fp64_weights, one_thread

from adapters.engine.modes import UnsupportedModeError
from adapters.engine.runner import Runner
from adapters.engine.sampling import SamplingParams
from adapters.forward.graph_decode import GraphKeys
from adapters.forward.side_stream import SideStream
from adapters.model.model import LayerPrep
from adapters.model.model_config import ModelConfig

_one_thread = pytest.fixture(autouse=True, scope="module")(one_thread)

NEW_TOKENS = 12
#: SHORT_SHARED with candidate sharing: layer 1 publishes candidate blocks, layer 5 selects
#: among them (as tests/test_candidates.py)
CANDIDATES = dataclasses.replace(
    SHORT_SHARED, index_topk=4, candidate_source=1, candidate_blocks=4, candidate_block=2
)


def make_runner(cfg: ModelConfig, multi_stream: object, **kw: object) -> Runner:
    cc = cfg.cache_config(page_size=16, full_capacity=640, swa_capacity=192, debug=True)
    return Runner(cfg, cc, device="cpu", dtype=torch.float64, weights=fp64_weights(cfg),
                  chunk_tokens=24, max_running=4, graph_decode=True,
                  multi_stream=multi_stream, **kw)  # type: ignore[arg-type]  # fmt: skip


def prompts() -> list[list[int]]:
    """Three requests over a shared 40-token prefix: batched decode past several windows."""
    rng = np.random.default_rng(7)
    shared = rng.integers(0, 256, 40).tolist()
    return [shared + rng.integers(0, 256, n).tolist() for n in (3, 17, 30)]


def generate(runner: Runner) -> list[list[int]]:
    done = runner.generate(prompts(), SamplingParams(max_new_tokens=NEW_TOKENS))
    assert all(r.finish_reason == "length" for r in done), [r.error for r in done]
    return [r.output for r in done]


def reference_greedy(cfg: ModelConfig, prompt: list[int], output: list[int]) -> list[int]:
    """The dense reference's argmax after the prompt and each of ``output``'s tokens."""
    logits = fp64_reference(cfg, tuple(prompt + output[:-1]))
    return logits[len(prompt) - 1 :].argmax(-1).tolist()


@pytest.mark.parametrize("cfg", [SHORT, SHORT_SHARED], ids=["short", "shared"])
def test_multi_stream_emits_single_stream_and_reference_tokens(cfg: ModelConfig) -> None:
    on = make_runner(cfg, True)
    assert on.decoder is not None and on.decoder.side is not None
    assert not on.decoder.side.concurrent  # the CPU: inline, in prepare's order
    off = make_runner(cfg, False)
    assert off.decoder is not None and off.decoder.side is None
    got, want = generate(on), generate(off)
    assert got == want
    for p, out in zip(prompts(), got):
        assert out == reference_greedy(cfg, p, out)


def test_multi_stream_with_candidate_sharing() -> None:
    assert generate(make_runner(CANDIDATES, True)) == generate(make_runner(CANDIDATES, False))


def test_multi_stream_with_hisparse() -> None:
    cfg = dataclasses.replace(SHORT, index_topk=4)  # top-4 + the written page: 5 buffer pages
    got = generate(make_runner(cfg, True, hisparse_pages=5))
    assert got == generate(make_runner(cfg, False, hisparse_pages=5))
    assert got == generate(make_runner(cfg, False))


def test_every_compressed_layer_is_prepared(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each decode step forks once per compressed layer, and `attend` never recomputes one."""
    forks: list[int] = []
    fork = SideStream.fork

    def counted(self: SideStream, work, inputs):  # type: ignore[no-untyped-def]
        assert isinstance(inputs, LayerPrep)
        forks.append(inputs.index)
        return fork(self, work, inputs)

    runner = make_runner(SHORT_SHARED, True)
    steps: list[int] = []
    prepare_now = GraphKeys._prepare_now

    def only_prepared(self: GraphKeys, layer):  # type: ignore[no-untyped-def]
        assert isinstance(layer, LayerPrep), "attend recomputed a prepared layer"
        return prepare_now(self, layer)

    monkeypatch.setattr(SideStream, "fork", counted)
    monkeypatch.setattr(GraphKeys, "_prepare_now", only_prepared)
    decoder = runner.decoder
    assert decoder is not None
    run = decoder.graphs.run

    def counted_run(batch: int, context: int) -> torch.Tensor:
        steps.append(batch)
        return run(batch, context)

    monkeypatch.setattr(decoder, "_run", counted_run)  # the eager path calls self._run
    generate(runner)
    compressed = [i for i, r in enumerate(SHORT_SHARED.compress_ratios) if r]
    assert steps and forks == compressed * len(steps)


def test_a_wrong_prep_changes_the_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tokens come from the prepared results: a prep of a scaled input differs."""
    want = generate(make_runner(SHORT, False))
    prepare = GraphKeys.prepare

    def scaled(self: GraphKeys, layer: LayerPrep) -> None:
        prepare(self, dataclasses.replace(layer, x=layer.x * 3.0))

    monkeypatch.setattr(GraphKeys, "prepare", scaled)
    assert generate(make_runner(SHORT, True)) != want


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_non_bool_multi_stream_refused(value: object) -> None:
    with pytest.raises(TypeError, match="multi_stream must be a bool"):
        make_runner(SHORT, value)


def test_multi_stream_needs_the_graph_decoder() -> None:
    cc = SHORT.cache_config(page_size=16, full_capacity=640, swa_capacity=192)
    with pytest.raises(UnsupportedModeError, match="multi-stream attention prep needs graph dec"):
        Runner(SHORT, cc, device="cpu", dtype=torch.float64, weights=fp64_weights(SHORT),
               graph_decode=False, multi_stream=True)  # fmt: skip


def test_multi_stream_refused_with_speculation() -> None:
    cc = SHORT.cache_config(page_size=16, full_capacity=640, swa_capacity=192, speculative=True)
    with pytest.raises(UnsupportedModeError, match="prep with speculative decoding is not sup"):
        Runner(SHORT, cc, device="cpu", dtype=torch.float64, weights=fp64_weights(SHORT),
               graph_decode=True, speculative_tokens=2, multi_stream=True)  # fmt: skip
