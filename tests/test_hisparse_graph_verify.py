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

import numpy as np
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

from adapters.engine.build import check_hisparse
from adapters.engine.drafts import OracleDraft
from adapters.engine.modes import Modes
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
    steps: HiSparse cuts prefill chunks to its 5-page buffer, so decoding starts at other
    steps and the drafts' random errors fall elsewhere.)"""
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


def _mapped_slots_equal_the_mirror(res: GraphResidency) -> None:
    """The residency's exactness invariant: each page the device table maps holds its mirror
    page (tokens alone miss a slot that holds stale data no query happened to read)."""
    res.sync_table()
    for layer, table in res.table.items():
        pages = torch.nonzero(table[:-1] >= 0).flatten()
        buf, host = res.offload.buffer[layer], res.offload.host[layer]
        bad = (buf[table[pages]] != host[pages]).flatten(1).any(1)
        assert not bad.any(), f"layer {layer}: pages {pages[bad].tolist()} differ from the mirror"


def test_mapped_slots_equal_the_mirror_after_every_verify_step(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    runner = make_runner(BUFFER_PAGES)
    res, verify, steps = verifier_residency(runner), GraphVerifier.verify, [0]

    def checked(self, *a, **kw):  # type: ignore[no-untyped-def]
        out = verify(self, *a, **kw)
        _mapped_slots_equal_the_mirror(res)
        steps[0] += 1
        return out

    monkeypatch.setattr(GraphVerifier, "verify", checked)
    assert generate(runner) == resident_outputs()
    assert steps[0] > 10


def test_windows_spanning_verify_steps_between_prefills() -> None:
    """A 33-page buffer: windows span several verify steps, and prefills (eager steps) of the
    waiting requests come between them, committing the open window before their step. A page
    the last commit placed must not be placed as fresh again (it failed those prefills with
    "marked fresh but still holds data" before commits settled the pages' lives)."""
    rng = np.random.default_rng(7)
    long = [rng.integers(0, 256, n).tolist() for n in (300, 333, 290, 410)]
    cc = MODEL.cache_config(page_size=PAGE, full_capacity=PAGE * 160, swa_capacity=PAGE * 48,
                            speculative=True)  # fmt: skip
    kw = dict(device="cpu", dtype=torch.float64, weights=weights(), chunk_tokens=24)
    plain = Runner(MODEL, cc, max_running=4, **kw)  # type: ignore[arg-type]
    want = [r.output for r in plain.generate(long, SamplingParams(max_new_tokens=40))]
    draft = OracleDraft(dict(zip(map(tuple, long), want)), 0.5, seed=5)
    runner = Runner(MODEL, cc, max_running=2, graph_decode=True, hisparse_pages=33,
                    speculative_tokens=K, draft=draft, **kw)  # type: ignore[arg-type]  # fmt: skip
    done = runner.generate(long, SamplingParams(max_new_tokens=40))
    assert [r.error for r in done] == [None] * 4
    assert [r.output for r in done] == want
    assert verifier_residency(runner).stats.commits > 1


@pytest.mark.parametrize(("k", "page", "least"), [(5, 4, 27), (3, 16, 18), (2, 64, 3 * 4 + 2)])
def test_a_paged_verify_buffer_holds_the_pages_its_tokens_span(k: int, page: int, least: int):
    """(k + 1) x top-k reads plus the pages k + 1 tokens can span at this page size: 6 tokens
    span 3 pages of 4 (a buffer of 26 fitted no request at some positions: the runner spun)."""
    modes = Modes(frozenset(), spec_tokens=k)
    with pytest.raises(ValueError, match=f"at least {least}"):
        check_hisparse(MODEL, least - 1, modes, page, max_running=4)
    check_hisparse(MODEL, least, modes, page, max_running=4)


def test_overlap_with_a_buffer_smaller_than_the_batch_is_refused() -> None:
    """Overlapped batches are not cut to the buffer: each running request may write a page a
    step, and a commit placing more pages than the buffer holds failed later requests."""
    cc = MODEL.cache_config(page_size=PAGE, full_capacity=640, swa_capacity=192)
    kw = dict(device="cpu", dtype=torch.float64, weights=weights(), chunk_tokens=24,
              graph_decode=True, overlap=True, hisparse_pages=BUFFER_PAGES)  # fmt: skip
    with pytest.raises(ValueError, match="overlap=False or a larger buffer"):
        Runner(MODEL, cc, max_running=BUFFER_PAGES + 1, **kw)  # type: ignore[arg-type]
    assert Runner(MODEL, cc, max_running=BUFFER_PAGES, **kw).overlap  # type: ignore[arg-type]
