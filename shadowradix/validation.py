"""Input checks shared by the cache's entry points: token sequences, decode-step tokens and
counts (each bad input raises `InvalidRequestError` before anything changes)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .errors import InvalidRequestError

TokenInput = Sequence[int] | np.ndarray
#: the largest token id (ids are int64)
MAX_TOKEN = 2**63 - 1
#: ``arr.min()`` / ``arr.max()`` of a non-empty array, without the method's Python wrapper
_min, _max = np.minimum.reduce, np.maximum.reduce


def as_count(value: object) -> int | None:
    """``value`` as a plain non-negative int, or ``None`` if it is not a count (bools, floats,
    strings, negatives; NumPy integers are converted so that no unsigned arithmetic wraps)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        return None
    return int(value)


def single_tokens(tokens: Sequence[TokenInput] | np.ndarray) -> list[int] | None:
    """The tokens of a decode step (one valid token per request), else ``None``."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim == 2 and tokens.shape[1] == 1 and tokens.dtype.kind in "iu":
            if len(tokens) and (tokens.min() < 0 or tokens.max() > MAX_TOKEN):
                raise InvalidRequestError("token ids must be in [0, 2**63)")
            return tokens[:, 0].tolist()  # type: ignore[no-any-return]
        return None
    out = []
    for t in tokens:
        if type(t) not in (list, tuple) or len(t) != 1:
            return None
        x = t[0]
        if type(x) is not int:  # NumPy ints too (sampled ids often are): same fast path
            if not isinstance(x, np.integer):
                return None
            x = int(x)
        if not 0 <= x <= MAX_TOKEN:
            raise InvalidRequestError(f"token ids must be in [0, 2**63), got {x}")
        out.append(x)
    return out


def as_tokens(tokens: TokenInput, what: str) -> np.ndarray:
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"{what} must be a 1-D sequence of ints") from exc
    if arr.ndim != 1 or len(arr) == 0:
        raise InvalidRequestError(f"{what} must be a non-empty 1-D sequence of ints")
    if arr.dtype.kind not in "iu":
        raise InvalidRequestError(f"{what} must be integers, got dtype {arr.dtype}")
    if _min(arr) < 0 or (arr.dtype.kind == "u" and _max(arr) > MAX_TOKEN):
        raise InvalidRequestError(f"{what} must be token ids in [0, 2**63)")
    return arr.astype(np.int64, copy=False)
