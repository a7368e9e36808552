from __future__ import annotations

import os

# The fp64 tests compare the paged forward with the dense reference bit for bit. Their matmuls
# have other row counts (a chunk against the whole prompt), and MKL picks shape-dependent code
# paths on some CPUs (AMD EPYC: one row of a 128-row chunk off by 3.6e-12 against the same row
# of 257). Conditional numerical reproducibility pins one code path; it must be set before MKL
# initialises, so here, before any test module imports torch. No measurable cost on this suite.
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=80,
    stateful_step_count=40,
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
