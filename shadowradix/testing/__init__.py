"""Test harness for embedders: strategies, the fingerprint oracle and the stateful machine.

Needs the ``dev`` extra (hypothesis)."""

from __future__ import annotations

from .machines import CacheMachine
from .oracle import FingerprintOracle, OracleViolation, prefix_hashes
from .snapshot import canonical_snapshot, snapshot
from .strategies import cache_configs

__all__ = [
    "CacheMachine",
    "FingerprintOracle",
    "OracleViolation",
    "cache_configs",
    "canonical_snapshot",
    "prefix_hashes",
    "snapshot",
]
