from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=50,
    stateful_step_count=30,
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# "thorough" also runs the interpreted kernel checks' variants (`interpreted.thorough`: e.g.
# the top-k sort stage behind every algorithm and case): `pytest --hypothesis-profile=thorough
# tests/test_kernels.py`, or SHADOWRADIX_THOROUGH=1 under any profile.
settings.register_profile(
    "thorough",
    max_examples=int(os.environ.get("SHADOWRADIX_THOROUGH_EXAMPLES", "4500")),
    stateful_step_count=100,
    deadline=None,
    print_blob=True,
    suppress_health_check=list(HealthCheck),
)
settings.register_profile("dev", max_examples=20, stateful_step_count=30, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # type: ignore[no-untyped-def]
    from shadowradix.testing import CacheMachine

    if CacheMachine.steps_run:
        terminalreporter.write_line(f"stateful machines ran {CacheMachine.steps_run} steps")
