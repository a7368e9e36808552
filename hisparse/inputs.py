"""Validation of the arrays callers pass in: host pages, the step's reads / writes / fresh mask.

Nothing here mutates the coordinator; every failure raises `InvalidInputError`. `plan_step`
runs these on every layer-step, so the common case — a C-contiguous int64 array — costs one
reduction (the range check) and no copy.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .errors import InvalidInputError
from .ids import HostPageArray

_INT64 = np.dtype(np.int64)
#: the ufunc reduction without `ndarray.max`'s Python wrapper (per-step calls add up)
_max = np.maximum.reduce
_BOOL = np.dtype(np.bool_)


#: the shared read-only empty int64 array (nothing can be written to it)
EMPTY: HostPageArray = np.zeros(0, np.int64)
EMPTY.setflags(write=False)


def as_layer(layer: object, num_layers: int) -> int:
    """``layer`` as an int in ``[0, num_layers)``."""
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise InvalidInputError(f"layer must be an int, got {layer!r}")
    index = int(layer)
    if not 0 <= index < num_layers:
        raise InvalidInputError(f"layer {layer!r} out of range [0, {num_layers})")
    return index


def as_host_pages(pages: npt.ArrayLike, max_host_pages: int, name: str) -> HostPageArray:
    """``pages`` as an int64 array (same shape) of ids in ``[0, max_host_pages)``; no copy when
    it already is one."""
    array = np.asarray(pages)
    if array.dtype != _INT64:
        if array.size and array.dtype.kind not in "iu":
            raise InvalidInputError(f"{name} must be an integer array, got dtype {array.dtype}")
        array = array.astype(np.int64)
    _check_range(array, max_host_pages, name)
    return array


def flat_host_pages(
    pages: npt.ArrayLike, max_host_pages: int, name: str
) -> tuple[HostPageArray, tuple[int, ...]]:
    """`as_host_pages` flattened: the ids as a 1-D int64 array (a view when possible) and the
    shape of ``pages``."""
    array = as_host_pages(pages, max_host_pages, name)
    return array.ravel(), array.shape


def _check_range(pages: HostPageArray, max_host_pages: int, name: str) -> None:
    # one pass over int64 ids of any shape: negative ids turn into huge unsigned ones
    if pages.size and int(_max(pages.view(np.uint64), axis=None)) >= max_host_pages:
        bad = pages[(pages < 0) | (pages >= max_host_pages)]
        raise InvalidInputError(
            f"{name}: host page(s) {bad[:8].tolist()} out of range [0, {max_host_pages})"
        )


def distinct(pages: HostPageArray) -> HostPageArray:
    """Sorted distinct ``pages`` (1-D), a new array. Sort-based: `np.unique` hashes, several
    times slower on the short arrays a step produces."""
    ordered = pages.copy()  # ndarray.sort: no dispatch overhead, unlike np.sort
    ordered.sort()
    if len(ordered) < 2:
        return ordered
    repeated = ordered[1:] == ordered[:-1]
    if not np.count_nonzero(repeated):
        return ordered
    return ordered[np.concatenate(([True], ~repeated))]


def fresh_pages(
    fresh: npt.ArrayLike, writes: HostPageArray, shape: tuple[int, ...]
) -> HostPageArray:
    """Sorted distinct pages of the flat ``writes`` (of shape ``shape``) that the bool mask
    ``fresh`` flags (any occurrence counts); `EMPTY` when none is."""
    mask = np.asarray(fresh)
    if mask.shape != shape:
        raise InvalidInputError(f"fresh has shape {mask.shape}, writes {shape}")
    if mask.dtype != _BOOL:
        if mask.size:
            raise InvalidInputError(f"fresh must be a bool array, got dtype {mask.dtype}")
        return EMPTY
    if not np.count_nonzero(mask):
        return EMPTY
    return distinct(writes[mask.ravel()])


class StepInput:
    """One layer-step's pages, validated: ``reads`` (int64, shaped as given, so that the
    page-table gather has the shape of the result; 1-D if given as a scalar: ``read_shape``)
    and ``writes`` (int64, flattened); the caller's own arrays, or views of them, when they were
    int64 — never written.

    ``write_pages``: the sorted distinct pages of ``writes`` (a new array).
    ``fresh_pages``: sorted distinct pages of ``writes`` flagged fresh (any occurrence counts).
    """

    __slots__ = ("fresh_pages", "read_shape", "reads", "write_pages", "write_shape", "writes")

    def __init__(
        self,
        reads: HostPageArray,
        read_shape: tuple[int, ...],
        writes: HostPageArray,
        write_shape: tuple[int, ...],
        write_pages: HostPageArray,
        fresh_pages: HostPageArray,
    ) -> None:
        self.reads = reads
        self.read_shape = read_shape
        self.writes = writes
        self.write_shape = write_shape
        self.write_pages = write_pages
        self.fresh_pages = fresh_pages

    @classmethod
    def parse(
        cls,
        reads: npt.ArrayLike,
        writes: npt.ArrayLike,
        fresh: npt.ArrayLike | None,
        max_host_pages: int,
    ) -> StepInput:
        # hot path: int64 arrays (views, one reduction for the reads' range check); the ends of
        # the sorted write pages give theirs
        if type(reads) is np.ndarray and reads.dtype is _INT64:
            r = reads
            _check_range(r, max_host_pages, "reads")
        else:
            r = as_host_pages(reads, max_host_pages, "reads")
        if type(writes) is np.ndarray and writes.dtype is _INT64:
            w, w_shape = writes.ravel(), writes.shape
        else:
            w, w_shape = flat_host_pages(writes, max_host_pages, "writes")
        pages = EMPTY
        if len(w):
            pages = distinct(w)
            if pages.item(0) < 0 or pages.item(-1) >= max_host_pages:
                _check_range(w, max_host_pages, "writes")
        if fresh is None:
            fresh_set = EMPTY
        elif (
            type(fresh) is np.ndarray
            and fresh.dtype is _BOOL
            and fresh.shape == w_shape
            and not np.count_nonzero(fresh)
        ):
            fresh_set = EMPTY  # the common case: a valid mask flagging nothing
        else:
            fresh_set = fresh_pages(fresh, w, w_shape)
        r_shape = r.shape
        if not r_shape:  # a scalar: the gather of a 0-d index would be a numpy scalar
            r = r.reshape(1)
        return cls(r, r_shape, w, w_shape, pages, fresh_set)
