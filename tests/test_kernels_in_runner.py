"""The runner with the Triton indexer and attention kernels in place of their references: the
kernels run under Triton's CPU interpreter (see `interpreted`) inside the paged prefill (shared
request tables, causal lengths, a step holding two requests), the eager graph-decode path (page
tables) and with FP8 pools (indexer keys and window KV). Every sampled logit row equals the
dense reference's within 5e-6 (fp32 pools; FP8 pools: within 10 % of the largest logit). This
is the integration the GPU runs; here it needs no GPU."""

from __future__ import annotations

import pytest
import torch
from interpreted import interpreted_modules, run_check
from small_models import SHORT

import adapters.kernels as kernels
from adapters.engine.runner import Runner
from adapters.engine.sampling import SamplingParams
from adapters.memory.formats import CacheFormat
from adapters.model.reference import reference_logits
from adapters.model.weights import init_weights

NAMES = ("indexer", "attention")
BASE = [(13 * i + 5) % 250 for i in range(30)]
PROMPTS = [BASE, BASE[:26] + [7, 8, 9]]  # the second reuses most of the first


@pytest.fixture(scope="module")
def interp():
    return interpreted_modules(NAMES)


def _with_kernels(indexer, attention, fn) -> None:
    """Runs ``fn`` with the package's dispatch sending CPU calls to the interpreted kernels."""
    saved = kernels.index_logits, kernels.sparse_attention
    kernels.index_logits = indexer.flash_index_logits
    kernels.sparse_attention = attention.flash_sparse_attention
    try:
        fn()
    finally:
        kernels.index_logits, kernels.sparse_attention = saved


def _check_runner(graph: bool, fmt: CacheFormat, indexer, attention) -> None:
    cc = SHORT.cache_config(page_size=4, full_capacity=256, swa_capacity=128)
    weights = init_weights(SHORT, "cpu", torch.float32)
    rows: list[tuple[list[int], torch.Tensor]] = []

    def run() -> None:
        r = Runner(SHORT, cc, device="cpu", dtype=torch.float32, weights=weights,
                   chunk_tokens=16, graph_decode=graph, index_format=fmt,
                   swa_format=fmt)  # fmt: skip
        r.on_logits = lambda results, logits: rows.extend(
            (res.prompt + res.output, logits[i].clone()) for i, res in enumerate(results)
        )
        r.generate(PROMPTS, SamplingParams(max_new_tokens=3))

    _with_kernels(indexer, attention, run)
    assert len(rows) == len(PROMPTS) * 3
    for seq, got in rows:
        want = reference_logits(weights, seq)[-1]
        diff = (got - want).abs().max().item()
        if fmt is CacheFormat.BF16:  # the fp32 bound (1.8e-6 measured)
            assert diff <= 5e-6, (len(seq), diff)
        else:  # FP8 pools: the reference keeps fp32 keys and windows
            assert 0 < diff <= 0.1 * want.abs().max().item(), (len(seq), diff)


def check_paged_prefill_and_decode(indexer, attention) -> None:
    _check_runner(False, CacheFormat.BF16, indexer, attention)


def check_graph_decode(indexer, attention) -> None:
    _check_runner(True, CacheFormat.BF16, indexer, attention)


def check_fp8_pools(indexer, attention) -> None:
    _check_runner(True, CacheFormat.FP8, indexer, attention)


CHECKS = ["check_paged_prefill_and_decode", "check_graph_decode", "check_fp8_pools"]


@pytest.mark.parametrize("name", CHECKS)
def test_runner_with_interpreted_kernels(interp, name: str) -> None:
    run_check(interp, globals()[name], NAMES, CHECKS, __file__)
