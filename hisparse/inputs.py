"""Validation of the arrays callers pass in: host pages, the step's reads / writes / fresh mask.

Nothing here mutates the coordinator; every failure raises `InvalidInputError`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .errors import InvalidInputError
from .ids import HostPageArray

_EMPTY = np.zeros(0, np.int64)


def as_layer(layer: object, num_layers: int) -> int:
    """``layer`` as an int in ``[0, num_layers)``."""
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise InvalidInputError(f"layer must be an int, got {layer!r}")
    index = int(layer)
    if not 0 <= index < num_layers:
        raise InvalidInputError(f"layer {layer!r} out of range [0, {num_layers})")
    return index


def as_host_pages(pages: npt.ArrayLike, max_host_pages: int, name: str) -> HostPageArray:
    """``pages`` as an int64 array (same shape) of ids in ``[0, max_host_pages)``."""
    array = np.asarray(pages)
    if array.dtype != np.int64:
        if array.size and array.dtype.kind not in "iu":
            raise InvalidInputError(f"{name} must be an integer array, got dtype {array.dtype}")
        array = array.astype(np.int64)
    flat = array.reshape(-1)
    # one pass: negative ids turn into huge unsigned ones
    if len(flat) and int(flat.view(np.uint64).max()) >= max_host_pages:
        bad = flat[(flat < 0) | (flat >= max_host_pages)]
        raise InvalidInputError(
            f"{name}: host page(s) {bad[:8].tolist()} out of range [0, {max_host_pages})"
        )
    return array


def distinct(pages: HostPageArray) -> HostPageArray:
    """Sorted distinct ``pages`` (1-D). Sort-based: `np.unique` hashes, several times slower on
    the short arrays a step produces."""
    ordered = np.sort(pages)
    if len(ordered) < 2:
        return ordered
    return ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))]


@dataclass(frozen=True)
class StepInput:
    """One layer-step's pages, validated and flattened.

    ``fresh_pages``: sorted distinct pages of ``writes`` flagged fresh (any occurrence counts).
    """

    reads: HostPageArray
    read_shape: tuple[int, ...]
    writes: HostPageArray
    write_shape: tuple[int, ...]
    fresh_pages: HostPageArray

    @classmethod
    def parse(
        cls,
        reads: npt.ArrayLike,
        writes: npt.ArrayLike,
        fresh: npt.ArrayLike | None,
        max_host_pages: int,
    ) -> StepInput:
        r = as_host_pages(reads, max_host_pages, "reads")
        w = as_host_pages(writes, max_host_pages, "writes")
        flat_w = w.reshape(-1)
        return cls(r.reshape(-1), r.shape, flat_w, w.shape, _fresh_pages(fresh, flat_w, w.shape))


def _fresh_pages(
    fresh: npt.ArrayLike | None, writes: HostPageArray, shape: tuple[int, ...]
) -> HostPageArray:
    if fresh is None:
        return _EMPTY
    mask = np.asarray(fresh)
    if mask.shape != shape:
        raise InvalidInputError(f"fresh has shape {mask.shape}, writes {shape}")
    if mask.size and mask.dtype != np.bool_:
        raise InvalidInputError(f"fresh must be a bool array, got dtype {mask.dtype}")
    flat = mask.reshape(-1)
    return distinct(writes[flat]) if flat.any() else _EMPTY
