"""Held-out and training bits per byte, the MTP's agreement and the indexer's attention mass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adapters.model.weights import ModelWeights

from .forward import LN2, next_token_nll, torch_references, train_forward


@dataclass(frozen=True)
class Evaluation:
    """Over every predicted byte of the chunks (each chunk from BOS, its own context only)."""

    bytes: int
    bits_per_byte: float
    mtp_bits_per_byte: float | None
    #: how often the MTP's argmax equals the main model's argmax for the same next token: the
    #: greedy acceptance rate of a first draft
    mtp_agreement: float | None
    #: of the attention mass over all visible C4 entries, the share on the indexer's top-k,
    #: and the share the best k entries would hold (queries seeing more than k entries)
    topk_mass: float | None
    best_topk_mass: float | None

    def line(self) -> str:
        parts = [f"{self.bits_per_byte:.4f} bits/byte over {self.bytes} bytes"]
        if self.mtp_bits_per_byte is not None:
            parts.append(f"MTP {self.mtp_bits_per_byte:.4f} bits/byte, "
                         f"agrees with the main argmax {self.mtp_agreement:.1%}")  # fmt: skip
        if self.topk_mass is not None:
            parts.append(f"indexer top-k holds {self.topk_mass:.1%} of the C4 attention "
                         f"(best k: {self.best_topk_mass:.1%})")  # fmt: skip
        return "; ".join(parts)


@torch.no_grad()
def evaluate(weights: ModelWeights, chunks: list[torch.Tensor], batch: int = 16) -> Evaluation:
    """Bits per byte of ``chunks`` (``(T_i,)`` tokens each, BOS first), run ``batch`` chunks
    of one length at a time through `train_forward` (the reference's maths)."""
    sums = torch.zeros(4, dtype=torch.float64)  # nll, mtp nll, agreements, predicted bytes
    mass = torch.zeros(3, dtype=torch.float64)
    for group in _same_length(chunks, batch):
        tokens = torch.stack(group)
        with torch_references():
            out = train_forward(weights, tokens, aux=False, measure=True)
        sums[0] += float(next_token_nll(out.logits, tokens))
        sums[3] += tokens[:, 1:].numel()
        if out.mtp_logits is not None:
            sums[1] += float(next_token_nll(out.mtp_logits, tokens))
            agree = out.mtp_logits[:, :-1].argmax(-1) == out.logits[:, :-1].argmax(-1)
            sums[2] += float(agree.sum())
        if out.selection_mass is not None:
            mass += out.selection_mass.double().cpu()
    n = float(sums[3])
    has_mtp, rows = weights.mtp is not None, float(mass[2])
    return Evaluation(
        bytes=int(n),
        bits_per_byte=float(sums[0]) / n / LN2,
        mtp_bits_per_byte=float(sums[1]) / n / LN2 if has_mtp else None,
        mtp_agreement=float(sums[2]) / n if has_mtp else None,
        topk_mass=float(mass[0]) / rows if rows else None,
        best_topk_mass=float(mass[1]) / rows if rows else None,
    )


def _same_length(chunks: list[torch.Tensor], batch: int) -> list[list[torch.Tensor]]:
    groups: list[list[torch.Tensor]] = []
    for chunk in chunks:
        if groups and len(groups[-1]) < batch and len(groups[-1][0]) == len(chunk):
            groups[-1].append(chunk)
        else:
            groups.append([chunk])
    return groups
