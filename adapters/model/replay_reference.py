"""Dense oracle of encoder-side bounded replay: the replay's semantics written out explicitly.

No pages, slots or rings. A sequence is computed in **segments**; each is one dense forward
over positions ``[start, end)`` that reads the per-layer state earlier segments left (latents
and in-flight rows by position, compressed entries and indexer keys by group) and overwrites
the state of its own positions:

* an **extension** continues at the current end: windows see every earlier latent, and the
  groups completing inside it are compressed from the rows then current;
* a **replay** recomputes ``[start, end)`` of what is already computed: windows are truncated
  at ``start`` (earlier latents are not live), the entries of groups completing inside it are
  the stored ones (compressed KV stays as cached); it overwrites latents and in-flight rows.

A request served by a replayed hit over an exactly cached prefix is therefore::

    extend(prompt[:prefix_len])           the request that cached the prefix (cold, exact)
    replay(prefix_len - window)           the window rebuild
    extend(prompt[prefix_len:]) ...       rows of the group(s) still open at prefix_len are the
                                          replay's, entries of older groups the cold ones

One extension over ``[0, T)`` is `reference.DenseKeys` exactly; chunking an extension changes
nothing (the dense maths is position-local). `fork` truncates a copy, for requests reusing a
prefix that an earlier (replayed) request computed.

V4.1 sharing as `reference.DenseKeys` spells it: a KV-source layer keeps the compressed
entries (C4: and the indexer keys) that its consumers read; an index-source layer's selection
of the segment's queries is what the other C4 layers of that segment attend to.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from adapters.model import ops
from adapters.model.candidates import refuse_candidates
from adapters.model.model import LayerInput, compress_rows, forward
from adapters.model.reference import _group_rows
from adapters.model.weights import Compressor, ModelWeights


@dataclass
class _LayerState:
    """One layer's state by position (latents, in-flight rows) and by group (entries), for the
    compressed stream (``"kv"``) and the indexer (``"index"``)."""

    kv: torch.Tensor
    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    entries: dict[str, torch.Tensor] = field(default_factory=dict)


class SegmentedReference:
    """A sequence computed segment by segment (see the module docstring)."""

    def __init__(self, weights: ModelWeights) -> None:
        cfg, dev = weights.config, weights.device
        refuse_candidates(cfg, "the bounded-replay oracle")
        self.weights = weights
        self.tokens: list[int] = []
        self._layers = [
            _LayerState(torch.zeros(0, cfg.head_dim, device=dev, dtype=weights.dtype))
            for _ in cfg.compress_ratios
        ]

    @property
    def length(self) -> int:
        return len(self.tokens)

    @torch.no_grad()
    def extend(self, tokens: list[int]) -> torch.Tensor:
        """Computes ``tokens`` at the current end; returns their logits ``(n, V)``."""
        start = self.length
        self.tokens += list(tokens)
        return self._segment(start, self.length, window_from=0, replay=False)

    @torch.no_grad()
    def replay(self, start: int, end: int | None = None) -> torch.Tensor:
        """Recomputes ``[start, end)`` (default: to the current end) with windows truncated at
        ``start`` and entries as stored; returns the recomputed logits."""
        end = self.length if end is None else end
        if not 0 <= start < end <= self.length:
            raise ValueError(f"replay [{start}, {end}) outside the computed [0, {self.length})")
        return self._segment(start, end, window_from=start, replay=True)

    def fork(self, length: int) -> SegmentedReference:
        """A copy truncated to ``length`` tokens: the state a request resuming there reads."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot fork at {length}: computed {self.length}")
        other = copy.copy(self)
        other.tokens = self.tokens[:length]
        ratios = self.weights.config.compress_ratios
        other._layers = [_truncate(st, length, r) for st, r in zip(self._layers, ratios)]
        return other

    @torch.no_grad()
    def generate(self, last_logits: torch.Tensor, n: int) -> list[int]:
        """Greedy continuation: ``n`` tokens, the first from ``last_logits``."""
        out: list[int] = []
        logits = last_logits
        while len(out) < n:
            out.append(int(logits.argmax()))
            if len(out) < n:
                logits = self.extend(out[-1:])[-1]
        return out

    def _segment(self, start: int, end: int, window_from: int, replay: bool) -> torch.Tensor:
        dev = self.weights.device
        ids = torch.tensor(self.tokens[start:end], dtype=torch.long, device=dev)
        positions = torch.arange(start, end, device=dev)
        keys = _SegmentKeys(self, start, window_from, replay)
        return forward(self.weights, ids, positions, keys)


def _truncate(st: _LayerState, length: int, ratio: int) -> _LayerState:
    """The state of the first ``length`` positions (entries of the groups complete by then)."""
    per_group = {"kv": ratio, "index": 4}
    return _LayerState(
        st.kv[:length],
        {k: v[:length] for k, v in st.rows.items()},
        {k: v[: length // per_group[k]] for k, v in st.entries.items()},
    )


class _SegmentKeys:
    """`KeySource` of one segment over a `SegmentedReference`'s stored state."""

    def __init__(self, ref: SegmentedReference, start: int, window_from: int, replay: bool) -> None:
        self.ref, self.start, self.window_from, self.replay = ref, start, window_from, replay
        self.cfg = ref.weights.config
        self.selection: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per index source

    def attend(self, layer: LayerInput) -> torch.Tensor:
        cfg, t = self.cfg, layer.positions
        st = self.ref._layers[layer.index]
        st.kv = _splice(st.kv, self.start, layer.kv)
        offs = torch.arange(cfg.window, device=t.device)
        win_pos = t[:, None] - (cfg.window - 1) + offs[None, :]
        mask = win_pos >= max(0, self.window_from)
        keys = st.kv[win_pos.clamp(min=0)]
        ratio = layer.weights.ratio
        if ratio:
            entries = self._source_entries(layer, st, ratio)
            g = torch.arange(entries.shape[0], device=t.device)
            visible = (g[None, :] + 1) * ratio - 1 <= t[:, None]
            if cfg.is_sparse(ratio):
                chosen, chosen_mask = self._select(layer, visible)
                keys = torch.cat((keys, entries[chosen]), dim=1)
                mask = torch.cat((mask, chosen_mask), dim=1)
            else:
                keys = torch.cat((keys, entries[None].expand(t.shape[0], -1, -1)), dim=1)
                mask = torch.cat((mask, visible), dim=1)
        return ops.sink_attention(layer.q, keys, mask, layer.weights.sink, cfg.scale)

    def _source_entries(self, layer: LayerInput, st: _LayerState, ratio: int) -> torch.Tensor:
        """The entries ``layer`` reads: its own if it is a KV source (with the C4 indexer keys),
        else those its source left in this forward (sources come first)."""
        i, done = layer.index, (self.start + layer.x.shape[0]) // ratio
        source = self.cfg.kv_source_of(i)
        if source != i:
            return self.ref._layers[source].entries["kv"][:done]
        comp, idx = layer.weights.compressor, layer.weights.indexer
        assert comp is not None
        entries = self._entries(layer, st, "kv", comp, ratio)
        if self.cfg.is_sparse(ratio):
            assert idx is not None and idx.compressor is not None
            self._entries(layer, st, "index", idx.compressor, ratio)
        return entries

    def _entries(
        self, layer: LayerInput, st: _LayerState, name: str, comp: Compressor, ratio: int
    ) -> torch.Tensor:
        """Entries of every group complete by the segment's end; stores this segment's rows
        and (unless it is a replay) the entries of the groups completing inside it."""
        start, end = self.start, self.start + layer.x.shape[0]
        rows = ops.compressor_rows(layer.x, comp, layer.positions)
        old_rows = st.rows.get(name, rows[:0])
        st.rows[name] = _splice(old_rows, start, rows)
        stored = st.entries.get(name, layer.kv.new_zeros((0, comp.norm.shape[0])))
        done = end // ratio
        if self.replay:  # compressed KV stays as cached
            assert stored.shape[0] >= done, "a replay reads entries a cold segment wrote"
            return stored[:done]
        first = start // ratio  # groups completing inside the segment: [first, done)
        grouped = _group_rows(st.rows[name][: done * ratio], ratio, self.cfg.is_overlap(ratio))
        groups = torch.arange(first, done, device=rows.device)
        new = compress_rows(self.cfg, grouped[first:], ratio, groups, comp.norm, self.cfg.rope_dim)
        st.entries[name] = torch.cat((stored[:first], new.to(layer.x.dtype)))
        return st.entries[name]

    def _select(self, layer: LayerInput, visible: torch.Tensor):
        """The indexer's top-k visible entries per query over the stored indexer keys of the
        layer's KV source, or the nearest index source's selection of this segment."""
        cfg, i, idx = self.cfg, layer.index, layer.weights.indexer
        if not cfg.runs_indexer(i):
            return self.selection[cfg.index_source_of(i)]
        assert idx is not None
        n = layer.x.shape[0]
        done = (self.start + n) // layer.weights.ratio
        keys = self.ref._layers[cfg.kv_source_of(i)].entries["index"][:done]
        q = (layer.x @ idx.w_q).view(n, cfg.index_heads, cfg.index_dim)
        q = ops.rope(q, layer.positions, cfg.rope_dim, cfg.rope_theta)
        scores = ops.index_scores(q, layer.x @ idx.w_weight, keys[None].expand(n, -1, -1))
        scores = scores.masked_fill(~visible, float("-inf"))
        values, indices = ops.topk_lowest_index(scores, min(cfg.index_topk, scores.shape[1]))
        self.selection[i] = (indices, torch.isfinite(values))
        return self.selection[i]


def _splice(old: torch.Tensor, start: int, new: torch.Tensor) -> torch.Tensor:
    """``old`` with rows ``[start, start + len(new))`` replaced by (or extended with) ``new``."""
    return torch.cat((old[:start], new, old[start + new.shape[0] :]))


def replay_reference_logits(
    weights: ModelWeights, tokens: list[int], prefix_len: int, replay_start: int
) -> torch.Tensor:
    """Logits at positions ``[prefix_len, len(tokens))`` of a request whose cached prefix
    ``[0, prefix_len)`` was computed exactly and whose window ``[replay_start, prefix_len)``
    was rebuilt by a replay."""
    ref = SegmentedReference(weights)
    ref.extend(tokens[:prefix_len])
    ref.replay(replay_start)
    return ref.extend(tokens[prefix_len:])


def replay_reference_generate(
    weights: ModelWeights, prompt: list[int], prefix_len: int, replay_start: int, n: int
) -> list[int]:
    """Greedy continuation of ``prompt`` served by that replayed hit."""
    ref = SegmentedReference(weights)
    ref.extend(prompt[:prefix_len])
    ref.replay(replay_start)
    return ref.generate(ref.extend(prompt[prefix_len:])[-1], n)
