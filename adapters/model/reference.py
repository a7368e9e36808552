"""Dense reference forward: recomputes everything from the token sequence, with no cache.

This is the oracle of the end-to-end tests. It shares nothing with the paged path except the
position-local maths in `ops` and the layer skeleton: windows, compression groups, the overlap
and the indexer's visibility are derived here directly from whole-sequence tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from adapters.model import ops
from adapters.model.candidates import Candidates, select_candidates
from adapters.model.engram import EngramRows, sequence_step
from adapters.model.model import LayerInput, compress_rows, forward, forward_tail_only
from adapters.model.model_config import ModelConfig
from adapters.model.weights import Compressor, ModelWeights


def group_rows(rows: torch.Tensor, ratio: int, overlap: bool) -> torch.Tensor:
    """``(..., G, R, F)`` rows of every complete group of ``rows (..., T, F)``; with overlap
    each group is preceded by the previous group's rows (a padding group of kv 0 / score -inf
    before group 0)."""
    num_groups, width = rows.shape[-2] // ratio, rows.shape[-1]
    grouped = rows[..., : num_groups * ratio, :].reshape(*rows.shape[:-2], num_groups, ratio, width)
    if not overlap:
        return grouped
    pad = torch.zeros_like(grouped[..., :1, :, :])
    pad[..., width // 2 :] = float("-inf")
    previous = torch.cat((pad, grouped[..., :-1, :, :]), dim=-3)
    return torch.cat((previous, grouped), dim=-2)


_group_rows = group_rows  # the name `replay_reference` imports


def source_entries(keys, layer: LayerInput) -> torch.Tensor:
    """The compressed entries ``layer`` reads, for a whole-sequence key source (`DenseKeys`,
    `adapters.training.keys.TrainKeys`: ``keys.cfg``, ``keys.entries``, ``keys.index_keys``,
    ``keys.compress``): a KV source compresses its input and publishes the entries (C4: and
    its indexer keys, from the *detached* input: the indexer learns from its own loss only);
    a consumer reads what its source published."""
    i, ratio = layer.index, layer.weights.ratio
    source = keys.cfg.kv_source_of(i)
    if source == i:
        comp, idx = layer.weights.compressor, layer.weights.indexer
        assert comp is not None
        keys.entries[i] = keys.compress(layer.x, comp, ratio)
        if keys.cfg.is_sparse(ratio):
            assert idx is not None and idx.compressor is not None
            keys.index_keys[i] = keys.compress(layer.x.detach(), idx.compressor, ratio)
    return keys.entries[source]  # type: ignore[no-any-return]


class DenseKeys:
    """Keys of a whole sequence of ``length`` tokens: position ``t`` sees the tokens
    ``(t - W, t]`` that the layer computed and every compressed entry whose group ends at or
    before ``t``.

    V4.1 sharing is spelled out here, independently of any pool: a KV-source layer compresses
    its own input over the whole sequence and publishes the entries (C4: and its indexer
    keys); a consumer reads its source's published entries. An index-source layer publishes
    its top-k selection per query; other C4 layers attend to that selection of their own
    source's entries, without an indexer. With ``cfg.candidate_source`` that layer also
    publishes candidate blocks (`adapters.model.candidates`) and later indexer layers of its
    ratio take their top-k among them.

    ``forced``: per indexer layer, a selection ``(indices (T, K), valid (T, K))`` of entry
    indices for every position, used instead of the indexer's top-k (a forced replay of a
    captured selection: docs/runner.md, "Top-k capture and forced replay")."""

    def __init__(
        self,
        cfg: ModelConfig,
        length: int,
        forced: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        self.cfg, self.length, self.forced = cfg, length, dict(forced or {})
        self.entries: dict[int, torch.Tensor] = {}  # per KV-source layer
        self.index_keys: dict[int, torch.Tensor] = {}  # per C4 KV-source layer
        self.selection: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per index source
        self.candidates: Candidates | None = None  # the candidate source's, per query

    def restrict(self, rows: torch.Tensor) -> DenseKeys:
        """The keys for the queries ``rows`` of the sequence (tail-only); published entries
        stay, published selections (and candidates, forced selections) keep those rows."""
        forced = {i: (c[rows], m[rows]) for i, (c, m) in self.forced.items()}
        keys = DenseKeys(self.cfg, self.length, forced)
        keys.entries, keys.index_keys = self.entries, self.index_keys
        keys.selection = {i: (c[rows], m[rows]) for i, (c, m) in self.selection.items()}
        keys.candidates = None if self.candidates is None else self.candidates.rows(rows)
        return keys

    def compress(self, x: torch.Tensor, comp: Compressor, ratio: int) -> torch.Tensor:
        """Entries ``(G, dim)`` of every complete group of the sequence whose inputs are ``x``."""
        if x.shape[0] != self.length:
            raise ValueError("a compressing layer must run over the whole sequence")
        positions = torch.arange(x.shape[0], device=x.device)
        rows = ops.compressor_rows(x, comp, positions)
        grouped = group_rows(rows, ratio, self.cfg.is_overlap(ratio))
        groups = torch.arange(grouped.shape[0], device=x.device)
        return compress_rows(self.cfg, grouped, ratio, groups, comp.norm, self.cfg.rope_dim).to(
            x.dtype
        )

    def attend(self, layer: LayerInput) -> torch.Tensor:
        cfg, t = self.cfg, layer.positions
        keys, mask = self._window(layer)
        ratio = layer.weights.ratio
        if ratio:
            entries = self._source_entries(layer)
            g = torch.arange(entries.shape[0], device=t.device)
            visible = (g[None, :] + 1) * ratio - 1 <= t[:, None]  # (T, G)
            if cfg.is_sparse(ratio):
                chosen, chosen_mask = self._selection(layer, visible)
                keys = torch.cat((keys, entries[chosen]), dim=1)
                mask = torch.cat((mask, chosen_mask), dim=1)
            else:
                keys = torch.cat((keys, entries[None].expand(t.shape[0], -1, -1)), dim=1)
                mask = torch.cat((mask, visible), dim=1)
        return ops.sink_attention(layer.q, keys, mask, layer.weights.sink, cfg.scale)

    def _window(self, layer: LayerInput) -> tuple[torch.Tensor, torch.Tensor]:
        """Window keys ``(N, W, d)`` looked up by position, and their mask: positions before 0
        and positions this layer did not compute (tail-only) are masked."""
        t, w = layer.positions, self.cfg.window
        kv = layer.kv.new_zeros(self.length, layer.kv.shape[1])
        kv[t] = layer.kv
        computed = torch.zeros(self.length, dtype=torch.bool, device=t.device)
        computed[t] = True
        win_pos = t[:, None] - (w - 1) + torch.arange(w, device=t.device)[None, :]
        clamped = win_pos.clamp(min=0)
        return kv[clamped], (win_pos >= 0) & computed[clamped]

    def _source_entries(self, layer: LayerInput) -> torch.Tensor:
        """The entries ``layer`` reads (`source_entries`; a subclass may assemble them
        otherwise: `adapters.distributed.cp.CPKeys`)."""
        return source_entries(self, layer)

    def _selection(self, layer: LayerInput, visible: torch.Tensor):
        """Top-k visible entries per query (indices and validity): the indexer's own when the
        layer runs it (published), else the nearest index source's."""
        cfg, i = self.cfg, layer.index
        if not cfg.runs_indexer(i):
            return self.selection[cfg.index_source_of(i)]
        idx = layer.weights.indexer
        assert idx is not None
        n = layer.x.shape[0]
        keys = self.index_keys[cfg.kv_source_of(i)]
        q = (layer.x @ idx.w_q).view(n, cfg.index_heads, cfg.index_dim)
        q = ops.rope(q, layer.positions, cfg.rope_dim, cfg.rope_theta)
        w = layer.x @ idx.w_weight
        scores = ops.index_scores(q, w, keys[None].expand(n, -1, -1))
        scores = scores.masked_fill(~visible, float("-inf"))
        if i == cfg.candidate_source:
            self.candidates = select_candidates(
                scores, visible.sum(-1), cfg.candidate_blocks, cfg.candidate_block
            )
        if cfg.restricts_to_candidates(i):
            assert self.candidates is not None
            scores = self.candidates.restrict(scores)
        k = min(cfg.index_topk, scores.shape[1])
        values, indices = ops.topk_lowest_index(scores, k)
        self.selection[i] = self.forced.get(i, (indices, torch.isfinite(values)))
        return self.selection[i]


@torch.no_grad()
def reference_logits(
    weights: ModelWeights,
    tokens: list[int] | torch.Tensor,
    forced: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
    engram: EngramRows | None = None,
) -> torch.Tensor:
    """Logits ``(T, V)`` at every position of ``tokens``, computed from scratch; ``forced``:
    the indexer layers' selections to use instead of their top-k (`DenseKeys`); ``engram``:
    the Engram tables (required by an Engram model: `engram.EngramInputError`)."""
    ids = torch.as_tensor(tokens, dtype=torch.long, device=weights.device)
    positions = torch.arange(ids.shape[0], device=weights.device)
    step = sequence_step(weights.config, ids, engram)
    keys = DenseKeys(weights.config, ids.shape[0], forced)
    return forward(weights, ids, positions, keys, engram=step)


@torch.no_grad()
def reference_generate(
    weights: ModelWeights, prompt: list[int], max_new_tokens: int, engram: EngramRows | None = None
) -> list[int]:
    """Greedy continuation, recomputing the whole sequence for every token (slow; tests only)."""
    seq = list(prompt)
    for _ in range(max_new_tokens):
        seq.append(int(reference_logits(weights, seq, engram=engram)[-1].argmax()))
    return seq[len(prompt) :]


# -- decoder-side tail-only prefill (an approximation, DESIGN.md §5) -------------------------------


def tail_only_computed(chunk_lens: Sequence[int], window: int) -> list[bool]:
    """Which positions a tail-only prefill in chunks of ``chunk_lens`` tokens (in order, from
    position 0) computes past the last KV-source layer: the last ``window`` of each chunk."""
    computed: list[bool] = []
    for n in chunk_lens:
        computed += [False] * max(0, n - window) + [True] * min(n, window)
    return computed


@torch.no_grad()
def reference_tail_only_logits(
    weights: ModelWeights,
    tokens: list[int] | torch.Tensor,
    computed: Sequence[bool],
    engram: EngramRows | None = None,
) -> torch.Tensor:
    """Logits ``(C, V)`` at the ``C`` positions where ``computed`` is true, under tail-only
    semantics, from scratch: the layers up to the last KV source run over every token; the
    later layers only over the computed positions, whose windows in those layers see only
    computed positions. A computed position depends on nothing but earlier tokens and which
    earlier positions were computed, so one pass over the sequence reproduces any chunking
    that computed the same positions. ``engram``: as in `reference_logits`."""
    ids = torch.as_tensor(tokens, dtype=torch.long, device=weights.device)
    if len(computed) != ids.shape[0]:
        raise ValueError(f"{len(computed)} computed flags for {ids.shape[0]} tokens")
    positions = torch.arange(ids.shape[0], device=weights.device)
    rows = positions[torch.as_tensor(list(computed), dtype=torch.bool, device=weights.device)]
    keys = DenseKeys(weights.config, ids.shape[0])
    step = sequence_step(weights.config, ids, engram)
    return forward_tail_only(weights, ids, positions, keys, rows, engram=step)


@torch.no_grad()
def reference_tail_only_generate(
    weights: ModelWeights,
    prompt: list[int],
    computed: Sequence[bool],
    max_new_tokens: int,
    engram: EngramRows | None = None,
) -> list[int]:
    """Greedy continuation after a tail-only prefill of ``prompt`` that computed the positions
    flagged in ``computed`` past the last KV source (`tail_only_computed` of its chunks; with a
    reused prefix, the flags of whoever computed it); decode positions are computed in every
    layer. Slow, tests only."""
    seq, flags = list(prompt), list(computed)
    for _ in range(max_new_tokens):
        logits = reference_tail_only_logits(weights, seq, flags, engram)
        seq.append(int(logits[-1].argmax()))
        flags.append(True)
    return seq[len(prompt) :]
