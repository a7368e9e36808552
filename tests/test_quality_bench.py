"""bench/quality.py: log-probabilities through the runner with prefix reuse equal the dense
reference exactly in fp64, and the approximation rows measure a difference (no timing)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from adapters.model.model_config import preset
from adapters.model.weights_file import load_shipped

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("quality_bench", ROOT / "bench/quality.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["quality_bench"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def docs(bench) -> list[bytes]:
    return bench.heldout_docs(ROOT / "data" / "kjv_fixture", 1, 150)


def test_cached_logprobs_equal_the_reference_in_float64(bench, docs) -> None:
    model = preset("tiny-trained")
    weights = load_shipped(model, "cpu", torch.float64)
    got = bench.exactness(model, weights, docs, chunk_tokens=64)
    assert got.hit_tokens > 0  # the second request of each document reused the first's prefix
    assert got.scored_bytes == sum(len(d) for d in docs)
    assert got.max_abs_logprob_diff == 0.0
    assert got.bits_per_byte == got.reference_bits_per_byte
    assert 0.5 < got.bits_per_byte < 4.0  # trained: far below log2(258) = 8.01


def test_an_approximate_format_moves_the_scores(bench, docs) -> None:
    model = preset("tiny-trained")
    weights = load_shipped(model, "cpu", torch.float64)
    args = dict(score_bytes=64, greedy=4, chunk_tokens=64)
    exact = bench.serve_setup(model, weights, bench.Setup("exact"), docs[0], **args)
    again = bench.serve_setup(model, weights, bench.Setup("exact"), docs[0], **args)
    fp8 = bench.Setup("fp8", swa_format=bench.CacheFormat.FP8)
    moved = bench.serve_setup(model, weights, fp8, docs[0], **args)
    assert exact.bits == again.bits and exact.tokens == again.tokens
    assert math.isfinite(moved.bits) and moved.bits != exact.bits
    assert bench.agreement([1, 2, 3, 4], [1, 2, 5, 4]) == (2, 0.75)


def test_tail_only_scores_the_decoder_side_effect(bench) -> None:
    """Tail-only's scored bytes run every layer over the state a tail-only prefill left: with
    prefill chunks no longer than the window nothing is skipped and the scores equal the exact
    runner's; with longer chunks the skipped rows' holes move them."""
    model = preset("tiny-shared-trained")
    weights = load_shipped(model, "cpu", torch.float64)
    doc = bench.heldout_docs(ROOT / "data" / "kjv_fixture", 1, 400)[0]
    tokens = [bench.BOS, *doc]
    first = len(tokens) - 64
    exact = bench.serve_setup(model, weights, bench.Setup("exact"), doc, 64, 1, 256)
    tail = bench.Setup("tail-only", tail_only=True)
    short = bench.tail_only_scores(model, weights, tail, tokens, first, 1, model.window)
    long = bench.tail_only_scores(model, weights, tail, tokens, first, 1, 256)
    bits = [-sum(s[i] for i in range(first, len(tokens))) / math.log(2) for s in (short, long)]
    assert bits[0] == pytest.approx(exact.bits, rel=1e-12)
    assert bits[1] != pytest.approx(exact.bits, rel=1e-6)
