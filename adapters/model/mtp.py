"""The MTP layer's maths: one extra SWA-only block that predicts the token after next, for
speculative decoding's drafts; and its dense reference (the oracle).

The MTP row at position ``t`` reads the main model's last hidden state at ``t - 1`` (before the
final norm and head; zeros at ``t = 0``) and the embedding of token ``t``; each is RMS-normed,
the two are concatenated and projected 2D -> D, then one SWA-only block (`layer_forward` with
ratio 0) runs over its own sliding window, and the MTP's final norm and the main model's head
give logits that predict token ``t + 1``. Drafting k tokens chains the MTP block on its own
hidden state (docs/speculative.md). Where its state lives in the pools and how a draft runs
over them is `adapters.forward.mtp`; nothing here knows of pools.
"""

from __future__ import annotations

import torch

from adapters.model import ops
from adapters.model.model import final_hidden, head_logits, layer_forward
from adapters.model.reference import DenseKeys
from adapters.model.weights import ModelWeights, MTPWeights


def mtp_weights(weights: ModelWeights) -> MTPWeights:
    if weights.mtp is None:
        raise ValueError("the model has no MTP layer (ModelConfig.mtp=False)")
    return weights.mtp


def mtp_streams(weights: ModelWeights, prev_hidden: torch.Tensor, tokens: torch.Tensor):
    """The MTP block's input streams ``(N, S, D)`` from the previous position's hidden state
    ``(N, D)`` and the tokens ``(N,)``."""
    cfg, m = weights.config, mtp_weights(weights)
    h = ops.rms_norm(prev_hidden, m.hidden_norm, cfg.norm_eps)
    e = ops.rms_norm(weights.embed[tokens], m.embed_norm, cfg.norm_eps)
    x = torch.cat((h, e), dim=-1) @ m.proj
    return x[:, None, :].expand(-1, cfg.hc_streams, -1).contiguous()


def mtp_hidden(
    weights: ModelWeights,
    prev_hidden: torch.Tensor,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    keys,
) -> torch.Tensor:
    """The MTP block's output hidden state ``(N, D)``; ``keys`` (a `KeySource`) sees the MTP
    layer as layer ``num_layers`` (ratio 0: its window only)."""
    cfg = weights.config
    streams = mtp_streams(weights, prev_hidden, tokens)
    m = mtp_weights(weights)
    return layer_forward(cfg, cfg.num_layers, m.layer, streams, positions, keys).mean(dim=1)


def mtp_logits(weights: ModelWeights, hidden: torch.Tensor) -> torch.Tensor:
    return head_logits(weights, hidden, mtp_weights(weights).final_norm)


def mtp_kv(
    weights: ModelWeights, prev_hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """The MTP layer's SWA latent ``(N, d)`` of committed positions: the ops of `layer_forward`
    up to its ``kv`` (bit-identical), without the attention and FFN nobody reads."""
    cfg, lw = weights.config, mtp_weights(weights).layer
    streams = mtp_streams(weights, prev_hidden, tokens)
    x, _, _ = ops.hc_mix(streams, lw.hc_attn, cfg.sinkhorn_iters, cfg.norm_eps)
    xn = ops.rms_norm(x, lw.attn_norm, cfg.norm_eps)
    kv = ops.rms_norm(xn @ lw.w_kv, lw.kv_norm, cfg.norm_eps)
    return ops.rope(kv, positions, cfg.rope_dim, cfg.rope_theta)


# -- the dense reference ------------------------------------------------------------------------


@torch.no_grad()
def reference_mtp_logits(weights: ModelWeights, tokens: list[int] | torch.Tensor) -> torch.Tensor:
    """MTP logits ``(T, V)`` at every position of ``tokens``, recomputed from scratch: row ``t``
    predicts token ``t + 1`` from the main hidden state at ``t - 1`` and token ``t``."""
    ids = torch.as_tensor(tokens, dtype=torch.long, device=weights.device)
    positions = torch.arange(ids.shape[0], device=weights.device)
    keys = DenseKeys(weights.config, ids.shape[0])
    hidden = final_hidden(weights, ids, positions, keys)
    prev = torch.cat((hidden.new_zeros(1, hidden.shape[1]), hidden[:-1]))
    return mtp_logits(weights, mtp_hidden(weights, prev, ids, positions, keys))


@torch.no_grad()
def reference_mtp_draft(
    weights: ModelWeights, tokens: list[int], num_tokens: int
) -> tuple[list[int], torch.Tensor]:
    """The MTP's greedy draft of ``num_tokens`` tokens after ``tokens`` (the last one is the
    pending token, not yet run through the main model), recomputed densely for every token:
    draft ``j`` comes from the MTP row at ``len(tokens) - 1 + j`` whose previous hidden state is
    the main model's for ``j = 0`` and the MTP's own row before it afterwards. Returns the
    drafts and their logits ``(num_tokens, V)``."""
    dev = weights.device
    ids = torch.as_tensor(tokens, dtype=torch.long, device=dev)
    main = final_hidden(
        weights, ids, torch.arange(len(tokens), device=dev), DenseKeys(weights.config, len(ids))
    )
    prev = torch.cat((main.new_zeros(1, main.shape[1]), main[:-1]))
    drafts: list[int] = []
    logits = []
    for _ in range(num_tokens):
        seq = torch.cat((ids, torch.as_tensor(drafts, dtype=torch.long, device=dev)))
        keys = DenseKeys(weights.config, len(seq))  # the MTP layer: its window only
        h = mtp_hidden(weights, prev, seq, torch.arange(len(seq), device=dev), keys)
        logits.append(mtp_logits(weights, h[-1:])[0])
        drafts.append(int(logits[-1].argmax()))
        prev = torch.cat((prev, h[-1:]))
    return drafts, torch.stack(logits)
