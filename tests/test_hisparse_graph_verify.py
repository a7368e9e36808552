"""HiSparse under graph verify steps (speculative decoding with ``graph_decode=True``): the C4 KV
read and written through the verifier's `GraphResidency`, T = k + 1 query rows per request
(adapters/forward/graph_verify.py, docs/hisparse.md "HiSparse in CUDA graphs").

On the CPU the verifier runs its captured code eagerly, with the residency's torch reference
row movers. Drafts are the target's own continuation with errors injected (`OracleDraft`), so
verify steps accept some drafts and roll back others; greedy outputs must equal graph decode
with every page resident, and the residency must have done the work (misses read from the
mirror, swap-ins), and a lying device table must change the tokens.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from small_models import one_thread
from test_hisparse_graph import (
    BUFFER_PAGES,
    MODEL,
    NEW_TOKENS,
    PAGE,
    _corrupt_after_sync,
    prompts,
    resident_outputs,
    weights,
)

from adapters.engine.drafts import OracleDraft
from adapters.engine.runner import Runner
from adapters.engine.sampling import SamplingParams
from adapters.forward.graph_verify import GraphVerifier
from adapters.memory.residency import GraphResidency

K = 3  # drafts per verify step: T = 4 query rows per request

_one_thread = pytest.fixture(autouse=True, scope="module")(one_thread)


def make_runner(hisparse: int | None, accept_rate: float = 0.6) -> Runner:
    table = {tuple(p): out for p, out in zip(prompts(), resident_outputs())}
    cc = MODEL.cache_config(page_size=PAGE, full_capacity=640, swa_capacity=192, speculative=True)
    return Runner(MODEL, cc, device="cpu", dtype=torch.float64, weights=weights(),
                  chunk_tokens=24, max_running=4, graph_decode=True, hisparse_pages=hisparse,
                  speculative_tokens=K, draft=OracleDraft(table, accept_rate, seed=3))  # fmt: skip


def verifier_residency(runner: Runner) -> GraphResidency:
    verifier = runner.model_runner.verifier
    assert verifier is not None and verifier.hisparse is not None
    return verifier.hisparse


def generate(runner: Runner) -> list[list[int]]:
    done = runner.generate(prompts(), SamplingParams(max_new_tokens=NEW_TOKENS))
    assert all(r.finish_reason == "length" for r in done), [r.error for r in done]
    return [r.output for r in done]


def test_graph_verify_with_hisparse_equals_all_resident() -> None:
    runner = make_runner(BUFFER_PAGES)
    res = verifier_residency(runner)
    assert runner.decoder is None  # every decode step is a verify step
    assert res.max_rows == 4 * (K + 1)
    assert generate(runner) == resident_outputs()
    spec = runner.spec.stats  # type: ignore[union-attr]
    assert spec.forwards > 0 and 0 < spec.accepted_tokens < spec.drafted_tokens  # rejects too
    st = res.stats
    assert st.steps == spec.forwards  # every verify step went through the residency
    assert st.missed_pages > 0 and st.swap_in_pages > 0 and st.commits > 0
    hit, read = res.hit_rate()
    assert 0 < hit < read
    runner.offload.drain()  # type: ignore[union-attr]
    runner.offload.coordinator.check_invariants()  # type: ignore[union-attr]


def test_graph_verify_with_hisparse_equals_its_all_resident_twin() -> None:
    """All-resident graph verify with the same draft source: the same tokens. (Not the same
    steps: the HiSparse budget runs fewer requests a step when their working sets do not all
    fit a 5-page buffer, so the drafts' random errors fall elsewhere.)"""
    plain, hs = make_runner(None, 0.4), make_runner(BUFFER_PAGES, 0.4)
    assert plain.offload is None and plain.model_runner.verifier is not None
    assert generate(hs) == generate(plain) == resident_outputs()
    assert hs.spec.stats.forwards > plain.spec.stats.forwards  # type: ignore[union-attr]


def test_a_corrupted_table_changes_the_verified_tokens() -> None:
    runner = make_runner(BUFFER_PAGES)
    res = verifier_residency(runner)
    res.sync_table = _corrupt_after_sync(res)  # type: ignore[method-assign]
    assert generate(runner) != resident_outputs()
    assert res.hit_rate()[0] > 0


def test_a_graph_step_needs_only_the_pages_it_writes_to_fit() -> None:
    """Every request's verify step runs at once in graphs (misses are read from the mirror);
    the eager executor's bound, every page k + 1 queries may read, fits none of them here."""
    runner = make_runner(BUFFER_PAGES)
    for prompt in prompts():  # long outputs: the first still decodes when the last prefilled
        runner.submit(prompt, SamplingParams(max_new_tokens=300))
    while runner.num_prefilling:  # prefill runs paged: one token a step in 5 pages
        runner.step()
    seqs = runner.budget.decode_rows()
    assert len(seqs) == 3 and runner.budget.fit_decode_batch(seqs) == seqs
    runner.budget.config = dataclasses.replace(runner.budget.config, graph_reads=False)
    assert runner.budget.fit_decode_batch(seqs) == []  # each needs min(4 x 4 + 1, its pages)


def test_a_buffer_too_small_for_a_paged_verify_step_is_refused() -> None:
    cc = MODEL.cache_config(page_size=PAGE, full_capacity=640, swa_capacity=192, speculative=True)
    kw = dict(device="cpu", dtype=torch.float64, weights=weights(), chunk_tokens=24,
              graph_decode=False, speculative_tokens=K)  # fmt: skip
    need = (K + 1) * MODEL.index_topk + 2
    with pytest.raises(ValueError, match=f"paged verify step.*at least {need}"):
        Runner(MODEL, cc, hisparse_pages=need - 1, **kw)  # type: ignore[arg-type]
    assert Runner(MODEL, cc, hisparse_pages=need, **kw).offload is not None  # type: ignore[arg-type]
    graph = Runner(MODEL, cc, hisparse_pages=BUFFER_PAGES, **{**kw, "graph_decode": True})  # type: ignore[arg-type]
    assert graph.model_runner.verifier is not None


def test_a_residency_too_small_for_the_verify_rows_is_refused() -> None:
    runner = make_runner(BUFFER_PAGES)
    assert runner.offload is not None
    small = GraphResidency(runner.offload, MODEL, max_rows=4)
    cc = runner.cache.config
    with pytest.raises(ValueError, match="query rows"):
        GraphVerifier(weights(), runner.pools, cc, 4, cc.full_capacity, K + 1, hisparse=small)
