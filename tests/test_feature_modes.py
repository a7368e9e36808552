"""The model's own features (ratio-2 compression, shared candidates, Engram layers) with every
runner mode whose code path they change: each pair works and is tested here, or is refused by
`modes.FEATURE_REFUSED` with `UnsupportedModeError` (issue #17 item 7; docs/runner.md "Mode
combinations").

A working pair serves two requests sharing a 37-token system prompt (the second admitted on a
hit of the first's pages) for 6 greedy tokens on a tiny fp64 model. Exact modes must give the
dense reference's tokens; with a lossy cache format, a paged runner's with the same formats;
under bounded replay (every window tombstoned before the second request) the replayed request
must be flagged approximate and the first must equal the reference; under tail-only (chunks
of 32 tokens, twice the window: each chunk's first 16 skip the late layers) both must equal
the tail-only oracle for the chunks they ran and be flagged.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch
from small_models import SHORT_SHARED, SMALL, fp64_weights, one_thread

from adapters.distributed.engram_shard import place_engram
from adapters.engine.drafts import OracleDraft
from adapters.engine.modes import (
    FEATURE_REFUSED,
    Feature,
    Mode,
    Modes,
    UnsupportedModeError,
    check_modes,
)
from adapters.engine.runner import Runner
from adapters.engine.sampling import SamplingParams
from adapters.memory.formats import CacheFormat
from adapters.model.model_config import ModelConfig, preset
from adapters.model.reference import (
    reference_generate,
    reference_tail_only_generate,
    tail_only_computed,
)

pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
_one_thread = pytest.fixture(autouse=True, scope="module")(one_thread)

C2 = preset("tiny-c2", **SMALL, window=16, compress_ratios=(0, 0, 2, 4, 16, 2))
#: C2 with V4.1 sharing (tail-only needs KV sources and a layer after the last): 1 is the C2
#: source that 2, 4 and 6 read; tail-only skips layers 6 and 7 for a chunk's early tokens
C2_SHARED = preset(
    "tiny", **SMALL, window=16, compress_ratios=(0, 2, 2, 4, 2, 16, 2, 0), kv_sources=(1, 3, 5),
    index_sources=(1, 3, 4),
)  # fmt: skip
CANDIDATES = dataclasses.replace(
    SHORT_SHARED, index_topk=4, candidate_source=1, candidate_blocks=4, candidate_block=2
)
#: the Engram preset with a window of 16 (so 37 tokens hold full windows to replay)
ENGRAM = preset("tiny-engram", engram_rows=509, window=16, compress_ratios=(0, 0, 4, 16, 4, 16))
MODELS = {Feature.C2: C2, Feature.CANDIDATES: CANDIDATES, Feature.ENGRAM: ENGRAM}
#: Engram with a window of 16 and V4.1 sharing: its Engram layer 4 comes after the last KV
#: source (3), so tail-only restricts the Engram step too
ENGRAM_SHARED = dataclasses.replace(ENGRAM, kv_sources=(2, 3), index_sources=(2,))
#: the models tail-only runs on (it needs cross-layer sharing and a layer after the last source)
TAIL_MODELS = {Feature.C2: C2_SHARED, Feature.CANDIDATES: CANDIDATES, Feature.ENGRAM: ENGRAM_SHARED}

_rng = np.random.default_rng(0)
_SYSTEM = _rng.integers(0, 256, 37).tolist()
PROMPTS = [_SYSTEM + _rng.integers(0, 256, k).tolist() for k in (5, 19)]
NEW = 6
CHUNK, TAIL_CHUNK = 16, 32

#: a mode's Runner arguments (``draft`` filled per model) and the table's modes it turns on
RUNS: dict[str, tuple[dict, frozenset[Mode]]] = {
    "paged": ({}, frozenset()),
    "graph decode": ({"graph_decode": True}, frozenset({Mode.GRAPH_DECODE})),
    "speculation, paged verify": ({"speculative_tokens": 2}, frozenset({Mode.SPECULATION})),
    "speculation, graph verify": (
        {"speculative_tokens": 2, "graph_decode": True},
        frozenset({Mode.SPECULATION, Mode.GRAPH_DECODE}),
    ),
    "HiSparse": ({"hisparse_pages": 12}, frozenset({Mode.HISPARSE})),
    "graph decode + HiSparse": (
        {"hisparse_pages": 12, "graph_decode": True},
        frozenset({Mode.HISPARSE, Mode.GRAPH_DECODE}),
    ),
    "tail-only": ({"tail_only": True}, frozenset({Mode.TAIL_ONLY})),
    "bounded replay": ({"bounded_replay": True}, frozenset({Mode.BOUNDED_REPLAY})),
    "FP8 indexer keys": ({"index_format": CacheFormat.FP8}, frozenset({Mode.INDEX_FP8})),
    "FP8 window KV": ({"swa_format": CacheFormat.FP8}, frozenset({Mode.SWA_FP8})),
}
LOSSY = {"FP8 indexer keys", "FP8 window KV"}


def _model(feature: Feature, run: str) -> ModelConfig:
    return TAIL_MODELS[feature] if run == "tail-only" else MODELS[feature]


@functools.cache
def _reference(model: ModelConfig) -> dict[tuple[int, ...], list[int]]:
    rows = place_engram(model, torch.device("cpu"), torch.float64)
    extra = {} if rows is None else {"engram": rows}
    return {tuple(p): reference_generate(fp64_weights(model), p, NEW, **extra) for p in PROMPTS}


def _runner(model: ModelConfig, kw: dict) -> Runner:
    kw = dict(kw)
    spec, replay = "speculative_tokens" in kw, kw.pop("bounded_replay", False)
    engram = Feature.ENGRAM in Feature.of(model)
    page = 16 if "hisparse_pages" in kw or engram else 4
    if engram and "hisparse_pages" in kw:
        kw["hisparse_pages"] = 40  # a query's top-32 pages of 16 plus the page it writes
    if spec:
        kw["draft"] = OracleDraft(_reference(model), 0.5, seed=1)
    chunk = TAIL_CHUNK if kw.get("tail_only") else CHUNK
    cc = model.cache_config(page_size=page, full_capacity=page * 80, swa_capacity=page * 40,
                            debug=True, speculative=spec, bounded_replay=replay)  # fmt: skip
    return Runner(model, cc, device="cpu", dtype=torch.float64, weights=fp64_weights(model),
                  chunk_tokens=chunk, max_running=2, **kw)  # fmt: skip


def _serve(runner: Runner, replay: bool) -> list:
    params = SamplingParams(max_new_tokens=NEW)
    out = runner.generate(PROMPTS[:1], params)
    if replay:
        runner.cache.evict(swa_tokens=10**6)  # every window tombstoned: the hit replays
    out += runner.generate(PROMPTS[1:], params)
    assert all(r.finish_reason != "error" for r in out), [r.error for r in out]
    runner.cache.check_invariants()
    return out


def _refused(feature: Feature, modes: frozenset[Mode]) -> str | None:
    return next((w for (f, m), w in FEATURE_REFUSED.items() if f is feature and m in modes), None)


@pytest.mark.parametrize("run", list(RUNS))
@pytest.mark.parametrize("feature", list(Feature), ids=lambda f: f.name)
def test_a_feature_with_a_mode(feature: Feature, run: str) -> None:
    kw, modes = RUNS[run]
    model = _model(feature, run)
    assert feature in Feature.of(model)
    why = _refused(feature, modes)
    if why is not None:
        with pytest.raises(UnsupportedModeError, match=feature.value) as info:
            _runner(model, kw)
        assert info.value.why == why
        return
    out = _serve(_runner(model, kw), replay=run == "bounded replay")
    if run in LOSSY:  # no fp64 oracle of a lossy format: the paged runner with the same one
        want = [r.output for r in _serve(_runner(model, kw | {"graph_decode": False}), False)]
        assert [r.output for r in out] == want
    elif run == "bounded replay":
        assert out[0].output == _reference(model)[tuple(PROMPTS[0])] and not out[0].approximate
        assert out[1].approximate, "the replayed hit must be flagged"
    elif run == "tail-only":
        a, b = out
        flags_a = _tail_flags(len(PROMPTS[0]))
        hit = b.cached_tokens
        assert 0 < hit < len(PROMPTS[1])
        flags_b = flags_a[:hit] + _tail_flags(len(PROMPTS[1]) - hit)
        w, rows = fp64_weights(model), place_engram(model, torch.device("cpu"), torch.float64)
        assert a.output == reference_tail_only_generate(w, PROMPTS[0], flags_a, NEW, rows)
        assert b.output == reference_tail_only_generate(w, PROMPTS[1], flags_b, NEW, rows)
        assert a.approximate and b.approximate
    else:
        assert [r.output for r in out] == [_reference(model)[tuple(p)] for p in PROMPTS]
        assert not any(r.approximate for r in out)


def _tail_flags(n: int) -> list[bool]:
    """The positions a lone request's tail-only prefill of ``n`` tokens computes late."""
    return tail_only_computed([min(TAIL_CHUNK, n - s) for s in range(0, n, TAIL_CHUNK)], 16)


def test_the_feature_table_refuses_through_check_modes() -> None:
    """Every listed pair raises from `check_modes` naming the feature; a model without the
    feature is not refused; the table names only (feature, mode) pairs."""
    for (feature, mode), why in FEATURE_REFUSED.items():
        active = frozenset({mode, Mode.SPECULATION})  # an MTP draft needs speculation
        with pytest.raises(UnsupportedModeError, match=feature.value) as info:
            check_modes(Modes(active, features=frozenset({feature})))
        assert info.value.why == why and info.value.modes == (feature, mode) or (
            mode is not Mode.SPECULATION and info.value.modes[1] is Mode.SPECULATION
        )
        assert check_modes(Modes(active)) is not None
    assert Feature.of(preset("tiny")) == frozenset()
