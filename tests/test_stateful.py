"""Runs the exported model-based machines (see shadowradix/testing/machines.py)."""

from __future__ import annotations

from shadowradix.testing import CacheMachine, cache_configs


class SpeculativeMachine(CacheMachine):
    config_strategy = cache_configs(speculative=True)


class ReplayMachine(CacheMachine):
    config_strategy = cache_configs(speculative=False, replay=True)


TestCache = CacheMachine.TestCase
TestSpeculative = SpeculativeMachine.TestCase
TestReplay = ReplayMachine.TestCase
