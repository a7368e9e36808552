"""Which of the runner's modes combine: one table of every pair (and the triples that matter),
and the check `Runner(...)` and `budget_runner(...)` make against it before they allocate
anything (docs/runner.md, "Mode combinations").

A pair is one of::

    EXACT        works; outputs equal the run without its execution modes (what defines the
                 output is the model, the cache formats and the sampling seed; graph decode,
                 overlap, speculation, HiSparse, re-balance, a memory budget and the schedule
                 only execute it)
    APPROXIMATE  works; tail-only prefill or bounded replay changes outputs by design, and
                 every result they touched is flagged (`GenerationResult.approximate`)
    REFUSED      `UnsupportedModeError` naming both modes and why
    ONE_OPTION   two values of one option (FP8 and FP4 indexer keys): nothing to combine

`tests/test_modes.py` builds a runner for every pair of the table that works and checks its
property, and one for every refused pair and checks the error.

A model's own features (`Feature`: ratio-2 compression, shared candidates, Engram layers) meet
the modes in a second table, `FEATURE_REFUSED` (everything not listed works exactly);
`tests/test_feature_modes.py` runs every feature with every mode whose code path it changes.

`UnsupportedModeError` is a `ConfigError` (so a `ValueError`), not an `InvalidRequestError`:
it is a property of the runner's configuration, found at construction before any pool is
allocated, never of one request. `Runner.generate` turns `InvalidRequestError` into a
per-prompt error result; a mode that cannot run must stop the construction instead.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from adapters.engine.drafts import DraftSource
from adapters.engine.waiting import SchedulePolicy
from adapters.memory.formats import CacheFormat
from adapters.model.model_config import ModelConfig
from shadowradix import ConfigError


class Mode(enum.Enum):
    """One mode of a runner (``SAMPLING`` is a request's: temperature > 0)."""

    GRAPH_DECODE = "graph decode"
    OVERLAP = "overlap scheduling"
    SPECULATION = "speculative decoding"
    MTP_DRAFT = "an MTP-state draft (MTP layer, EAGLE head)"
    SAMPLING = "temperature > 0"
    BOUNDED_REPLAY = "bounded replay"
    TAIL_ONLY = "tail-only prefill"
    HISPARSE = "HiSparse"
    INDEX_FP8 = "FP8 indexer keys"
    INDEX_FP4 = "FP4 indexer keys"
    SWA_FP8 = "FP8 window KV"
    REBALANCE = "run-time pool re-balance"
    MEMORY_BUDGET = "a memory budget"
    FCFS = "FCFS admission"
    SHARING = "V4.1 cross-layer sharing"
    MULTI_STREAM = "multi-stream attention prep"


class Feature(enum.Enum):
    """A property of the model that the runner's modes must carry (issue #17's V4.1 parts)."""

    C2 = "ratio-2 compression"
    CANDIDATES = "two-level shared candidates"
    ENGRAM = "Engram memory layers"

    @classmethod
    def of(cls, model: ModelConfig) -> frozenset[Feature]:
        on = {
            cls.C2: 2 in model.compress_ratios,
            cls.CANDIDATES: model.candidate_source is not None,
            cls.ENGRAM: bool(model.engram_layers),
        }
        return frozenset(f for f, v in on.items() if v)


class Support(enum.Enum):
    EXACT = "works, exact"
    APPROXIMATE = "works, approximate (flagged)"
    REFUSED = "refused"
    ONE_OPTION = "one option"


@dataclass(frozen=True)
class Combination:
    """What the table says of ``modes`` (two, or three for a listed triple)."""

    modes: frozenset[Mode]
    support: Support
    why: str

    @property
    def works(self) -> bool:
        return self.support in (Support.EXACT, Support.APPROXIMATE)


class UnsupportedModeError(ConfigError):
    """Two modes of a runner's configuration that cannot run together (``modes``, in the
    table's order) and why; raised before anything is allocated."""

    def __init__(
        self, modes: tuple[Mode | Feature, Mode], why: str, *, needs: bool = False
    ) -> None:
        self.modes, self.why = modes, why
        a, b = modes[0].value, modes[1].value
        message = f"{a} needs {b}" if needs else f"{a} with {b} is not supported"
        super().__init__(f"{message}: {why}")


M = Mode
_OVERLAP_SPEC = (
    "overlap scheduling needs the graph decoder: speculative decoding runs serialised (the "
    "host reads each verify step's acceptance before it drafts the next)"
)
_REPLAY_SPEC = (
    "bounded replay cannot be combined with speculative decoding (DeepSeek-V4's design "
    "describes encoder-side replay as incompatible with it; CacheConfig refuses the pair)"
)
_MULTI_STREAM_SPEC = (
    "speculative decode steps run through the graph verifier, whose attention prep is on one "
    "stream"
)
#: every refused pair and why (the first mode is the one the message names first)
REFUSED: dict[tuple[Mode, Mode], str] = {
    (M.OVERLAP, M.SPECULATION): _OVERLAP_SPEC,
    (M.OVERLAP, M.MTP_DRAFT): _OVERLAP_SPEC,
    (M.SPECULATION, M.BOUNDED_REPLAY): _REPLAY_SPEC,
    (M.MTP_DRAFT, M.BOUNDED_REPLAY): _REPLAY_SPEC,
    (M.MTP_DRAFT, M.TAIL_ONLY): (
        "the MTP layer reads the main model's hidden state at every prompt position, which "
        "tail-only prefill does not compute past the last KV source (use another draft source)"
    ),
    (M.MULTI_STREAM, M.SPECULATION): _MULTI_STREAM_SPEC,
    (M.MULTI_STREAM, M.MTP_DRAFT): _MULTI_STREAM_SPEC,
    (M.HISPARSE, M.REBALANCE): (
        "HiSparse's host mirror and device buffer are keyed by page id, which a run-time "
        "re-balance moves"
    ),
}
ONE_OPTION: dict[tuple[Mode, Mode], str] = {
    (M.INDEX_FP8, M.INDEX_FP4): "two values of index_format",
}
#: a mode that is only ever on with another (the pair works: it is how the mode runs)
REQUIRES: dict[Mode, tuple[Mode, str]] = {
    M.OVERLAP: (
        M.GRAPH_DECODE,
        "overlap scheduling needs the graph decoder: the paged decode path (graph_decode="
        "False) runs serialised",
    ),
    M.MTP_DRAFT: (M.SPECULATION, "a draft source needs speculative_tokens=k"),
    M.TAIL_ONLY: (M.SHARING, "tail_only needs cross-layer KV sharing (ModelConfig.kv_sources)"),
    M.MULTI_STREAM: (
        M.GRAPH_DECODE,
        "multi_stream forks the graph decoder's compressor and indexer: the paged decode path "
        "runs on one stream",
    ),
}
#: what the pairs that work rely on, where it is not just "independent parts"
NOTES: dict[tuple[Mode, Mode], str] = {
    (M.TAIL_ONLY, M.SPECULATION): "verify steps of k + 1 <= window rows run every layer; "
    "paged and graph verify mask the late-SWA holes (k + 1 > window is refused)",
    (M.TAIL_ONLY, M.BOUNDED_REPLAY): "a replay rebuilds at most the window, so it runs every "
    "layer; the sources' compressed KV it reads was computed over every token",
    (M.TAIL_ONLY, M.HISPARSE): "HiSparse cuts prefill chunks to its buffer: a chunk cut to "
    "the window or less skips nothing",
    (M.TAIL_ONLY, M.MEMORY_BUDGET): "the budget cuts prefill chunks: shorter chunks skip less",
    (M.TAIL_ONLY, M.REBALANCE): "a re-balance moves the late-SWA bits with their pages",
    (M.BOUNDED_REPLAY, M.HISPARSE): "replay slices are cut to fit the HiSparse buffer",
    (M.GRAPH_DECODE, M.HISPARSE): "graph decode reads the C4 KV through a device residency "
    "table: buffer rows, or the pinned host mirror zero-copy (adapters/memory/residency.py)",
    (M.SPECULATION, M.HISPARSE): "verify steps read the C4 KV through the executor (paged) or "
    "the residency table (graph verify); rolled-back drafts end their pages' lives by FREED "
    "events",
    (M.MTP_DRAFT, M.HISPARSE): "the MTP state is outside HiSparse; its verify steps read the C4 "
    "KV as any draft's do",
    (M.OVERLAP, M.HISPARSE): "exact: a graph step's swap-ins are planned from the previous "
    "step's selection after the next launch; the gain over that is not measured",
    (M.SPECULATION, M.SAMPLING): "rejection sampling: the target's distribution, not the "
    "tokens of a run without speculation",
    (M.MTP_DRAFT, M.SAMPLING): "rejection sampling against the MTP draft's distribution",
    (M.OVERLAP, M.SAMPLING): "decode steps with a sampled request run serialised (counted)",
    (M.OVERLAP, M.GRAPH_DECODE): "overlap scheduling is a way of running the graph decoder",
    (M.MTP_DRAFT, M.SPECULATION): "the MTP layer (or an EAGLE head) as the draft source",
    (M.TAIL_ONLY, M.SHARING): "tail-only skips the layers after the last KV source",
    (M.MULTI_STREAM, M.GRAPH_DECODE): "the compressor and the indexer of each compressed layer "
    "on a side stream, joined before attention (inline on the CPU)",
    (M.MULTI_STREAM, M.HISPARSE): "the side stream's indexer selection feeds the residency "
    "table's gather after the join",
}
#: triples whose parts meet in one code path, tested as such
TRIPLES: dict[tuple[Mode, Mode, Mode], str] = {
    (M.TAIL_ONLY, M.SPECULATION, M.GRAPH_DECODE): "graph verify with the late-SWA mask",
    (M.TAIL_ONLY, M.BOUNDED_REPLAY, M.GRAPH_DECODE): "graph decode over replayed windows of a "
    "tail-only prefix",
    (M.TAIL_ONLY, M.BOUNDED_REPLAY, M.HISPARSE): "replay slices in the buffer, tail-only",
    (M.SPECULATION, M.GRAPH_DECODE, M.SWA_FP8): "graph verify writes FP8 window rows",
    (M.SPECULATION, M.GRAPH_DECODE, M.REBALANCE): "the verifier's tables follow re-balances",
    (M.GRAPH_DECODE, M.HISPARSE, M.SHARING): "consumer C4 layers read their source's buffer "
    "or mirror through the source's residency table",
    (M.GRAPH_DECODE, M.SPECULATION, M.HISPARSE): "graph verify reads and writes the C4 KV "
    "through a residency table of batch x (k + 1) query rows",
    (M.GRAPH_DECODE, M.MTP_DRAFT, M.HISPARSE): "graph verify with HiSparse, the MTP state "
    "outside it",
}
_ENGRAM_SPEC = (
    "the verify and draft paths (graph verifier, MTP layer, EAGLE head) do not wire the Engram "
    "lookup yet (docs/engram.md)"
)
#: every (model feature, mode) pair that is refused; any other pair works exactly
FEATURE_REFUSED: dict[tuple[Feature, Mode], str] = {
    (Feature.ENGRAM, M.SPECULATION): _ENGRAM_SPEC,
    (Feature.ENGRAM, M.MTP_DRAFT): _ENGRAM_SPEC,
}
APPROXIMATE_MODES = frozenset({M.TAIL_ONLY, M.BOUNDED_REPLAY})


def _verdict(modes: tuple[Mode, ...]) -> Combination:
    key = frozenset(modes)
    for table, support in ((REFUSED, Support.REFUSED), (ONE_OPTION, Support.ONE_OPTION)):
        for pair, why in table.items():
            if frozenset(pair) <= key:
                return Combination(key, support, why)
    approximate = key & APPROXIMATE_MODES
    support = Support.APPROXIMATE if approximate else Support.EXACT
    why = TRIPLES.get(modes, "") if len(modes) == 3 else ""  # type: ignore[call-overload]
    why = why or next((w for p, w in NOTES.items() if frozenset(p) == key), "")
    return Combination(key, support, why or "independent parts of the runner")


#: every pair of modes, and the listed triples, with what the table says of it
COMBINATIONS: dict[frozenset[Mode], Combination] = {
    c.modes: c
    for c in itertools.chain(
        (_verdict(p) for p in itertools.combinations(Mode, 2)), (_verdict(t) for t in TRIPLES)
    )
}


def combination(*modes: Mode) -> Combination:
    """The table's entry for two modes (or a listed triple); `KeyError` for anything else."""
    return COMBINATIONS[frozenset(modes)]


@dataclass(frozen=True)
class Modes:
    """A runner's configuration as the modes it turns on (defaults resolved the way the runner
    resolves them), with the numbers a combination's limits need."""

    active: frozenset[Mode]
    spec_tokens: int = 0
    window: int = 0
    features: frozenset[Feature] = frozenset()

    def __contains__(self, mode: object) -> bool:
        return mode in self.active

    def with_mode(self, mode: Mode) -> Modes:
        return Modes(self.active | {mode}, self.spec_tokens, self.window, self.features)

    @classmethod
    def of(
        cls,
        device: torch.device,
        model: ModelConfig,
        *,
        bounded_replay: bool = False,
        graph_decode: bool | None = None,
        overlap: bool | None = None,
        hisparse_pages: int | None = None,
        tail_only: bool = False,
        speculative_tokens: int | None = None,
        draft: DraftSource | None = None,
        memory_budget: int | None = None,
        index_format: CacheFormat = CacheFormat.BF16,
        swa_format: CacheFormat = CacheFormat.BF16,
        schedule: SchedulePolicy = SchedulePolicy.LPM,
        rebalance: bool = False,
        multi_stream: bool = False,
    ) -> Modes:
        """The modes of `Runner(...)` with these arguments on ``device`` (``rebalance``:
        `budget_runner`'s run-time re-balance)."""
        cuda = device.type == "cuda"
        graph = graph_decode if graph_decode is not None else cuda and hisparse_pages is None
        spec = speculative_tokens is not None
        if overlap is None:
            overlap = bool(graph) and cuda and not spec
        mtp = spec and (draft.uses_mtp if draft is not None else model.mtp)
        on = {
            M.GRAPH_DECODE: graph,
            M.OVERLAP: overlap,
            M.SPECULATION: spec,
            M.MTP_DRAFT: mtp,
            M.BOUNDED_REPLAY: bounded_replay,
            M.TAIL_ONLY: tail_only,
            M.HISPARSE: hisparse_pages is not None,
            M.INDEX_FP8: index_format is CacheFormat.FP8,
            M.INDEX_FP4: index_format is CacheFormat.FP4,
            M.SWA_FP8: swa_format is CacheFormat.FP8,
            M.REBALANCE: rebalance,
            M.MEMORY_BUDGET: memory_budget is not None or cuda,
            M.FCFS: schedule is SchedulePolicy.FCFS,
            M.SHARING: model.shares_kv,
            M.MULTI_STREAM: multi_stream,
        }
        k = speculative_tokens if isinstance(speculative_tokens, int) else 0
        active = frozenset(m for m, v in on.items() if v)
        return cls(active, k, model.window, Feature.of(model))


#: the `Runner` arguments `Modes.of` reads (`budget_runner` passes them on)
MODE_ARGUMENTS = frozenset(
    {"graph_decode", "overlap", "hisparse_pages", "tail_only", "speculative_tokens", "draft",
     "memory_budget", "index_format", "swa_format", "schedule", "multi_stream"}
)  # fmt: skip


def refusals(modes: Modes) -> Iterator[UnsupportedModeError]:
    """Every reason ``modes`` cannot run, in the table's order (pairs, then a model feature's
    pairs, then requirements, then the limits of combinations that work)."""
    for (a, b), why in REFUSED.items():
        if a in modes and b in modes:
            yield UnsupportedModeError((a, b), why)
    for (feature, mode), why in FEATURE_REFUSED.items():
        if feature in modes.features and mode in modes:
            yield UnsupportedModeError((feature, mode), why)
    for mode, (needed, why) in REQUIRES.items():
        if mode in modes and needed not in modes:
            yield UnsupportedModeError((mode, needed), why, needs=True)
    if M.TAIL_ONLY in modes and M.SPECULATION in modes and modes.spec_tokens + 1 > modes.window:
        yield UnsupportedModeError(
            (M.TAIL_ONLY, M.SPECULATION),
            f"a verify step of {modes.spec_tokens + 1} tokens is longer than the window "
            f"({modes.window}): it would run tail-only; lower speculative_tokens",
        )


def check_modes(modes: Modes) -> Modes:
    """``modes`` unchanged, or the first `UnsupportedModeError` of `refusals`."""
    for error in refusals(modes):
        raise error
    return modes
