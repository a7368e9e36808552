"""Frozen HiSparse configuration, validated at construction; derived values are properties."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class HiSparseConfig:
    """Sizes of the C4 working-set coordinator.

    ``num_layers``: C4 layers managed, indexed ``0 .. num_layers - 1``.
    ``device_slots``: page-sized slots of each layer's device buffer.
    ``max_host_pages``: host pages (virtual pages of the cache) are ids in ``[0, max_host_pages)``.
    ``entries_per_page``: C4 entries one page holds (informational: the coordinator deals in
    whole pages). ``debug``: run `Coordinator.check_invariants` after every mutating call.
    """

    num_layers: int
    device_slots: int
    max_host_pages: int
    entries_per_page: int = 16
    debug: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "device_slots", "max_host_pages", "entries_per_page"):
            _positive_int(name, getattr(self, name))
        if not isinstance(self.debug, bool):
            raise ConfigError(f"debug must be a bool, got {self.debug!r}")

    @property
    def device_entries(self) -> int:
        """C4 entries one layer's device buffer holds."""
        return self.device_slots * self.entries_per_page

    @property
    def host_entries(self) -> int:
        """C4 entries one layer's host mirror holds."""
        return self.max_host_pages * self.entries_per_page
