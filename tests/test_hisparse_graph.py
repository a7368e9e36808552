"""HiSparse inside graph decode (`adapters.memory.residency.GraphResidency`): its two kernels
(`adapters.kernels.hisparse_step`) against their reference under Triton's interpreter, and a
graph-decode Runner with a buffer small enough that pages miss and swap emitting the
all-resident Runner's greedy tokens (also when no miss is ever swapped in: every miss read from
the mirror). A corrupted device table must change the tokens, so the equality can fail."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import pytest
import torch
from interpreted import interpreted_modules, run_check
from small_models import SMALL as SMALL_MODEL
from small_models import one_thread

from adapters.engine.runner import Runner
from adapters.engine.sampling import SamplingParams
from adapters.kernels import hisparse_reference as reference
from adapters.memory.residency import GraphResidency
from adapters.model.model_config import preset
from adapters.model.weights import ModelWeights, init_weights

MODEL = preset("tiny", **{**SMALL_MODEL, "index_topk": 4}, window=16, compress_ratios=(0, 4, 16, 4))
PAGE, BUFFER_PAGES = 16, 5  # 4 C4 entries a page; top-4 + the written page: 5 slots at least
NEW_TOKENS = 20


_one_thread = pytest.fixture(autouse=True, scope="module")(one_thread)


# ------------------------------------------------------------- the gather, interpreted

KERNELS = ("hisparse_step",)


@pytest.fixture(scope="module")
def interp():
    """The interpreted ``hisparse_step`` module, or None: the checks run in a child."""
    return interpreted_modules(KERNELS)


def _operands(rows: int, d: int, dtype: torch.dtype, seed: int):
    """A buffer of 3 pages of 2 rows (the last page the sentinel, NaN but for the last row, so
    that a kernel reading a wrong buffer row returns NaN) and a mirror of 5 pages, a table
    mapping mirror pages 0, 2, 3 to buffer pages 1, 0, -1 (page 4: the sentinel), ``rows``
    slots over the mirror's pages with a random valid mask."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randn(6, d, generator=gen).to(dtype)
    mirror = torch.randn(10, d, generator=gen).to(dtype)
    buf[4] = float("nan")
    table = torch.tensor([1, -1, 0, -1, -1])
    slots = torch.randint(0, 8, (rows,), generator=gen)
    valid = torch.rand(rows, generator=gen) < 0.8
    slots[~valid] = -7  # padding holds anything
    return buf, mirror, table, slots, valid


def _counted(fn, buf, mirror, table, slots, valid):  # type: ignore[no-untyped-def]
    reads, counts = torch.zeros(5, dtype=torch.int32), torch.zeros(2, dtype=torch.long)
    out = fn(buf, mirror, table, slots, valid, reads, counts, 2)
    return out, reads, counts


def check_gather_selected(mod) -> None:  # type: ignore[no-untyped-def]
    for rows, d, dtype in [(13, 5, torch.float32), (7, 32, torch.float64), (9, 1, torch.float16),
                           (1, 24, torch.float32), (300, 8, torch.float32)]:  # fmt: skip
        ops = _operands(rows, d, dtype, seed=rows * d)
        got, g_reads, g_counts = _counted(mod.gather_selected, *ops)
        want, w_reads, w_counts = _counted(reference.gather_selected, *ops)
        _, mirror, table, slots, valid = ops
        assert got.shape == (rows, d) and got.dtype == dtype
        assert not torch.isnan(got).any(), (rows, d, dtype)
        assert torch.equal(got[valid], want[valid]), (rows, d, dtype)
        miss = valid & (table[slots.clamp(min=0) // 2] < 0)
        assert torch.equal(got[miss], mirror[slots[miss]])
        assert torch.equal(g_reads, w_reads) and torch.equal(g_counts, w_counts)
        pages = slots[valid] // 2
        assert torch.equal(w_reads[:4].long(), torch.bincount(pages, minlength=4)[:4])
        assert w_counts.tolist() == [int(valid.sum() - miss.sum()), int(valid.sum())]


def check_gather_zero_rows(mod) -> None:  # type: ignore[no-untyped-def]
    buf, mirror, table, _, _ = _operands(0, 5, torch.float32, seed=2)
    none = torch.zeros(0, dtype=torch.long)
    got, reads, counts = _counted(mod.gather_selected, buf, mirror, table, none, none.bool())
    assert got.shape == (0, 5) and not reads.any() and not counts.any()


def check_store_written(mod) -> None:  # type: ignore[no-untyped-def]
    for d, dtype in [(5, torch.float32), (32, torch.float64), (3, torch.float16)]:
        gen = torch.Generator().manual_seed(d)
        buf, mirror, table, _, _ = _operands(1, d, dtype, seed=d)
        entry = torch.tensor([0, 5, 6, 8])  # pages 0 (resident), 2 (resident), 3, 4 (none)
        values = torch.randn(4, d, generator=gen)  # float32: cast to the pools' dtype
        results = []
        for fn in (mod.store_written, reference.store_written):
            b, m, w = buf.clone(), mirror.clone(), torch.zeros(5, dtype=torch.bool)
            fn(b, m, table, entry, values, w, 2)
            results.append((b, m, w))
        (b, m, w), (rb, rm, rw) = results
        assert torch.equal(m, rm) and torch.equal(w, rw) and w.tolist() == [1, 0, 1, 1, 1]
        assert torch.equal(m[entry], values.to(dtype))
        assert torch.equal(b[:4], rb[:4])  # the sentinel page (rows 4, 5) aside
        assert torch.equal(b[2], values[0].to(dtype)) and torch.equal(b[1], values[1].to(dtype))
        assert torch.equal(b[[0, 3]], buf[[0, 3]])  # rows no entry maps to are untouched


CHECKS = ["check_gather_selected", "check_gather_zero_rows", "check_store_written"]


@pytest.mark.parametrize("name", CHECKS)
def test_hisparse_step_interpreted(interp, name):  # type: ignore[no-untyped-def]
    run_check(interp, globals()[name], KERNELS, CHECKS, __file__)


# ------------------------------------------------------------- graph decode + HiSparse


@functools.cache
def weights() -> ModelWeights:
    return init_weights(MODEL, "cpu", torch.float64)


def make_runner(hisparse: int | None) -> Runner:
    cc = MODEL.cache_config(page_size=PAGE, full_capacity=640, swa_capacity=192)
    return Runner(MODEL, cc, device="cpu", dtype=torch.float64, weights=weights(),
                  chunk_tokens=24, max_running=4, graph_decode=True,
                  hisparse_pages=hisparse)  # fmt: skip


def residency(runner: Runner) -> GraphResidency:
    """The runner's `GraphResidency` (`build.make_model_runner` hands it to the decoder)."""
    decoder = runner.decoder
    assert decoder is not None and decoder.hisparse is not None
    return decoder.hisparse


def prompts() -> list[list[int]]:
    """Three requests over a shared 90-token prefix (its pages are shared in the mirror)."""
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 256, 90).tolist()
    return [shared + rng.integers(0, 256, n).tolist() for n in (5, 30, 50)]


def generate(runner: Runner) -> list[list[int]]:
    done = runner.generate(prompts(), SamplingParams(max_new_tokens=NEW_TOKENS))
    assert all(r.finish_reason == "length" for r in done), [r.error for r in done]
    return [r.output for r in done]


@functools.cache
def resident_outputs() -> list[list[int]]:
    runner = make_runner(None)
    assert runner.offload is None and runner.decoder is not None
    return generate(runner)


def test_graph_hisparse_equals_all_resident() -> None:
    runner = make_runner(BUFFER_PAGES)
    res = residency(runner)
    assert res.max_swaps == MODEL.index_topk
    assert generate(runner) == resident_outputs()
    st = res.stats
    assert st.steps >= NEW_TOKENS - 1  # decode went through the graph path
    assert st.missed_pages > 0  # the miss path ran: pages read from the mirror, then swapped in
    assert st.swap_in_pages >= st.missed_pages - st.dropped_misses > 0
    hit, read = res.hit_rate()
    assert 0 < hit < read  # some entries came from the buffer, some from the mirror
    assert runner.cache.stats().hit_tokens > 0  # the shared prefix was reused
    runner.offload.drain()  # type: ignore[union-attr]
    runner.offload.coordinator.check_invariants()  # type: ignore[union-attr]


def test_no_swaps_reads_every_miss_from_the_mirror() -> None:
    runner = make_runner(BUFFER_PAGES)
    res = residency(runner)
    res.max_swaps = 0  # every missed page read zero-copy, never swapped in
    assert generate(runner) == resident_outputs()
    st = res.stats
    assert st.missed_pages > 0 and st.dropped_misses == st.missed_pages
    hit, read = res.hit_rate()
    assert hit < read


def _corrupt_after_sync(res: GraphResidency) -> Callable[[], None]:
    """`sync_table` followed by a rotation of the buffer slots of the resident pages of the
    first layer: each maps to another resident page's slot (the device table lies)."""
    sync, layer = res.sync_table, res.offload.layers[0]

    def corrupted() -> None:
        sync()
        table = res.table[layer]
        pages = torch.nonzero(table[:-1] >= 0).flatten()
        if len(pages) >= 2:
            table[pages] = table[pages.roll(1)]

    return corrupted


def test_a_corrupted_table_changes_the_tokens() -> None:
    runner = make_runner(BUFFER_PAGES)
    res = residency(runner)
    res.sync_table = _corrupt_after_sync(res)  # type: ignore[method-assign]
    assert generate(runner) != resident_outputs()
    assert res.hit_rate()[0] > 0  # the lying table was read


def test_negative_max_swaps_is_refused() -> None:
    runner = make_runner(BUFFER_PAGES)
    assert runner.offload is not None
    with pytest.raises(ValueError, match="max_swaps"):
        GraphResidency(runner.offload, MODEL, max_rows=4, max_swaps=-1)
