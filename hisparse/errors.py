"""Typed errors of the HiSparse coordinator. Every call that raises leaves the coordinator exactly
as it was before the call."""

from __future__ import annotations

from collections.abc import Sequence


class HiSparseError(Exception):
    """Base class of every error the coordinator raises on purpose."""


class ConfigError(HiSparseError, ValueError):
    """A `HiSparseConfig` field is invalid."""


class InvalidInputError(HiSparseError, ValueError):
    """Bad arguments: a layer or host page out of range, a non-integer page array, a `fresh`
    mask that does not match `writes`, ..."""


class MissingPageDataError(InvalidInputError):
    """A page is read or written that holds no data anywhere (never written, or released) and
    is not written as fresh this step, or a page is marked fresh that still holds data."""

    def __init__(self, layer: int, pages: Sequence[int], reason: str) -> None:
        shown = ", ".join(str(p) for p in list(pages)[:8]) + (" ..." if len(pages) > 8 else "")
        super().__init__(f"layer {layer}: host page(s) {shown}: {reason}")
        self.layer = layer
        self.pages = tuple(int(p) for p in pages)


class DeviceBufferFull(HiSparseError):
    """The step needs more device slots than the layer has: its distinct pages plus the pages
    pinned by in-flight copies exceed ``device_slots``. Complete pending tickets, or split the
    batch, and plan again."""

    def __init__(self, layer: int, needed_slots: int, device_slots: int) -> None:
        super().__init__(
            f"layer {layer}: the step needs {needed_slots} device slots "
            f"(its pages plus pages pinned by in-flight copies), the buffer has {device_slots}"
        )
        self.layer = layer
        self.needed_slots = needed_slots
        self.device_slots = device_slots


class TicketError(HiSparseError):
    """`complete` got a ticket that was never issued or was already completed."""


class PinnedPageError(HiSparseError):
    """`release` got pages that an in-flight copy still uses; complete its tickets first."""

    def __init__(self, pages: Sequence[int], tickets: Sequence[int]) -> None:
        super().__init__(
            f"cannot release host page(s) {list(pages)[:8]}: pinned by pending ticket(s) "
            f"{sorted(set(tickets))[:8]}; complete them first"
        )
        self.pages = tuple(int(p) for p in pages)
        self.tickets = tuple(sorted({int(t) for t in tickets}))


class InvariantError(HiSparseError, AssertionError):
    """`check_invariants` found a state the coordinator must never reach (a bug)."""


def require(condition: object, message: str) -> None:
    """Raise `InvariantError` unless ``condition`` holds (works under ``python -O`` too)."""
    if not condition:
        raise InvariantError(message)
