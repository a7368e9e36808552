"""Indexer top-k capture and forced replay for RL (docs/runner.md, "Top-k capture and forced
replay"; the seeds' Miles "indexer replay").

A capture holds, per indexer layer and per computed position, the entries the layer's top-k
selected: entry indices within the request (entry ``e`` of a ratio-``r`` layer pools tokens
``[e * r, (e + 1) * r)``), never pool slots, int32 on the host, in selection order (value
descending), so a trainer can re-inject exactly what the rollout attended to. Layers that reuse
a selection (V4.1 sharing) read their index source's array (``index_source_of``).

A forced replay injects a capture: every indexer layer takes the captured entries instead of
its own top-k, so a re-run (other weights, other tokens) attends to the same entries, bit for
bit. `TopkCapture.check` refuses (`TopkCaptureError`) a capture that does not fit the model:
another layer set, another width, counts or entries beyond what a position sees.

The export (`TopkCapture.to_arrays`, ``np.savez``-able; `TopkCapture.from_arrays` reads it
back, checked)::

    tokens          (L,)   int64   the request's tokens (prompt + output)
    first_position  ()     int64   the first captured position (> 0 after a prefix-cache hit)
    topk            ()     int64   K, the model's index_topk
    layers          (M,)   int64   the indexer layers, ascending
    ratios          (M,)   int64   their compress ratio
    index_source    (C, 2) int64   (sparse layer, the layer whose selection it attends to)
    entries_<i>     (T, K) int32   layer i: row t is position first_position + t; the first
    counts_<i>      (T,)   int32   counts[t] columns are its entries, the rest are 0 (unused)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from adapters.model.model_config import ModelConfig
from shadowradix import InvalidRequestError


class TopkCaptureError(InvalidRequestError):
    """A capture that cannot drive (or describe) this request: wrong layers, shapes, or entries
    beyond what a position sees."""


def indexer_layers(model: ModelConfig) -> tuple[int, ...]:
    """The layers whose top-k a capture holds: every layer that runs an indexer."""
    return tuple(i for i in range(model.num_layers) if model.runs_indexer(i))


@dataclass(frozen=True, eq=False)
class TopkCapture:
    """One request's captured selections (see the module docstring for the fields)."""

    tokens: np.ndarray
    first_position: int
    topk: int
    layers: tuple[int, ...]
    ratios: tuple[int, ...]
    index_source: tuple[tuple[int, int], ...]
    entries: dict[int, np.ndarray]
    counts: dict[int, np.ndarray]
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        self._check_shapes()
        h = hashlib.sha256(np.asarray(self.layers, np.int64).tobytes())
        h.update(np.int64(self.first_position).tobytes())
        for i in self.layers:
            h.update(self.entries[i].tobytes())
            h.update(self.counts[i].tobytes())
        object.__setattr__(self, "digest", h.hexdigest())

    @property
    def num_positions(self) -> int:
        return int(self.counts[self.layers[0]].shape[0]) if self.layers else 0

    def _check_shapes(self) -> None:
        if len(self.ratios) != len(self.layers) or set(self.entries) != set(self.layers):
            raise TopkCaptureError("a capture needs entries, counts and a ratio per layer")
        if set(self.counts) != set(self.layers) or self.first_position < 0:
            raise TopkCaptureError("a capture needs counts per layer and first_position >= 0")
        t = self.num_positions
        for i, ratio in zip(self.layers, self.ratios):
            e, c = self.entries[i], self.counts[i]
            if e.dtype != np.int32 or c.dtype != np.int32:
                raise TopkCaptureError(f"layer {i}: entries and counts must be int32")
            if e.shape != (t, self.topk) or c.shape != (t,):
                raise TopkCaptureError(
                    f"layer {i}: entries {e.shape} / counts {c.shape}, want ({t}, {self.topk})"
                )
            positions = self.first_position + np.arange(t)
            seen = (positions + 1) // ratio  # entries complete at each position
            if (c < 0).any() or (c > np.minimum(seen, self.topk)).any():
                raise TopkCaptureError(f"layer {i}: a count exceeds what its position sees")
            used = np.arange(self.topk)[None, :] < c[:, None]
            if ((e < 0) | (e >= seen[:, None]))[used].any():
                raise TopkCaptureError(f"layer {i}: an entry lies beyond what its position sees")

    def check(self, model: ModelConfig, prompt: list[int], max_new_tokens: int) -> None:
        """Whether this capture can force a run of ``prompt`` on ``model``: the model's
        indexer layers, ratios and width, a capture from position 0 that starts with
        ``prompt`` and covers every position the run computes. `TopkCaptureError` if not."""
        layers = indexer_layers(model)
        if self.layers != layers or self.topk != model.index_topk:
            raise TopkCaptureError(
                f"capture of layers {self.layers} (top-{self.topk}); this model's indexer "
                f"layers are {layers} (top-{model.index_topk})"
            )
        if self.ratios != tuple(model.compress_ratios[i] for i in layers):
            raise TopkCaptureError("the capture's layer ratios differ from the model's")
        if self.first_position != 0:
            raise TopkCaptureError(
                f"the capture starts at position {self.first_position} (a prefix-cache hit): "
                "a forced run needs every position from 0"
            )
        if list(self.tokens[: len(prompt)]) != list(prompt):
            raise TopkCaptureError("the prompt is not the captured sequence's start")
        need = len(prompt) + max_new_tokens - 1
        if self.num_positions < need:
            raise TopkCaptureError(
                f"the capture holds {self.num_positions} positions; the run computes {need}"
            )

    def forced(self, layer: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Entries ``(n, K)`` int64 and their validity at ``positions`` (captured ones)."""
        t = positions - self.first_position
        c = self.counts[layer][t]
        valid = np.arange(self.topk)[None, :] < c[:, None]
        return self.entries[layer][t].astype(np.int64), valid

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The export: a flat dict of arrays (``np.savez(path, **capture.to_arrays())``)."""
        out = dict(
            tokens=np.asarray(self.tokens, np.int64),
            first_position=np.int64(self.first_position),
            topk=np.int64(self.topk),
            layers=np.asarray(self.layers, np.int64),
            ratios=np.asarray(self.ratios, np.int64),
            index_source=np.asarray(self.index_source, np.int64).reshape(-1, 2),
        )
        for i in self.layers:
            out[f"entries_{i}"], out[f"counts_{i}"] = self.entries[i], self.counts[i]
        return out

    @classmethod
    def from_arrays(cls, arrays) -> TopkCapture:
        """A capture from `to_arrays`' dict (or an ``np.load`` of its ``.npz``), checked."""
        try:
            layers = tuple(int(i) for i in arrays["layers"])
            return cls(
                tokens=np.asarray(arrays["tokens"], np.int64),
                first_position=int(arrays["first_position"]),
                topk=int(arrays["topk"]),
                layers=layers,
                ratios=tuple(int(r) for r in arrays["ratios"]),
                index_source=tuple((int(a), int(b)) for a, b in arrays["index_source"]),
                entries={i: np.asarray(arrays[f"entries_{i}"]) for i in layers},
                counts={i: np.asarray(arrays[f"counts_{i}"]) for i in layers},
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise TopkCaptureError(f"not a top-k capture: {exc}") from None


class TopkRecorder:
    """Collects one request's selections forward by forward (host arrays), keyed by position:
    a position computed again (after a preemption) keeps its latest rows."""

    def __init__(self, model: ModelConfig) -> None:
        self.model, self.layers = model, indexer_layers(model)
        self._rows: dict[int, dict[int, tuple[np.ndarray, int]]] = {i: {} for i in self.layers}

    def add(self, layer: int, positions: np.ndarray, entries: np.ndarray, valid: np.ndarray):
        """Rows ``entries (n, k)`` with their validity (a valid prefix) at ``positions``."""
        k = self.model.index_topk
        for p, e, v in zip(positions.tolist(), entries, valid):
            row = np.zeros(k, np.int32)
            count = int(v.sum())
            row[:count] = e[:count]
            self._rows[layer][p] = (row, count)

    def capture(self, tokens: list[int]) -> TopkCapture | None:
        """The capture of every position recorded (contiguous), or None if none was."""
        first = self._rows[self.layers[0]] if self.layers else {}
        if not first:
            return None
        lo, hi = min(first), max(first) + 1
        entries, counts = {}, {}
        for i in self.layers:
            rows = [self._rows[i][p] for p in range(lo, hi)]  # KeyError: a gap (a bug)
            entries[i] = np.stack([r for r, _ in rows])
            counts[i] = np.array([c for _, c in rows], np.int32)
        m = self.model
        sparse = [i for i, r in enumerate(m.compress_ratios) if r and m.is_sparse(r)]
        return TopkCapture(
            tokens=np.asarray(tokens, np.int64), first_position=lo, topk=m.index_topk,
            layers=self.layers, ratios=tuple(m.compress_ratios[i] for i in self.layers),
            index_source=tuple((i, m.index_source_of(i)) for i in sparse),
            entries=entries, counts=counts,
        )  # fmt: skip
