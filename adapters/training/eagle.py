"""The EAGLE head's objective and evaluation, against a frozen target (docs/training.md).

The target (trained, frozen: its weights never change, so a head is trained *for* one shipped
file) runs its training forward without gradients: its hidden state at every position (the
feature) and its logits. The head then runs `adapters.model.eagle.draft_chain` from every
position ``t`` of every sequence at once, ``depth`` steps, teacher-forced: step ``j`` reads
the feature it predicted at step ``j - 1`` (the target's at ``t - 1`` for ``j = 0``) and the
text's token ``t + j``, and is scored against the target at ``t + j``:

* **kl**: ``KL(target || head)`` of the next-token distributions (distillation: what greedy
  verification accepts is the target's argmax, not the text's next byte);
* **reg**: smooth L1 between the RMS-normalised predicted feature and the target's (EAGLE's
  feature regression; normalised because both consumers of a feature, the head's next step
  and the target's head, RMS-norm it first).

Steps after the first read the head's own predictions, as drafting does (so no feature noise
is needed to train robustness to its own errors, EAGLE-3's "training-time test").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from adapters.model.eagle import (
    EagleConfig,
    EagleWeights,
    draft_chain,
    init_eagle,
    target_fingerprint,
)
from adapters.model.model import final_hidden, head_logits
from adapters.model.weights import ModelWeights
from adapters.training.corpus import Split

from .data import TokenData
from .forward import torch_references
from .keys import TrainKeys
from .loop import Budget, TrainConfig, TrainResult, run_steps


@torch.no_grad()
def target_features(target: ModelWeights, tokens: torch.Tensor):
    """The target's hidden states ``(B, T, D)`` and fp32 logits ``(B, T, V)`` of ``tokens``,
    without gradients (the reference's maths, as `train_forward`)."""
    b, t = tokens.shape
    positions = torch.arange(t, device=tokens.device).repeat(b)
    with torch_references():
        hidden = final_hidden(target, tokens.reshape(-1), positions,
                              TrainKeys(target.config, b, t, aux=False))  # fmt: skip
    return hidden.view(b, t, -1), head_logits(target, hidden).view(b, t, -1)


@dataclass(frozen=True)
class EagleLosses:
    total: torch.Tensor  # mean over the steps of kl + reg_weight * reg
    kl: torch.Tensor  # (depth,) mean nats per scored row
    reg: torch.Tensor  # (depth,)
    agree: torch.Tensor  # (depth,) share of rows whose argmax equals the target's
    rows: torch.Tensor  # (depth,) rows scored


def _shifted(x: torch.Tensor, j: int) -> torch.Tensor:
    """``(B, T, ...)`` moved ``j`` positions earlier (row ``t`` holds ``t + j``; zeros past the
    end), flattened to ``(B * T, ...)``."""
    out = torch.zeros_like(x)
    out[:, : x.shape[1] - j] = x[:, j:]
    return out.reshape(-1, *x.shape[2:])


def _unit(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def eagle_losses(
    target: ModelWeights,
    head: EagleWeights,
    tokens: torch.Tensor,
    hidden: torch.Tensor,
    logits: torch.Tensor,
    depth: int,
    reg_weight: float,
) -> EagleLosses:
    """The head's losses over every chain start of ``tokens (B, T)`` (module docstring);
    ``hidden`` / ``logits``: `target_features` of ``tokens``. Step ``j`` scores the starts
    ``t < T - j``."""
    b, t = tokens.shape
    prev = torch.cat((hidden.new_zeros(b, 1, hidden.shape[-1]), hidden[:, :-1]), dim=1)
    inputs = [_shifted(tokens, j) for j in range(depth + 1)]
    _, draft_logits, features = draft_chain(
        target, head, prev.reshape(b * t, -1), inputs[0], depth, lambda _, j: inputs[j + 1]
    )
    start = torch.arange(t, device=tokens.device).repeat(b)
    kl, reg, agree, rows = [], [], [], []
    for j in range(depth):
        valid = start < t - j
        p_log = torch.log_softmax(_shifted(logits, j)[valid].float(), dim=-1)
        q_log = torch.log_softmax(draft_logits[:, j][valid].float(), dim=-1)
        kl.append(F.kl_div(q_log, p_log, log_target=True, reduction="batchmean"))
        h = _unit(_shifted(hidden, j)[valid])
        reg.append(F.smooth_l1_loss(_unit(features[:, j][valid]), h))
        agree.append((q_log.argmax(-1) == p_log.argmax(-1)).float().mean())
        rows.append(valid.sum())
    kl_t, reg_t = torch.stack(kl), torch.stack(reg)
    total = (kl_t + reg_weight * reg_t).mean()
    return EagleLosses(total, kl_t, reg_t, torch.stack(agree), torch.stack(rows))


@dataclass(frozen=True)
class EagleEvaluation:
    """Teacher-forced, over every chain start of the chunks (each chunk from BOS)."""

    bytes: int
    kl: tuple[float, ...]  # per step, nats
    #: per step: how often the head's argmax equals the target's (the text before it given)
    agreement: tuple[float, ...]

    @property
    def acceptance_estimate(self) -> float:
        """``1 + sum_j prod_{i <= j} agreement_i``: the mean acceptance length of greedy
        verification if every step's agreement held independently of the ones before (an
        estimate: the runner's figure is bench/speculative.py's)."""
        total, run = 1.0, 1.0
        for a in self.agreement:
            run *= a
            total += run
        return total

    def line(self) -> str:
        agree = " / ".join(f"{a:.1%}" for a in self.agreement)
        return (f"EAGLE over {self.bytes} bytes: agreement with the target's argmax by step "
                f"{agree}, acceptance length ~{self.acceptance_estimate:.2f}")  # fmt: skip


@torch.no_grad()
def evaluate_eagle(
    target: ModelWeights, head: EagleWeights, chunks: list[torch.Tensor], depth: int
) -> EagleEvaluation:
    """`eagle_losses` of ``chunks`` (``(T_i,)`` tokens each, those longer than ``depth``), one
    chunk at a time."""
    kl = torch.zeros(depth, dtype=torch.float64)
    agree = torch.zeros(depth, dtype=torch.float64)
    rows = torch.zeros(depth, dtype=torch.float64)
    count = 0
    for chunk in (c for c in chunks if len(c) > depth):
        tokens = chunk[None]
        hidden, logits = target_features(target, tokens)
        ls = eagle_losses(target, head, tokens, hidden, logits, depth, 0.0)
        n = ls.rows.double().cpu()
        kl += ls.kl.double().cpu() * n
        agree += ls.agree.double().cpu() * n
        rows += n
        count += tokens.shape[1] - 1
    return EagleEvaluation(count, tuple((kl / rows).tolist()), tuple((agree / rows).tolist()))


class EagleObjective:
    """`eagle_losses` of a head (from its seeded random weights, seed ``tc.seed``) for the
    frozen ``target``; a checkpoint must match the target's fingerprint and the head's shape."""

    def __init__(self, target: ModelWeights, tc: TrainConfig, device: torch.device) -> None:
        self.target, self.tc = target, tc
        self.config = EagleConfig.for_target(target.config, seed=tc.seed)
        head = init_eagle(self.config, device, torch.float32)
        self.params = {n: t.detach().clone().requires_grad_(True)
                       for n, t in head.tensors().items()}  # fmt: skip
        self.identity: dict[str, object] = dict(
            target=target_fingerprint(target), eagle_config=dataclasses.asdict(self.config)
        )

    def head(self) -> EagleWeights:
        return EagleWeights(self.config, **self.params)

    def loss(self, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        hidden, logits = target_features(self.target, tokens)
        ls = eagle_losses(self.target, self.head(), tokens, hidden, logits,
                          self.tc.eagle_depth, self.tc.eagle_reg_weight)  # fmt: skip
        return ls.total, {"kl": ls.kl.mean(), "reg": ls.reg.mean(), "agree_first": ls.agree[0],
                          "agree_last": ls.agree[-1]}  # fmt: skip


def train_eagle(
    tc: TrainConfig,
    corpus: Split,
    device: torch.device,
    target: ModelWeights,
    *,
    evaluate_at_end: bool = True,
    log: Callable[[str], None] = print,
    **budget: Any,
) -> TrainResult:
    """Trains an EAGLE head for ``target`` (frozen, on ``device``, fp32) on ``corpus.train``,
    as `loop.train` trains a model (the same batches, optimiser, schedule, checkpoints and
    ``budget``); evaluates both splits with the head rounded to bf16 (`EagleEvaluation`).
    ``TrainResult.weights`` is the head."""
    torch.manual_seed(tc.seed)
    objective = EagleObjective(target, tc, device)
    data = TokenData(corpus.train, tc.seq_len)
    done = run_steps(tc, objective, data, device, Budget(**budget), log)
    with torch.no_grad():
        head = EagleWeights(objective.config, **{n: t.detach().to(torch.bfloat16).float()
                                                 for n, t in objective.params.items()})  # fmt: skip
    train_eval = heldout_eval = None
    if evaluate_at_end:
        depth = tc.eagle_depth
        spread = TokenData(corpus.train, tc.seq_len, device).spread_chunks(tc.eval_bytes)
        train_eval = evaluate_eagle(target, head, spread, depth)
        held = TokenData(corpus.heldout, tc.seq_len, device).chunks(tc.eval_bytes)
        heldout_eval = evaluate_eagle(target, head, held, depth)
        log(f"train:    {train_eval.line()}")
        log(f"held out: {heldout_eval.line()}")
    return TrainResult(done.config, head, done.steps_done, done.stopped_early, done.wall_s,
                       train_eval, heldout_eval, done.log)  # fmt: skip
