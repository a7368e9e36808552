"""HiSparse graph decode plans once a window of ``commit_every`` graph steps
(`adapters.memory.residency.GraphResidency`): every window length emits the all-resident
Runner's greedy tokens, the window ends after its ``commit_every``-th step, and a window ends
early when the cache ends page lives (its records belong to the old lives: planning a read of a
released page would ask the coordinator for data it dropped)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from small_models import one_thread
from test_hisparse_graph import (
    BUFFER_PAGES,
    MODEL,
    NEW_TOKENS,
    generate,
    make_runner,
    residency,
    resident_outputs,
    weights,
)

from adapters.engine.runner import Runner
from adapters.engine.sampling import SamplingParams
from adapters.memory.residency import COMMIT_EVERY, GraphResidency, most_read, window_reads
from hisparse.errors import MissingPageDataError

_one_thread = pytest.fixture(autouse=True, scope="module")(one_thread)

#: a buffer with room for several steps' writes (the 5-page one ends a window every step)
WINDOW_PAGES = 16


@pytest.mark.parametrize(("every", "pages"), [(1, BUFFER_PAGES), (3, BUFFER_PAGES),
                                              (COMMIT_EVERY, BUFFER_PAGES), (1000, 16)])
def test_every_window_length_equals_all_resident(every: int, pages: int) -> None:
    """(1,000 steps with a 16-page buffer: the writes bound ends a window every 4 steps or
    so, the 5-page buffer's after almost every step; the misses run with the 5-page one.)"""
    runner = make_runner(pages)
    res = residency(runner)
    res.commit_every = every
    assert generate(runner) == resident_outputs()
    st = res.stats
    assert st.steps >= NEW_TOKENS - 1
    assert st.missed_pages > 0 or pages > BUFFER_PAGES  # (16 pages hold every page read)
    if every == 1:  # a plan after every graph step (the last one's waits for the next step)
        assert st.commits >= st.steps - 1
    if every == 1000:  # eager steps (mixed with these prefills), releases, the writes bound
        assert st.commits < st.steps - 10
    runner.offload.drain()  # type: ignore[union-attr]
    runner.offload.coordinator.check_invariants()  # type: ignore[union-attr]


def test_the_window_ends_after_its_last_step() -> None:
    runner = make_runner(6 * BUFFER_PAGES)  # room for 4 steps' writes: the count ends windows
    res = residency(runner)
    res.commit_every = 4
    opens = []
    after_step = res.after_step

    def record() -> None:
        after_step()
        opens.append((res._open, res._pending is not None))

    res.after_step = record  # type: ignore[method-assign]
    generate(runner)
    assert all(n < 4 for n, _ in opens)
    assert all(pending == (n == 0) for n, pending in opens)  # ended now: pending until launch
    assert (1, False) in opens and (3, False) in opens and (0, True) in opens


def test_a_commit_leaves_the_device_tables_current() -> None:
    """A commit's table changes are queued with its copies (behind the launched step, which
    read the tables as they were), not left for the next step's host work before its launch:
    after every commit each layer's device table maps each page to the coordinator's slot."""
    runner = make_runner(6 * BUFFER_PAGES)
    res = residency(runner)
    res.commit_every = 2
    checked = []
    commit = res._commit_pending

    def check() -> None:
        planned = res._pending is not None
        commit()
        if not planned:
            return
        coord, pages = res.offload.coordinator, np.arange(len(res._mark))
        for j, layer in enumerate(res.offload.layers):
            assert res.table[layer][:-1].tolist() == coord.slots(j, pages).tolist()
        checked.append(True)

    res._commit_pending = check  # type: ignore[method-assign]
    assert generate(runner) == resident_outputs()
    assert len(checked) >= 3


def _before_step_without_early_end(res: GraphResidency) -> None:
    """`GraphResidency.before_step` without ending the open window on releases (the bug this
    file's release test must catch)."""
    res.offload.drain()
    res._deferring = True
    try:
        res.offload.begin_step()
    finally:
        res._deferring = False
    if res._pending is not None:
        res._ended.append(res.offload.last_ended)
    res.sync_table()


def _evict_mid_window(hisparse: int | None, early_end: bool = True) -> tuple[Runner, list]:
    """Two requests; once the short one finished and the open window holds graph steps
    after it (its reads of its own pages in the window), every unlocked tree page is
    evicted, then decoding goes on to the end. Returns the runner and the outputs."""
    runner = make_runner(hisparse)
    res = residency(runner) if hisparse is not None else None
    if res is not None:
        res.commit_every = 1000
        if not early_end:
            res.before_step = lambda: _before_step_without_early_end(res)  # type: ignore
    rng = np.random.default_rng(3)
    ids = [runner.submit(rng.integers(0, 256, n).tolist(), SamplingParams(max_new_tokens=m))
           for n, m in ((70, 4), (40, 30))]  # fmt: skip
    done: list = []
    while not done:
        done += runner.step()
    done += runner.step() + runner.step()  # graph steps of the long request alone
    assert res is None or res._open >= 2  # ... in the open window, with the short one's
    assert runner.cache.evict(full_tokens=runner.cache.config.full_capacity).full_pages > 0
    done += runner.step()  # with HiSparse: releases the evicted pages (`begin_step`)
    if res is not None:
        res.commit()  # an eager step's commit: plans the window the release fell in
    while runner.num_pending:
        done += runner.step()
    outputs = {r.request_id: r.output for r in done}
    return runner, [outputs[i] for i in ids]


def test_released_pages_end_the_window() -> None:
    runner, outputs = _evict_mid_window(WINDOW_PAGES)
    assert [len(o) for o in outputs] == [4, 30]
    assert outputs == _evict_mid_window(None)[1]
    runner.offload.drain()  # type: ignore[union-attr]
    runner.offload.coordinator.check_invariants()  # type: ignore[union-attr]


def test_a_window_across_a_release_plans_dropped_pages() -> None:
    """Without the early end, the window's reads of the evicted pages are planned after the
    coordinator released them: it refuses (no data), so the early end is what keeps the run
    going."""
    with pytest.raises(MissingPageDataError):
        _evict_mid_window(WINDOW_PAGES, early_end=False)


def test_window_reads_drops_written_and_released_pages() -> None:
    counts = np.array([0, 2, 1, 0, 5, 1], np.int32)
    pages = window_reads(counts, np.array([2]), np.array([5]))
    assert pages.tolist() == [1, 4]
    assert counts.tolist() == [0, 2, 0, 0, 5, 0]


@pytest.mark.parametrize("seed", range(20))
def test_most_read_picks_the_most_read_pages_lower_page_on_ties(seed: int) -> None:
    """The partition picks what a stable sort by reads (descending) keeps first: few distinct
    counts, so most picks are decided by the tie rule."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 4, 300).astype(np.int32)
    pages = np.flatnonzero(rng.random(300) < 0.6)
    for n in (-2, 0, 1, 7, len(pages) // 2, len(pages) - 1, len(pages), len(pages) + 3):
        expect = pages[np.argsort(-counts[pages], kind="stable")[: max(n, 0)]]
        assert sorted(most_read(pages, counts, n).tolist()) == sorted(expect.tolist())


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_commit_every_is_refused(bad: object) -> None:
    runner = make_runner(BUFFER_PAGES)
    assert runner.offload is not None
    with pytest.raises(ValueError, match="commit_every"):
        GraphResidency(runner.offload, MODEL, max_rows=4, commit_every=bad)  # type: ignore[arg-type]


def test_decode_rows_stay_put_when_every_working_set_fits() -> None:
    """With room in the HiSparse buffer for every request's working set, the decode batch
    keeps its order from step to step, so the device block tables rewrite no row whole
    (a rotating order rewrote every row every step: half a millisecond on the H200)."""
    runner = make_runner(4 * BUFFER_PAGES)  # 3 requests x (top-4 + the written page) fit
    tables = runner.decoder.buffers.tables  # type: ignore[union-attr]
    loads: list[int] = []
    load_row = tables._load_row

    def counted(i, r):  # type: ignore[no-untyped-def]
        loads.append(r.id)
        return load_row(i, r)

    tables._load_row = counted  # type: ignore[method-assign]
    assert generate(runner) == resident_outputs()
    steps = residency(runner).stats.steps
    assert steps >= NEW_TOKENS - 1
    assert len(loads) <= 3 * 3, loads  # each request placed once, again after a finish at most


def _short_requests(hisparse: int | None, every: int, seed: int) -> list:
    """Eight short requests over a 5-page buffer: one step's working set fits (5 pages), eight
    requests' writes do not, so the decode batch rotates and a window's written pages would
    outgrow the buffer if the window did not end first."""
    cc = MODEL.cache_config(page_size=16, full_capacity=1280, swa_capacity=384)
    runner = Runner(MODEL, cc, device="cpu", dtype=torch.float64, weights=weights(),
                    chunk_tokens=64, max_running=8, graph_decode=True,
                    hisparse_pages=hisparse)  # fmt: skip
    if hisparse is not None:
        residency(runner).commit_every = every
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 256, int(rng.integers(8, 30))).tolist() for _ in range(8)]
    done = runner.generate(prompts, SamplingParams(max_new_tokens=40))
    assert all(r.error is None for r in done), [r.error for r in done if r.error]
    return [r.output for r in done]


@pytest.mark.parametrize("every", [8, 1000])
def test_a_window_never_writes_more_pages_than_the_buffer(every: int) -> None:
    assert _short_requests(BUFFER_PAGES, every, seed=1) == _short_requests(None, 1, seed=1)
