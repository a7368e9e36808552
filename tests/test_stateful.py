"""Runs the exported model-based machines (see shadowradix/testing/machines.py)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from shadowradix.testing import CacheMachine, cache_configs


class SpeculativeMachine(CacheMachine):
    config_strategy = cache_configs(speculative=True)


class ReplayMachine(CacheMachine):
    config_strategy = cache_configs(speculative=False, replay=True)


TestCache = CacheMachine.TestCase
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
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    assert CacheMachine.steps_run - before >= 5 * 5
