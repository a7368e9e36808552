"""`TrainKeys`: the differentiable `KeySource` of a batch of whole sequences.

The same attention as the reference's `DenseKeys` (tested equal in fp64): position ``t`` of a
sequence attends to its window ``(t - W, t]``, to the compressed entries whose group has ended
(C128: all of them, dense; C4: the indexer's top-k of them), and to the sink. What differs is
the layout, so that a batch trains fast: ``N = B * T`` rows, the window computed in blocks of
``W`` queries against ``2W`` keys, the compressed part as one more block of logits, and one sink
softmax over both. Gradients reach the model through attention over the *selected* entries only.

The top-k selection has no gradient. The indexer is trained by an auxiliary loss instead, as
DeepSeek's sparse attention trains its lightning indexer: at each C4 layer that runs the
indexer, ``KL(p || softmax(I))`` per query, where ``p`` is the layer's own attention
distribution over *all* visible compressed entries (its queries against its entries, softmax per
head, mean over heads; no gradient) and ``I`` the indexer scores of those entries. The
indexer's inputs (the layer's normed input, for both its queries and its key compressor) are
detached, so that loss trains the indexer alone and the main loss never reaches it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from adapters.model import ops
from adapters.model.candidates import refuse_candidates
from adapters.model.model import LayerInput, compress_rows
from adapters.model.model_config import ModelConfig
from adapters.model.reference import group_rows, source_entries
from adapters.model.weights import Compressor


def window_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """``(T, 2W)`` validity of the block layout: query ``t`` (block ``t // W``) against key
    column ``c`` of its block, position ``p = (t // W - 1) * W + c``; valid for
    ``t - W < p <= t`` and ``p >= 0``."""
    t = torch.arange(length, device=device)[:, None]
    p = (t // window - 1) * window + torch.arange(2 * window, device=device)[None, :]
    return (p > t - window) & (p <= t) & (p >= 0)


def _blocks(x: torch.Tensor, window: int, front: int) -> torch.Tensor:
    """``(B, T, ...)`` padded to whole blocks of ``window`` rows after ``front`` zero rows."""
    pad = -x.shape[1] % window
    return F.pad(x, (0, 0) * (x.dim() - 2) + (front, pad))


class TrainKeys:
    """Keys of ``batch`` sequences of ``length`` tokens each (rows ``b * length + t``).
    ``aux``: compute the indexer's KL loss (`aux_loss`, with gradients only); ``measure``:
    record the attention mass each selection holds (`selection_mass`, in ``mass``). Sharing
    (`ModelConfig.kv_sources`, ``index_sources``) as in `DenseKeys`: consumers read their
    source's published entries, non-index-source C4 layers reuse the published selection."""

    def __init__(
        self, cfg: ModelConfig, batch: int, length: int, aux: bool = True, measure: bool = False
    ) -> None:
        refuse_candidates(cfg, "training")
        self.cfg, self.batch, self.length = cfg, batch, length
        self.aux, self.measure = aux, measure
        self.mass: list[torch.Tensor] = []
        self.entries: dict[int, torch.Tensor] = {}  # (B, G, d) per KV-source layer
        self.index_keys: dict[int, torch.Tensor] = {}  # (B, G, di) per C4 KV-source layer
        self.selection: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # (B, T, k) each
        self.kl: list[torch.Tensor] = []

    @property
    def aux_loss(self) -> torch.Tensor | None:
        """Mean of the indexer KL losses so far (``None`` if no layer ran the indexer)."""
        return torch.stack(self.kl).mean() if self.kl else None

    def attend(self, layer: LayerInput) -> torch.Tensor:
        """The attention output ``(N, H, d)``. Everything here (compressors, indexer, attention)
        computes in fp32 (fp64 for fp64) outside any autocast, as the runner's attention,
        compressor and indexer accumulate; the projections around it may autocast."""
        with torch.autocast(layer.q.device.type, enabled=False):
            return self._attend(layer)

    def _attend(self, layer: LayerInput) -> torch.Tensor:
        cfg, (b, t) = self.cfg, (self.batch, self.length)
        q = layer.q.view(b, t, cfg.num_heads, cfg.head_dim)
        dt = ops.acc_dtype(q)
        q = q.to(dt)
        win_logits, win_keys = self._window_logits(q, layer.kv.view(b, t, -1).to(dt))
        extra = self._extra(layer, q) if layer.weights.ratio else None
        sink = layer.weights.sink.to(dt)[None, None, :]
        m = torch.maximum(win_logits.amax(-1), sink)
        if extra is not None:
            m = torch.maximum(m, extra[0].amax(-1))
        m = m.detach()[..., None]
        p = torch.exp(win_logits - m)
        out = self._window_values(p, win_keys)
        denom = p.sum(-1) + torch.exp(sink - m[..., 0])
        if extra is not None:
            pe = torch.exp(extra[0] - m)
            out = out + torch.einsum("bthk,btkd->bthd", pe, extra[1])
            denom = denom + pe.sum(-1)
        out = out / denom[..., None]
        return out.reshape(b * t, cfg.num_heads, cfg.head_dim).to(layer.q.dtype)

    # -- the window ---------------------------------------------------------------------------

    def _window_logits(self, q: torch.Tensor, kv: torch.Tensor):
        """Masked logits ``(B, T, H, 2W)`` of the block layout, and the key blocks."""
        b, t, h, d = q.shape
        w = self.cfg.window
        qb = _blocks(q, w, 0)
        nb = qb.shape[1] // w
        keys = _blocks(kv, w, w).unfold(1, 2 * w, w).transpose(-1, -2)  # (B, nb, 2W, d)
        logits = torch.einsum("bjihd,bjcd->bjihc", qb.view(b, nb, w, h, d), keys)
        logits = logits.reshape(b, nb * w, h, 2 * w)[:, :t] * self.cfg.scale
        mask = window_mask(t, w, q.device)[None, :, None, :]
        return logits.masked_fill(~mask, float("-inf")), keys

    def _window_values(self, p: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        b, t, h, _ = p.shape
        w, nb = self.cfg.window, keys.shape[1]
        pb = _blocks(p, w, 0).view(b, nb, w, h, 2 * w)
        out = torch.einsum("bjihc,bjcd->bjihd", pb, keys)
        return out.reshape(b, nb * w, h, -1)[:, :t]

    # -- compressed entries -------------------------------------------------------------------

    def _extra(self, layer: LayerInput, q: torch.Tensor):
        """Masked logits ``(B, T, H, K)`` and keys ``(B, T, K, d)`` of the compressed entries
        a layer attends to (``None`` before any group is complete)."""
        cfg, ratio = self.cfg, layer.weights.ratio
        entries = source_entries(self, layer).to(q.dtype)  # (B, G, d)
        if entries.shape[1] == 0:
            return None
        g = torch.arange(entries.shape[1], device=q.device)[None, :]
        t = torch.arange(self.length, device=q.device)[:, None]
        visible = (g + 1) * ratio - 1 <= t  # (T, G): the group has ended
        if cfg.is_sparse(ratio):
            chosen, valid = self._selection(layer, q, entries, visible)
            keys = entries[torch.arange(self.batch, device=q.device)[:, None, None], chosen]
            mask = valid[:, :, None, :]
        else:
            keys = entries[:, None].expand(-1, self.length, -1, -1)
            mask = visible[None, :, None, :]
        logits = torch.einsum("bthd,btkd->bthk", q, keys) * cfg.scale
        return logits.masked_fill(~mask, float("-inf")), keys

    def compress(self, x: torch.Tensor, comp: Compressor, ratio: int) -> torch.Tensor:
        """Entries ``(B, G, dim)`` of every complete group of each sequence (rows ``x``)."""
        b, t = self.batch, self.length
        positions = torch.arange(t, device=x.device)
        x = x.to(ops.acc_dtype(x))
        rows = ops.compressor_rows(x.view(b, t, -1), comp, positions)  # (B, T, F)
        grouped = group_rows(rows, ratio, self.cfg.is_overlap(ratio))  # (B, G, R, F)
        n = grouped.shape[1]
        groups = torch.arange(n, device=x.device).repeat(b)
        flat = grouped.reshape(b * n, grouped.shape[2], rows.shape[-1])
        entries = compress_rows(self.cfg, flat, ratio, groups, comp.norm, self.cfg.rope_dim)
        return entries.to(x.dtype).view(b, n, entries.shape[-1])

    # -- the indexer --------------------------------------------------------------------------

    def _selection(self, layer: LayerInput, q, entries, visible):
        """Top-k visible entries per query ``(B, T, k)`` and their validity: the indexer's
        own (published, with its KL loss) when the layer runs it, else its index source's."""
        cfg, i, (b, t) = self.cfg, layer.index, (self.batch, self.length)
        if not cfg.runs_indexer(i):
            return self.selection[cfg.index_source_of(i)]
        scores = self.index_scores(layer)
        scores = scores.masked_fill(~visible[None], float("-inf"))
        k = min(cfg.index_topk, scores.shape[-1])
        values, chosen = ops.topk_lowest_index(scores.detach().reshape(b * t, -1), k)
        self.selection[i] = (chosen.view(b, t, k), torch.isfinite(values).view(b, t, k))
        if (self.aux and torch.is_grad_enabled()) or self.measure:
            target = attention_target(q, entries, visible, cfg.scale)
            if self.measure:
                self.mass.append(selection_mass(target, *self.selection[i], visible))
            if self.aux and torch.is_grad_enabled():
                self.kl.append(indexer_kl(target, scores, visible))
        return self.selection[i]

    def index_scores(self, layer: LayerInput) -> torch.Tensor:
        """Lightning-indexer scores ``(B, T, G)`` of the layer's detached input against its
        source's indexer keys: ``sum_h w_h relu(q_h . k)`` (`ops.index_scores`, batched)."""
        cfg, idx, (b, t) = self.cfg, layer.weights.indexer, (self.batch, self.length)
        assert idx is not None
        x = layer.x.detach().to(ops.acc_dtype(layer.x))
        q = (x @ idx.w_q).view(b * t, cfg.index_heads, cfg.index_dim)
        q = ops.rope(q, layer.positions, cfg.rope_dim, cfg.rope_theta)
        w = (x @ idx.w_weight).view(b, t, cfg.index_heads)
        keys = self.index_keys[cfg.kv_source_of(layer.index)]
        dt = ops.acc_dtype(q)
        dots = torch.einsum("bthd,bgd->bthg", q.view(b, t, *q.shape[1:]).to(dt), keys.to(dt))
        return torch.einsum("bth,bthg->btg", w.to(dt), torch.relu(dots))


def attention_target(
    q: torch.Tensor, entries: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """``(B, T, G)``, no gradient: the attention of ``q (B, T, H, d)`` over every visible
    entry of ``entries (B, G, d)`` alone (softmax per head, then the heads' mean); rows with
    no visible entry are 0."""
    with torch.no_grad():
        logits = torch.einsum("bthd,bgd->bthg", q, entries.to(q.dtype)) * scale
        logits = logits.masked_fill(~visible[None, :, None, :], float("-inf"))
        target = torch.softmax(logits, dim=-1).mean(2)
        return target.masked_fill(~visible.any(-1)[None, :, None], 0.0)


def indexer_kl(target: torch.Tensor, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Mean over the queries with a visible entry of ``KL(target || softmax(scores))``;
    ``scores (B, T, G)`` are the indexer's, -inf where not visible."""
    rows = visible.any(-1)
    if not bool(rows.any()):
        return scores.sum() * 0.0
    p = target[:, rows]
    log_q = torch.log_softmax(scores[:, rows], dim=-1).masked_fill(~visible[rows][None], 0.0)
    return (torch.xlogy(p, p) - p * log_q).sum(-1).mean()


def selection_mass(
    target: torch.Tensor, chosen: torch.Tensor, valid: torch.Tensor, visible: torch.Tensor
) -> torch.Tensor:
    """``[mass of target on the selection, the best k entries' mass, rows]`` summed over the
    queries that see more entries than are selected (elsewhere every entry is selected)."""
    rows = (visible.sum(-1) > chosen.shape[-1])[None, :].expand(target.shape[0], -1)
    picked = (target.gather(-1, chosen) * valid).sum(-1)[rows]
    best = target.topk(chosen.shape[-1], dim=-1).values.sum(-1)[rows]
    return torch.stack((picked.sum(), best.sum(), rows.sum().to(picked.dtype)))
