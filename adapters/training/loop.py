"""The training run: parameters, AdamW with warmup and cosine decay, checkpoints, evaluation.

Deterministic given ``TrainConfig.seed``: the initial weights are the preset's seeded random
weights (`init_weights`), the batches of step ``s`` depend on ``(seed, s)`` only, and a run
resumed from a checkpoint continues exactly as the uninterrupted run (on the CPU bit for bit;
on CUDA up to the order of the atomic additions in index backward passes).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from adapters.model.model_config import ModelConfig, preset
from adapters.model.weights import init_weights
from adapters.model.weights_file import from_state_dict, state_dict
from adapters.training.corpus import Split

from .data import TokenData
from .evaluate import evaluate
from .forward import losses, train_forward

CHECKPOINT_VERSION = 2
#: steps timed to fit a time budget (the first ones compile and warm up)
CALIBRATION = range(10, 30)
#: seconds a budgeted run keeps for the final evaluation and saving
EVAL_RESERVE_S = 30.0


@dataclass(frozen=True)
class TrainConfig:
    """One training run. ``batch`` sequences of ``seq_len`` tokens a step."""

    preset: str = "tiny-trained"
    steps: int = 2000
    batch: int = 32
    seq_len: int = 1024
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_weight: float = 0.3
    aux_weight: float = 1.0
    #: train an EAGLE draft head for the (frozen) preset instead of the model (`train_eagle`)
    eagle: bool = False
    eagle_depth: int = 3  # chained draft steps per position
    eagle_reg_weight: float = 1.0
    seed: int = 0
    bf16: bool = True  # autocast on CUDA (the CPU always trains in fp32)
    log_every: int = 50
    eval_bytes: int = 256 * 1024  # per split, at the end

    def __post_init__(self) -> None:
        sizes = (self.steps, self.batch, self.warmup + 1, self.log_every, self.eagle_depth)
        if min(sizes) < 1 or self.seq_len < 2:
            raise ValueError(f"bad training sizes: {self}")

    def lr_at(self, step: int) -> float:
        """Linear warmup over ``warmup`` steps, then cosine decay to ``min_lr_ratio * lr``."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        done = (step - self.warmup) / max(1, self.steps - self.warmup)
        floor = self.min_lr_ratio
        return self.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, done))))


@dataclass(frozen=True)
class TrainResult:
    config: TrainConfig  # as run (its steps set by a time budget, if any)
    weights: Any  # `ModelWeights`; an `EagleWeights` head from `train_eagle`
    steps_done: int
    stopped_early: bool  # the time limit ended the run before ``steps``
    wall_s: float
    train: Any  # `Evaluation` (`EagleEvaluation` for a head), None when not evaluated
    heldout: Any
    log: tuple[dict[str, float], ...]  # one row per logged step


class Objective(Protocol):
    """What `run_steps` optimises: leaf ``params`` (fp32), the ``identity`` a checkpoint of
    the run must match (besides the `TrainConfig`), and one batch's loss."""

    params: dict[str, torch.Tensor]
    identity: dict[str, object]

    def loss(self, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss to minimise and the values to log (tensors)."""
        ...


class ModelObjective:
    """The model and its MTP layer: ``main + mtp_weight * mtp + aux_weight * indexer_kl``
    (`forward.losses`), from the preset's seeded random weights."""

    def __init__(self, cfg: ModelConfig, tc: TrainConfig, device: torch.device) -> None:
        self.cfg, self.tc = cfg, tc
        self.params = init_params(cfg, device)
        self.identity: dict[str, object] = dict(model_config=cfg.plain())

    def loss(self, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out = train_forward(from_state_dict(self.cfg, self.params), tokens)
        ls = losses(out, tokens, self.tc.mtp_weight, self.tc.aux_weight)
        row = {"bits_per_byte": ls.main / math.log(2)}
        if ls.mtp is not None:
            row["mtp_bits_per_byte"] = ls.mtp / math.log(2)
        if ls.indexer_kl is not None:
            row["indexer_kl"] = ls.indexer_kl
        return ls.total, row


def init_params(cfg: ModelConfig, device: torch.device) -> dict[str, torch.Tensor]:
    """Leaf fp32 tensors, one per weight, from the preset's seeded random weights."""
    weights = init_weights(cfg, device, torch.float32)
    return {n: t.detach().clone().requires_grad_(True) for n, t in state_dict(weights).items()}


def make_optimizer(params: dict[str, torch.Tensor], tc: TrainConfig) -> torch.optim.AdamW:
    """AdamW; matrices decay, vectors (norms, biases, sinks) and the compressors' position
    biases (``ape``) do not."""
    decay = [t for n, t in params.items() if t.dim() >= 2 and not n.endswith("ape")]
    keep = [t for n, t in params.items() if t.dim() < 2 or n.endswith("ape")]
    groups = [dict(params=decay, weight_decay=tc.weight_decay), dict(params=keep, weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(0.9, 0.95), eps=1e-8)


def save_checkpoint(path: Path, tc: TrainConfig, identity: dict, step: int, params, opt) -> None:
    """Everything a resumed run needs (``step`` steps done)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(dict(version=CHECKPOINT_VERSION, train_config=dataclasses.asdict(tc),
                    identity=identity, step=step,
                    params={n: t.detach().cpu() for n, t in params.items()},
                    optimizer=opt.state_dict()), path)  # fmt: skip


def load_checkpoint(path: Path, tc: TrainConfig, identity: dict, params, opt) -> int:
    """Restores ``params`` and ``opt`` in place; returns the steps done. Raises `ValueError`
    for a checkpoint of another run (training config, model or target)."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if ckpt.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"{path}: checkpoint version {ckpt.get('version')}")
    mine = dataclasses.asdict(tc)
    theirs = ckpt["train_config"]
    if theirs != mine or ckpt["identity"] != identity:
        changed = sorted(k for k in mine if theirs.get(k) != mine[k])
        raise ValueError(f"{path}: a checkpoint of another run (differs in {changed or 'model'})")
    with torch.no_grad():
        for name, value in ckpt["params"].items():
            params[name].copy_(value)
    opt.load_state_dict(ckpt["optimizer"])
    return int(ckpt["step"])


@dataclass(frozen=True)
class Budget:
    """When a run stops early or sets its steps: as `train`'s keyword arguments."""

    checkpoint: Path | None = None
    checkpoint_every: int = 500
    resume: Path | None = None
    max_minutes: float | None = None
    budget_minutes: float | None = None
    stop_at: int | None = None


@dataclass(frozen=True)
class StepsDone:
    config: TrainConfig  # as run (``steps`` set by a time budget, if any)
    steps_done: int
    stopped_early: bool
    wall_s: float
    log: tuple[dict[str, float], ...]


def run_steps(
    tc: TrainConfig,
    objective: Objective,
    data: TokenData,
    device: torch.device,
    budget: Budget,
    log: Callable[[str], None] = print,
) -> StepsDone:
    """The optimisation of ``objective`` on ``data``'s batches (``objective.params`` are
    updated in place), with `train`'s checkpoints, time budget and stops."""
    params = objective.params
    opt = make_optimizer(params, tc)
    resume = budget.resume
    start = load_checkpoint(resume, tc, objective.identity, params, opt) if resume else 0
    autocast = tc.bf16 and device.type == "cuda"
    t0, t_calib, rows, stopped = time.perf_counter(), 0.0, [], False
    step = start
    while step < tc.steps:
        if budget.budget_minutes is not None and start == 0 and step == CALIBRATION.stop:
            _sync(device)
            tc = _calibrated(tc, budget.budget_minutes, time.perf_counter() - t0, t_calib, log)
        if step == CALIBRATION.start:
            _sync(device)
            t_calib = time.perf_counter()
        limit = budget.max_minutes
        over_time = limit is not None and time.perf_counter() - t0 > 60 * limit
        if over_time or (budget.stop_at is not None and step >= budget.stop_at):
            stopped = True
            break
        tokens = data.batch(tc.seed, step, tc.batch).to(device)
        row = _step(tc, objective, opt, tokens, step, autocast)
        if row is not None:
            rows.append({"step": step, **{k: float(v) for k, v in row.items()}})
            log(_progress(rows[-1], time.perf_counter() - t0, step - start + 1))
        step += 1
        if budget.checkpoint is not None and step % budget.checkpoint_every == 0:
            save_checkpoint(budget.checkpoint, tc, objective.identity, step, params, opt)
    if budget.checkpoint is not None:
        save_checkpoint(budget.checkpoint, tc, objective.identity, step, params, opt)
    return StepsDone(tc, step, stopped, time.perf_counter() - t0, tuple(rows))


def train(
    tc: TrainConfig,
    corpus: Split,
    device: torch.device,
    *,
    model: ModelConfig | None = None,
    evaluate_at_end: bool = True,
    log: Callable[[str], None] = print,
    **budget: Any,
) -> TrainResult:
    """Trains ``model`` (default: the preset ``tc.preset``, any preset the model supports,
    V4.1 sharing included) on ``corpus.train``; evaluates both splits at the end (the weights
    rounded as they are saved: bf16).

    ``budget`` (`Budget`'s fields): ``checkpoint`` (every ``checkpoint_every`` steps and at
    the end), ``resume`` (a checkpoint of the same run), ``budget_minutes`` (a fresh run
    only): the number of steps is set from the speed of steps `CALIBRATION` (during the
    warmup, whose learning rates do not depend on it), so the run is exactly the run of
    ``steps=N`` (N is logged and kept in the checkpoint). ``max_minutes``: a hard stop
    (checkpointed, resumable; `TrainResult.stopped_early`); ``stop_at``: the same after that
    many steps (a run split into parts resumes exactly)."""
    torch.manual_seed(tc.seed)
    cfg = model or preset(tc.preset)
    objective = ModelObjective(cfg, tc, device)
    data = TokenData(corpus.train, tc.seq_len)
    done = run_steps(tc, objective, data, device, Budget(**budget), log)
    weights = rounded(cfg, objective.params)
    train_eval = heldout_eval = None
    if evaluate_at_end:
        train_eval = evaluate(weights, TokenData(corpus.train, tc.seq_len, device)
                              .spread_chunks(tc.eval_bytes))  # fmt: skip
        heldout_eval = evaluate(weights, TokenData(corpus.heldout, tc.seq_len, device)
                                .chunks(tc.eval_bytes))  # fmt: skip
        log(f"train:    {train_eval.line()}")
        log(f"held out: {heldout_eval.line()}")
    return TrainResult(done.config, weights, done.steps_done, done.stopped_early, done.wall_s,
                       train_eval, heldout_eval, done.log)  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _calibrated(tc: TrainConfig, minutes: float, elapsed: float, t_calib: float, log):
    """``tc`` with the steps that fit ``minutes`` at the speed measured since ``t_calib``."""
    if tc.warmup < CALIBRATION.stop:
        raise ValueError(f"a time budget needs warmup >= {CALIBRATION.stop} steps")
    per_step = (time.perf_counter() - t_calib) / len(CALIBRATION)
    left = 60 * minutes - elapsed - EVAL_RESERVE_S
    steps = max(CALIBRATION.stop, CALIBRATION.stop + int(left / per_step))
    log(f"calibrated: {per_step:.3f} s/step -> {steps} steps in {minutes} min "
        f"(--steps {steps} reproduces this run)")  # fmt: skip
    return dataclasses.replace(tc, steps=steps)


def _step(tc: TrainConfig, objective: Objective, opt, tokens, step: int, autocast: bool):
    """One optimiser step; the logged values (tensors) on the steps that are logged."""
    for group in opt.param_groups:
        group["lr"] = tc.lr_at(step)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        total, row = objective.loss(tokens)
    opt.zero_grad(set_to_none=True)
    total.backward()
    norm = torch.nn.utils.clip_grad_norm_(list(objective.params.values()), tc.grad_clip)
    opt.step()
    if step % tc.log_every and step != tc.steps - 1:
        return None
    row = {"loss": total, **row, "grad_norm": norm, "lr": torch.tensor(tc.lr_at(step))}
    return {k: v.detach() for k, v in row.items()}


def _progress(row: dict[str, float], elapsed: float, steps: int) -> str:
    values = ", ".join(f"{k} {v:.3f}" for k, v in row.items()
                       if k not in ("step", "loss", "grad_norm", "lr"))  # fmt: skip
    return (
        f"step {int(row['step'])}: loss {row['loss']:.4f}, {values}, grad "
        f"{row['grad_norm']:.2f}, lr {row['lr']:.2e}, {elapsed / steps:.3f} s/step"
    )


def rounded(cfg: ModelConfig, params: dict[str, torch.Tensor], dtype=torch.bfloat16):
    """fp32 weights rounded through ``dtype`` (what a saved file holds), detached."""
    with torch.no_grad():
        return from_state_dict(cfg, {n: t.detach().to(dtype).float() for n, t in params.items()})
