"""Dense reference forward: recomputes everything from the token sequence, with no cache.

This is the oracle of the end-to-end tests. It shares nothing with the paged path except the
position-local maths in `ops` and the layer skeleton: windows, compression groups, the overlap
and the indexer's visibility are derived here directly from whole-sequence tensors.
"""

from __future__ import annotations

import torch

from . import ops
from .model import LayerInput, compress_rows, forward
from .model_config import ModelConfig
from .weights import Compressor, ModelWeights


def _group_rows(rows: torch.Tensor, ratio: int, overlap: bool) -> torch.Tensor:
    """``(G, R, F)`` rows of every complete group; with overlap each group is preceded by the
    previous group's rows (a padding group of kv 0 / score -inf before group 0)."""
    num_groups = rows.shape[0] // ratio
    grouped = rows[: num_groups * ratio].view(num_groups, ratio, rows.shape[-1])
    if not overlap:
        return grouped
    pad = torch.zeros_like(grouped[:1])
    pad[..., rows.shape[-1] // 2 :] = float("-inf")
    previous = torch.cat((pad, grouped[:-1]), dim=0)
    return torch.cat((previous, grouped), dim=1)


class DenseKeys:
    """Keys of a whole sequence: position ``t`` sees tokens ``(t - W, t]`` and every
    compressed entry whose group ends at or before ``t``."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg

    def entries(self, x: torch.Tensor, comp: Compressor, ratio: int, dim_rope: int):
        positions = torch.arange(x.shape[0], device=x.device)
        rows = ops.compressor_rows(x, comp, positions)
        grouped = _group_rows(rows, ratio, self.cfg.is_overlap(ratio))
        groups = torch.arange(grouped.shape[0], device=x.device)
        return compress_rows(self.cfg, grouped, ratio, groups, comp.norm, dim_rope).to(x.dtype)

    def attend(self, layer: LayerInput) -> torch.Tensor:
        cfg, t = self.cfg, layer.positions
        w = cfg.window
        offs = torch.arange(w, device=t.device)
        win_pos = t[:, None] - (w - 1) + offs[None, :]
        win_mask = win_pos >= 0
        keys = layer.kv[win_pos.clamp(min=0)]
        mask = win_mask
        ratio = layer.weights.ratio
        if ratio:
            assert layer.weights.compressor is not None
            entries = self.entries(layer.x, layer.weights.compressor, ratio, cfg.rope_dim)
            g = torch.arange(entries.shape[0], device=t.device)
            visible = (g[None, :] + 1) * ratio - 1 <= t[:, None]  # (T, G)
            if cfg.is_sparse(ratio):
                chosen, chosen_mask = self.select(layer, visible)
                keys = torch.cat((keys, entries[chosen]), dim=1)
                mask = torch.cat((mask, chosen_mask), dim=1)
            else:
                keys = torch.cat((keys, entries[None].expand(t.shape[0], -1, -1)), dim=1)
                mask = torch.cat((mask, visible), dim=1)
        return ops.sink_attention(layer.q, keys, mask, layer.weights.sink, cfg.scale)

    def select(self, layer: LayerInput, visible: torch.Tensor):
        """The indexer's top-k visible entries per query (indices and validity)."""
        cfg, idx = self.cfg, layer.weights.indexer
        assert idx is not None
        n = layer.x.shape[0]
        keys = self.entries(layer.x, idx.compressor, 4, cfg.rope_dim)
        q = (layer.x @ idx.w_q).view(n, cfg.index_heads, cfg.index_dim)
        q = ops.rope(q, layer.positions, cfg.rope_dim, cfg.rope_theta)
        w = layer.x @ idx.w_weight
        scores = ops.index_scores(q, w, keys[None].expand(n, -1, -1))
        scores = scores.masked_fill(~visible, float("-inf"))
        k = min(cfg.index_topk, scores.shape[1])
        values, indices = ops.topk_lowest_index(scores, k)
        return indices, torch.isfinite(values)


@torch.no_grad()
def reference_logits(weights: ModelWeights, tokens: list[int] | torch.Tensor) -> torch.Tensor:
    """Logits ``(T, V)`` at every position of ``tokens``, computed from scratch."""
    ids = torch.as_tensor(tokens, dtype=torch.long, device=weights.device)
    positions = torch.arange(ids.shape[0], device=weights.device)
    return forward(weights, ids, positions, DenseKeys(weights.config))


@torch.no_grad()
def reference_generate(weights: ModelWeights, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation, recomputing the whole sequence for every token (slow; tests only)."""
    seq = list(prompt)
    for _ in range(max_new_tokens):
        seq.append(int(reference_logits(weights, seq)[-1].argmax()))
    return seq[len(prompt) :]
