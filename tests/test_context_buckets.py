"""Decode context buckets (`buckets.context_bucket`): a step's entry columns follow its
bucket, so the bucket must cover the longest request, stay within 1/8 of it above 1,024 tokens,
keep every compression ratio's group whole, and the graph decoder must equal the reference at
a bucket that is no power of two."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from small_models import CFG

from adapters.engine.runner import Runner
from adapters.engine.sampling import SamplingParams
from adapters.forward.buckets import CONTEXT_BUCKET_STEPS, context_bucket
from adapters.model.reference import reference_generate
from adapters.model.weights import init_weights

pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")


@given(n=st.integers(1, 1 << 24), lo=st.sampled_from([8, 64, 1024]))
def test_bucket_covers_and_bounds(n: int, lo: int) -> None:
    b = context_bucket(n, lo, 1 << 30)
    assert b >= max(n, lo)
    assert context_bucket(n + 1, lo, 1 << 30) >= b  # monotone
    if n > 1024 and b > lo:
        assert b * CONTEXT_BUCKET_STEPS <= n * (CONTEXT_BUCKET_STEPS + 1) + 128 * 8
        assert b % 128 == 0  # C4 and C128 groups whole
    else:
        assert b == max(lo, 1 << (n - 1).bit_length())  # powers of two, as before


def test_bucket_examples_and_cap() -> None:
    assert context_bucket(1_048_640, 1024, 1 << 30) == 9 << 17  # was 2,097,152
    assert context_bucket(1_048_576, 1024, 1 << 30) == 1 << 20
    assert context_bucket(4_160, 1024, 1 << 30) == 4_608
    assert context_bucket(4_160, 1024, 4_200) == 4_200  # never past the buffers
    assert context_bucket(100, 1024, 1 << 30) == 1024


def test_graph_decode_at_a_fine_bucket_equals_reference() -> None:
    """A 1,100-token prompt decodes at bucket 1,152 (9 x 128) through `GraphDecoder` (eager on
    the CPU): the greedy tokens equal the reference's."""
    torch.set_num_threads(1)
    weights = init_weights(CFG, "cpu", torch.float64)
    cc = CFG.cache_config(page_size=16, full_capacity=16 * 90, swa_capacity=16 * 50, debug=True)
    runner = Runner(CFG, cc, device="cpu", dtype=torch.float64, weights=weights,
                    chunk_tokens=512, max_running=2, graph_decode=True)  # fmt: skip
    prompt = np.random.default_rng(5).integers(0, 256, 1100).tolist()
    assert runner.decoder is not None
    assert context_bucket(1101, runner.decoder.min_context_bucket, cc.full_capacity) == 1152
    (res,) = runner.generate([prompt], SamplingParams(max_new_tokens=4))
    assert res.error is None
    assert res.output == reference_generate(weights, prompt, 4)
    runner.cache.check_invariants()
