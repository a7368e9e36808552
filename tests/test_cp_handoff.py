"""A context-parallel prefill written into a decode engine's pools (`cp_handoff`, issue #16
item 2): the engine's admission of the prompt reuses the page-aligned prefix the CP ranks
computed, and its greedy output equals the single-engine run's and the dense reference's, in
fp64 (ranks are threads: `ThreadWorld`; the spawned gloo path is `tests/test_cp.py`'s).
Leaving out the in-flight rings, or the window, changes the tokens; a refusal changes
nothing."""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest
import torch
from small_models import SHORT, SHORT_SHARED, fp64_weights, one_thread

from adapters.distributed.cp import CPPrefill, cp_prefill
from adapters.distributed.cp_comm import ThreadWorld
from adapters.distributed.cp_handoff import (
    CPHandoffError,
    handoff_range,
    import_cp_prefill,
    swa_positions,
)
from adapters.distributed.pd_pools import pool_tensors
from adapters.engine.runner import Runner
from adapters.engine.sampling import SamplingParams
from adapters.memory.formats import CacheFormat
from adapters.model.model_config import ModelConfig
from adapters.model.reference import reference_generate
from shadowradix import ImportRefused, export_layout, release_layout
from shadowradix.testing import snapshot
from shadowradix.transfer_layout import page_rows

pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
_one_thread = pytest.fixture(autouse=True, scope="module")(one_thread)

NEW = 8
PROMPT = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(7)).tolist()


def _runner(model: ModelConfig, page: int = 4, full: int = 320, **kw) -> Runner:
    cc = model.cache_config(page_size=page, full_capacity=full, swa_capacity=96, debug=True)
    return Runner(model, cc, device="cpu", dtype=torch.float64, weights=fp64_weights(model),
                  chunk_tokens=32, max_running=2, **kw)  # fmt: skip


@functools.cache
def _prefill(model: ModelConfig, page: int, cp: int) -> CPPrefill:
    keep = handoff_range(len(PROMPT), _runner(model, page).cache.config)
    w = fp64_weights(model)
    return ThreadWorld(cp).run(lambda c: cp_prefill(w, PROMPT, 16, c, keep=keep))[0]


@functools.cache
def _reference(model: ModelConfig) -> list[int]:
    return reference_generate(fp64_weights(model), PROMPT, NEW)


def _decode(runner: Runner) -> tuple[list[int], int]:
    (r,) = runner.generate([PROMPT], SamplingParams(max_new_tokens=NEW))
    runner.cache.check_invariants()
    return r.output, r.cached_tokens


@pytest.mark.parametrize("model,page,cp", [(SHORT, 4, 2), (SHORT, 16, 3), (SHORT_SHARED, 8, 2)])
def test_decode_after_a_cp_prefill_equals_one_engine(model, page: int, cp: int) -> None:
    runner = _runner(model, page)
    receipt = import_cp_prefill(runner, PROMPT, _prefill(model, page, cp))
    _, n = handoff_range(len(PROMPT), runner.cache.config)
    assert receipt.num_tokens == n == len(PROMPT) - 1 - (len(PROMPT) - 1) % page
    out, hit = _decode(runner)
    assert hit == n, "the admission must reuse the whole handed-off prefix"
    assert out == _reference(model) == _decode(_runner(model, page))[0]


def test_pages_the_engine_holds_are_not_rewritten() -> None:
    """An engine that already caches the first 64 tokens takes only the pages it lacks: none
    of the pages it held is a destination."""
    runner = _runner(SHORT)
    runner.generate([PROMPT[:64]], SamplingParams(max_new_tokens=1))
    held = export_layout(runner.cache, PROMPT, max_len=64)
    held_pages = set(held.full_pages.tolist())
    release_layout(runner.cache, held)
    receipt = import_cp_prefill(runner, PROMPT, _prefill(SHORT, 4, 2))
    assert len(held_pages) == receipt.reused_pages == 64 // 4
    assert len(receipt.full) + receipt.reused_pages == receipt.num_tokens // 4
    assert not held_pages & set(receipt.full.dst.tolist())
    assert _decode(runner)[0] == _reference(SHORT)


def test_a_prompt_within_one_page_hands_off_nothing() -> None:
    prompt = PROMPT[:4]
    runner = _runner(SHORT)
    keep = handoff_range(len(prompt), runner.cache.config)
    assert keep == (0, 0)
    w = fp64_weights(SHORT)
    pre = ThreadWorld(1).run(lambda c: cp_prefill(w, prompt, 16, c, keep=keep))[0]
    assert import_cp_prefill(runner, prompt, pre).num_tokens == 0
    (r,) = runner.generate([prompt], SamplingParams(max_new_tokens=NEW))
    assert r.output == reference_generate(w, prompt, NEW)


def test_a_ring_shorter_than_the_page_takes_each_pages_last_rows_once() -> None:
    """C4 with overlap at page 16 keeps 8 ring rows a page: the last 8 positions' rows, each
    row written once (a repeated index is a race on CUDA: the CPU's in-order writes hid it)."""
    rows, pos = swa_positions(np.array([3, 5]), 8, 16)
    assert len(np.unique(rows)) == len(rows) == 16
    assert pos.tolist() == list(range(56, 64)) + list(range(88, 96))
    assert rows.tolist() == [p % 8 + (k // 8) * 8 for k, p in enumerate(pos.tolist())]


def _prefix_rows(runner: Runner) -> dict[str, torch.Tensor]:
    """Every pool tensor's rows of the prompt's cached prefix (window pages, virtual pages), in
    the layout's order: comparable across engines whatever page ids they picked."""
    _, n = handoff_range(len(PROMPT), runner.cache.config)
    layout = export_layout(runner.cache, PROMPT, max_len=n)
    try:
        assert layout.num_tokens == n
        out = {}
        for t in pool_tensors(runner.pools):
            rows = page_rows(layout.pages_of(t.pool), t.rows_per_page)
            out[t.name] = t.tensor[torch.from_numpy(rows)]
        return out
    finally:
        release_layout(runner.cache, layout)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("model,page", [(SHORT, 4), (SHORT, 16), (SHORT_SHARED, 8)])
def test_the_pages_hold_what_the_engine_writes_itself(model, page: int) -> None:
    """Every row of the prefix's pages (window latents, in-flight rings, compressed entries,
    indexer keys) equals the row the engine writes prefilling the prompt itself, within 1e-14
    in fp64: the engine pools a chunk's groups in other shapes than the reference and CP do
    (CP's entries are the reference's bit for bit, `tests/test_cp.py`), which moves some
    entries, and the late layers' latents after them, by an ulp or two. Without the rings, or
    the window, they differ by far more."""
    handed = _runner(model, page)
    import_cp_prefill(handed, PROMPT, _prefill(model, page, 2))
    own = _runner(model, page)
    own.generate([PROMPT], SamplingParams(max_new_tokens=1))
    want, got = _prefix_rows(own), _prefix_rows(handed)
    assert _max_diff(got, want) < 1e-14
    good = _prefill(model, page, 2)
    assert good.kept_rows is not None
    for drop in ("_ring", "swa"):
        rows = {k: torch.zeros_like(v) if drop in k else v for k, v in good.kept_rows.items()}
        bad = _runner(model, page)
        import_cp_prefill(bad, PROMPT, replace(good, kept_rows=rows))
        assert _max_diff(_prefix_rows(bad), want) > 1e-3, drop


def test_a_missing_window_changes_the_tokens() -> None:
    good = _prefill(SHORT, 4, 2)
    assert good.kept_rows is not None
    rows = {k: torch.zeros_like(v) if k.startswith("swa") else v for k, v in good.kept_rows.items()}
    runner = _runner(SHORT)
    import_cp_prefill(runner, PROMPT, replace(good, kept_rows=rows))
    assert _decode(runner)[0] != _reference(SHORT)


def test_refusals_change_nothing() -> None:
    prefill = _prefill(SHORT, 4, 2)
    small = _runner(SHORT, full=64)  # 16 pages: the prefix needs 37
    before = snapshot(small.cache)
    with pytest.raises(ImportRefused, match="no_room"):
        import_cp_prefill(small, PROMPT, prefill)
    assert snapshot(small.cache) == before
    other = _runner(SHORT, page=8)  # another prefix end (and window start) than was kept
    with pytest.raises(CPHandoffError, match="kept positions"):
        import_cp_prefill(other, PROMPT, prefill)
    fp8 = _runner(SHORT, swa_format=CacheFormat.FP8)
    before = snapshot(fp8.cache)
    with pytest.raises(CPHandoffError, match="not handed off"):
        import_cp_prefill(fp8, PROMPT, prefill)
    assert snapshot(fp8.cache) == before
    w = fp64_weights(SHORT)
    with pytest.raises(ValueError, match="keep="):
        ThreadWorld(1).run(lambda c: cp_prefill(w, PROMPT, 16, c, keep=(0, 999)))
    other = list(PROMPT)
    other[5] ^= 1  # another prompt of the same length: the same (lo, n)
    runner = _runner(SHORT)
    before = snapshot(runner.cache)
    with pytest.raises(CPHandoffError, match="another prompt"):
        import_cp_prefill(runner, other, prefill)
    hisparse = _runner(SHORT, page=16, hisparse_pages=12)
    with pytest.raises(CPHandoffError, match="HiSparse"):
        import_cp_prefill(hisparse, PROMPT, prefill)
    assert snapshot(runner.cache) == before
