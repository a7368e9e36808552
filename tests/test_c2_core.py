"""The C2 stream in the core (issue #17 item 2): V4.1's pairwise compression (ratio 2, no
overlap) shadowed like C4's and C128's, ring rows in the SWA pages (docs/design.md, "C2").

* the stream's arithmetic for every page size, with and without speculation;
* a property test: no two positions whose in-flight rows are needed at the same time (the
  open pair, plus the rows a draft writes) share a ring row, for every page size;
* the model-based machine (`shadowradix.testing.CacheMachine`, fingerprint oracle) over
  configurations that always carry a C2 stream, plain and speculative;
* a planted ring-arithmetic bug (one ring row a page for C2) that the machine catches.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from shadowradix import CacheConfig, slots
from shadowradix.config import StreamSpec
from shadowradix.testing import CacheMachine, cache_configs
from shadowradix.testing.oracle import OracleViolation
from shadowradix.testing.strategies import PAGE_SIZES

C2_RATIOS = (0, 2, 4, 128)


def c2_config(page: int, speculative: bool = False) -> CacheConfig:
    return CacheConfig(
        page_size=page, window=128, compress_ratios=C2_RATIOS, overlap_ratios=(4,),
        full_capacity=64 * page, swa_capacity=max(8, 256 // page + 3) * page,
        speculative=speculative,
    )  # fmt: skip


@pytest.mark.parametrize("page", PAGE_SIZES)
@pytest.mark.parametrize("speculative", [False, True])
def test_c2_stream_arithmetic(page: int, speculative: bool) -> None:
    """No overlap: an entry pools its own pair, one row precedes a position at most; the ring
    is the pair (doubled under speculation), a page keeps at most its own positions' rows;
    ``page / 2`` entries a page (one for a page of one token)."""
    cfg = c2_config(page, speculative)
    s = cfg.stream(2)
    assert (s.overlap, s.span) == (False, 1)
    assert s.ring_size == (4 if speculative else 2)
    assert s.ring_len == min(page, s.ring_size)
    assert s.slots_per_page == max(1, page // 2)
    assert cfg.compressed_capacity(2) == cfg.max_full_pages * max(1, page // 2)
    assert cfg.ring_capacity(2) == cfg.max_swa_pages * s.ring_len
    # a draft of max_draft_len tokens never reaches the open pair's row (None: a row a position)
    want = None if s.ring_len < s.ring_size else s.ring_len - 1
    assert s.max_draft_len == want
    if speculative:
        bounds = [b for b in (cfg.stream(r).max_draft_len for r in (2, 4, 128)) if b]
        assert cfg.max_draft_len == min(bounds, default=None)
        assert cfg.max_draft_len is None or cfg.max_draft_len <= 3  # C2 bounds every draft


@settings(deadline=None, max_examples=200)
@given(
    page=st.sampled_from(PAGE_SIZES),
    speculative=st.booleans(),
    length=st.integers(0, 600),
    draft=st.integers(0, 12),
    pages=st.randoms(use_true_random=False),
)
def test_c2_rows_needed_together_never_share_a_ring_row(
    page: int, speculative: bool, length: int, draft: int, pages
) -> None:
    """At any length, the open pair's row and the rows a draft of up to ``max_draft_len`` tokens
    then writes are distinct ring rows, whatever SWA pages hold them (any injective table)."""
    s = StreamSpec(2, False, page, speculative)
    limit = s.max_draft_len if speculative else 1
    draft = draft if limit is None else min(draft, limit)
    needed = list(range(slots.first_inflight(length, 2, False), length))
    assert len(needed) == length % 2  # the open pair's first row, once the pair is open
    written = list(range(length, length + draft))
    table = pages.sample(range(10_000), slots.num_pages(length + draft, page) + 1)
    rows = [slots.ring_row(table[slots.page_of(p, page)], p, s.ring_len) for p in needed + written]
    assert len(set(rows)) == len(rows), (needed, written, rows)


class C2Machine(CacheMachine):
    config_strategy = cache_configs(c2=True)


class C2SpeculativeMachine(CacheMachine):
    config_strategy = cache_configs(speculative=True, c2=True)


def _run(machine, examples: int, steps: int, shrink: bool = True) -> None:
    """Runs ``machine`` and asserts that it really stepped (a machine whose rules never fire
    would pass vacuously)."""
    before = CacheMachine.steps_run
    phases = tuple(Phase) if shrink else (Phase.explicit, Phase.generate)
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples, stateful_step_count=steps, derandomize=True, database=None,
            deadline=None, suppress_health_check=list(HealthCheck), phases=phases,
        ),
    )  # fmt: skip
    assert CacheMachine.steps_run - before >= examples * 5


def test_c2_configs_are_drawn() -> None:
    """Guards the guard: the machines below really run C2 streams (and the default strategy
    draws them too)."""

    @settings(max_examples=30, derandomize=True, database=None)
    @given(cache_configs(c2=True), cache_configs())
    def draw(forced: CacheConfig, default: CacheConfig) -> None:
        assert 2 in forced.ratios and not forced.stream(2).overlap
        seen.add(2 in default.ratios and not default.stream(2).overlap)

    seen: set[bool] = set()
    draw()
    assert seen == {True, False}


def test_c2_machine() -> None:
    """Admit / prefill chunks / decode / cache_unfinished / finish / abort / evict / rebalance
    with a C2 stream: every read and every carried pair row holds recomputation's value."""
    _run(C2Machine, 25, 40)


def test_c2_speculative_machine() -> None:
    """The same with drafts and rollbacks (the C2 ring doubled to 4 rows)."""
    _run(C2SpeculativeMachine, 25, 40)


def test_planted_c2_ring_bug_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant a ring-arithmetic bug: C2 keeps one ring row a page (a pair 'needs only one
    carried row'), so the ring is no longer doubled under speculation and a rejected draft's
    row lands on the open pair's. The speculative machine must fail."""
    real = StreamSpec.ring_len

    def one_row(self: StreamSpec) -> int:
        return 1 if self.ratio == 2 and not self.overlap else real.fget(self)  # type: ignore[attr-defined]

    monkeypatch.setattr(StreamSpec, "ring_len", property(one_row))
    with pytest.raises(OracleViolation, match="C2 (ring|carry) row"):
        _run(C2SpeculativeMachine, 300, 40, shrink=False)
