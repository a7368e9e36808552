"""The training forward: the runner's own layer skeleton and MTP block over `TrainKeys`.

Nothing here re-implements the model: `adapters.model.model.final_hidden` / `head_logits` and
`adapters.forward.mtp.mtp_hidden` / `mtp_logits` run as the runner runs them; only the `KeySource`
differs (`TrainKeys`: the reference's attention, batched and differentiable). The mHC Triton
kernels have no backward, so the forward runs with `kernels.HC_KERNELS` off (their torch
references: the same maths).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from adapters.forward.mtp import mtp_hidden, mtp_logits
from adapters.model.model import final_hidden, head_logits
from adapters.model.weights import ModelWeights

from .. import kernels
from .keys import TrainKeys

LN2 = math.log(2.0)


@contextlib.contextmanager
def torch_references() -> Iterator[None]:
    """The mHC merge and Sinkhorn through their torch references (differentiable)."""
    saved = kernels.HC_KERNELS
    kernels.HC_KERNELS = False
    try:
        yield
    finally:
        kernels.HC_KERNELS = saved


@dataclass(frozen=True)
class TrainOutput:
    logits: torch.Tensor  # (B, T, V) fp32: row t predicts token t + 1
    mtp_logits: torch.Tensor | None  # (B, T, V): the MTP row t predicts token t + 1 as well
    aux_loss: torch.Tensor | None  # the indexer's KL loss (None without a C4 indexer)
    #: ``[selected mass, best-k mass, rows]`` over the indexer layers (``measure`` only)
    selection_mass: torch.Tensor | None = None


def train_forward(
    weights: ModelWeights, tokens: torch.Tensor, aux: bool = True, measure: bool = False
) -> TrainOutput:
    """Logits of every position of ``tokens (B, T)``, each sequence from position 0. The MTP
    row ``t`` reads the main hidden state at ``t - 1`` (zeros at 0) and token ``t``, exactly as
    `adapters.forward.mtp.reference_mtp_logits`. ``aux`` / ``measure``: as `TrainKeys`."""
    cfg = weights.config
    b, t = tokens.shape
    ids = tokens.reshape(-1)
    positions = torch.arange(t, device=tokens.device).repeat(b)
    keys = TrainKeys(cfg, b, t, aux=aux, measure=measure)
    with torch_references():
        hidden = final_hidden(weights, ids, positions, keys)
        logits = head_logits(weights, hidden).view(b, t, -1)
        mtp = None
        if weights.mtp is not None:
            h = hidden.view(b, t, -1)
            prev = torch.cat((h.new_zeros(b, 1, h.shape[-1]), h[:, :-1]), dim=1)
            out = mtp_hidden(weights, prev.reshape(b * t, -1), ids, positions, keys)
            mtp = mtp_logits(weights, out).view(b, t, -1)
    mass = torch.stack(keys.mass).sum(0) if keys.mass else None
    return TrainOutput(logits, mtp, keys.aux_loss, mass)


def next_token_nll(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Summed negative log-likelihood (nats, fp32) of ``tokens[:, 1:]`` under ``logits[:, :-1]``."""
    v = logits.shape[-1]
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, v).float(), tokens[:, 1:].reshape(-1), reduction="sum"
    )


@dataclass(frozen=True)
class Losses:
    total: torch.Tensor  # what the optimiser minimises
    main: torch.Tensor  # mean nats per predicted token
    mtp: torch.Tensor | None
    indexer_kl: torch.Tensor | None


def losses(out: TrainOutput, tokens: torch.Tensor, mtp_weight: float, aux_weight: float) -> Losses:
    """``main + mtp_weight * mtp + aux_weight * indexer_kl`` (the MTP's gradient reaches the
    main model through the hidden state it reads, as in DeepSeek-V3's MTP objective)."""
    count = tokens[:, 1:].numel()
    main = next_token_nll(out.logits, tokens) / count
    total = main
    mtp = None
    if out.mtp_logits is not None:
        mtp = next_token_nll(out.mtp_logits, tokens) / count
        total = total + mtp_weight * mtp
    if out.aux_loss is not None:
        total = total + aux_weight * out.aux_loss
    return Losses(total, main, mtp, out.aux_loss)
