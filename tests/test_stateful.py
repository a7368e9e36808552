"""Runs the exported model-based machines (see shadowradix/testing/machines.py)."""

from __future__ import annotations

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule, run_state_machine_as_test

from shadowradix import Request
from shadowradix.testing import CacheMachine, cache_configs
from shadowradix.testing.machines import ALPHABET

#: the machine's longest draft; `CacheMachine.draft_and_verify` cuts it to ``max_draft_len``
LONGEST_DRAFT = 12


#: (draft length, accepted tokens): a third at the corners (one token or the longest, none or
#: all accepted), a third exactly the longest draft all rejected, a third uniform (this order
#: of the branches keeps the ci run as long as with uniform draws)
DRAFT_SHAPES = st.one_of(
    st.tuples(st.sampled_from([1, LONGEST_DRAFT]), st.sampled_from([0, LONGEST_DRAFT])),
    st.just((LONGEST_DRAFT, 0)),
    st.tuples(st.integers(1, LONGEST_DRAFT), st.integers(0, LONGEST_DRAFT)),
)


class BoundaryDraftMachine(CacheMachine):
    """`CacheMachine` drawing drafts at the boundaries (`DRAFT_SHAPES`): uniform draws almost
    never drafted exactly ``max_draft_len`` tokens and rejected them all."""

    boundary_drafts = 0  # drafted max_draft_len tokens and rejected them all

    @precondition(lambda self: self.config.speculative and self.live)
    @rule(
        request=CacheMachine.requests,
        shape=DRAFT_SHAPES,
        tokens=st.lists(
            st.integers(0, ALPHABET - 1), min_size=LONGEST_DRAFT, max_size=LONGEST_DRAFT
        ),
    )
    def draft_and_verify(  # type: ignore[override]
        self, request: Request, shape: tuple[int, int], tokens: list[int]
    ) -> None:
        length, accept = shape
        limit = self.config.max_draft_len
        if accept == 0 and limit is not None and length >= limit:
            event("draft: max_draft_len drafted, all rejected")
            BoundaryDraftMachine.boundary_drafts += 1
        CacheMachine.draft_and_verify(self, request=request, draft=tokens[:length], accept=accept)


class SpeculativeMachine(BoundaryDraftMachine):
    config_strategy = cache_configs(speculative=True)


class ReplayMachine(CacheMachine):
    config_strategy = cache_configs(speculative=False, replay=True)


TestCache = BoundaryDraftMachine.TestCase
TestSpeculative = SpeculativeMachine.TestCase
TestReplay = ReplayMachine.TestCase


def test_machine_really_steps() -> None:
    """Guards the guard: a machine whose rules never fire would pass vacuously."""
    before = CacheMachine.steps_run
    run_state_machine_as_test(
        CacheMachine,
        settings=settings(
            max_examples=5,
            stateful_step_count=20,
            derandomize=True,
            database=None,  # derandomized guards replay no saved examples of other runs
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    assert CacheMachine.steps_run - before >= 5 * 5


class BoundedDraftMachine(BoundaryDraftMachine):
    config_strategy = cache_configs(speculative=True).filter(lambda c: c.max_draft_len)


def test_drafts_reach_the_boundaries() -> None:
    """Guards the bias: a short run over configs that bound the draft drafts exactly
    ``max_draft_len`` tokens and rejects them all several times."""
    before = BoundaryDraftMachine.boundary_drafts
    run_state_machine_as_test(
        BoundedDraftMachine,
        settings=settings(
            max_examples=15,
            stateful_step_count=50,
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    assert BoundaryDraftMachine.boundary_drafts - before >= 3
