"""Test harness for embedders: strategies, the fingerprint oracle and the stateful machine.

An optional extra: ``pip install shadowradix[testing]`` (Hypothesis). The core never imports
this package."""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("hypothesis") is None:  # pragma: no cover - the suite has it
    raise ImportError("shadowradix.testing needs Hypothesis: pip install 'shadowradix[testing]'")

from .machines import CacheMachine  # noqa: E402
from .oracle import FingerprintOracle, OracleViolation, prefix_hashes  # noqa: E402
from .snapshot import canonical_snapshot, snapshot  # noqa: E402
from .strategies import cache_configs  # noqa: E402

__all__ = [
    "CacheMachine",
    "FingerprintOracle",
    "OracleViolation",
    "cache_configs",
    "canonical_snapshot",
    "prefix_hashes",
    "snapshot",
]
