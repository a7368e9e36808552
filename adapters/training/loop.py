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

import torch

from adapters.model.model_config import ModelConfig, preset
from adapters.model.weights import ModelWeights, init_weights
from adapters.model.weights_file import from_state_dict, state_dict
from adapters.training.corpus import Split

from .data import TokenData
from .evaluate import Evaluation, evaluate
from .forward import losses, train_forward

CHECKPOINT_VERSION = 1
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
    seed: int = 0
    bf16: bool = True  # autocast on CUDA (the CPU always trains in fp32)
    log_every: int = 50
    eval_bytes: int = 256 * 1024  # per split, at the end

    def __post_init__(self) -> None:
        if min(self.steps, self.batch, self.warmup + 1, self.log_every) < 1 or self.seq_len < 2:
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
    weights: ModelWeights
    steps_done: int
    stopped_early: bool  # the time limit ended the run before ``steps``
    wall_s: float
    train: Evaluation | None
    heldout: Evaluation | None
    log: tuple[dict[str, float], ...]  # one row per logged step


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


def save_checkpoint(path: Path, tc: TrainConfig, cfg: ModelConfig, step: int, params, opt) -> None:
    """Everything a resumed run needs (``step`` steps done)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(dict(version=CHECKPOINT_VERSION, train_config=dataclasses.asdict(tc),
                    model_config=dataclasses.asdict(cfg), step=step,
                    params={n: t.detach().cpu() for n, t in params.items()},
                    optimizer=opt.state_dict()), path)  # fmt: skip


def load_checkpoint(path: Path, tc: TrainConfig, cfg: ModelConfig, params, opt) -> int:
    """Restores ``params`` and ``opt`` in place; returns the steps done. Raises `ValueError`
    for a checkpoint of another run (training or model config)."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if ckpt.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"{path}: checkpoint version {ckpt.get('version')}")
    mine = dataclasses.asdict(tc)
    theirs = ckpt["train_config"]
    if theirs != mine or ckpt["model_config"] != dataclasses.asdict(cfg):
        changed = sorted(k for k in mine if theirs.get(k) != mine[k])
        raise ValueError(f"{path}: a checkpoint of another run (differs in {changed or 'model'})")
    with torch.no_grad():
        for name, value in ckpt["params"].items():
            params[name].copy_(value)
    opt.load_state_dict(ckpt["optimizer"])
    return int(ckpt["step"])


def train(
    tc: TrainConfig,
    corpus: Split,
    device: torch.device,
    *,
    model: ModelConfig | None = None,
    checkpoint: Path | None = None,
    checkpoint_every: int = 500,
    resume: Path | None = None,
    max_minutes: float | None = None,
    budget_minutes: float | None = None,
    stop_at: int | None = None,
    evaluate_at_end: bool = True,
    log: Callable[[str], None] = print,
) -> TrainResult:
    """Trains ``model`` (default: the preset ``tc.preset``) on ``corpus.train``; evaluates
    both splits at the end (the weights rounded as they are saved: bf16).

    ``budget_minutes`` (a fresh run only): the number of steps is set from the speed of steps
    `CALIBRATION` (during the warmup, whose learning rates do not depend on it), so the run is
    exactly the run of ``steps=N`` (N is logged and kept in the checkpoint). ``max_minutes``:
    a hard stop (checkpointed, resumable; `TrainResult.stopped_early`); ``stop_at``: the same
    after that many steps (a run split into parts resumes exactly)."""
    torch.manual_seed(tc.seed)
    cfg = model or preset(tc.preset)
    params = init_params(cfg, device)
    opt = make_optimizer(params, tc)
    start = load_checkpoint(resume, tc, cfg, params, opt) if resume else 0
    data = TokenData(corpus.train, tc.seq_len)
    autocast = tc.bf16 and device.type == "cuda"
    t0, t_calib, rows, stopped = time.perf_counter(), 0.0, [], False
    step = start
    while step < tc.steps:
        if budget_minutes is not None and start == 0 and step == CALIBRATION.stop:
            _sync(device)
            tc = _calibrated(tc, budget_minutes, time.perf_counter() - t0, t_calib, log)
        if step == CALIBRATION.start:
            _sync(device)
            t_calib = time.perf_counter()
        over_time = max_minutes is not None and time.perf_counter() - t0 > 60 * max_minutes
        if over_time or (stop_at is not None and step >= stop_at):
            stopped = True
            break
        row = _step(tc, cfg, params, opt, data.batch(tc.seed, step, tc.batch).to(device),
                    step, autocast)  # fmt: skip
        if row is not None and (step % tc.log_every == 0 or step == tc.steps - 1):
            rows.append({"step": step, **{k: float(v) for k, v in row.items()}})
            log(_progress(rows[-1], time.perf_counter() - t0, step - start + 1))
        step += 1
        if checkpoint is not None and step % checkpoint_every == 0:
            save_checkpoint(checkpoint, tc, cfg, step, params, opt)
    done = step
    if checkpoint is not None:
        save_checkpoint(checkpoint, tc, cfg, done, params, opt)
    wall = time.perf_counter() - t0
    weights = rounded(cfg, params)
    train_eval = heldout_eval = None
    if evaluate_at_end:
        train_eval = evaluate(weights, TokenData(corpus.train, tc.seq_len, device)
                              .spread_chunks(tc.eval_bytes))  # fmt: skip
        heldout_eval = evaluate(weights, TokenData(corpus.heldout, tc.seq_len, device)
                                .chunks(tc.eval_bytes))  # fmt: skip
        log(f"train:    {train_eval.line()}")
        log(f"held out: {heldout_eval.line()}")
    return TrainResult(tc, weights, done, stopped, wall, train_eval, heldout_eval, tuple(rows))


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


def _step(tc, cfg, params, opt, tokens, step: int, autocast: bool) -> dict | None:
    """One optimiser step; the losses (as tensors) on the steps that are logged."""
    for group in opt.param_groups:
        group["lr"] = tc.lr_at(step)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = train_forward(from_state_dict(cfg, params), tokens)
        ls = losses(out, tokens, tc.mtp_weight, tc.aux_weight)
    opt.zero_grad(set_to_none=True)
    ls.total.backward()
    norm = torch.nn.utils.clip_grad_norm_(list(params.values()), tc.grad_clip)
    opt.step()
    if step % tc.log_every and step != tc.steps - 1:
        return None
    row = {"loss": ls.total, "bits_per_byte": ls.main / math.log(2), "grad_norm": norm,
           "lr": torch.tensor(tc.lr_at(step))}  # fmt: skip
    if ls.mtp is not None:
        row["mtp_bits_per_byte"] = ls.mtp / math.log(2)
    if ls.indexer_kl is not None:
        row["indexer_kl"] = ls.indexer_kl
    return {k: v.detach() for k, v in row.items()}


def _progress(row: dict[str, float], elapsed: float, steps: int) -> str:
    extra = "".join(f", {k} {row[k]:.3f}" for k in ("mtp_bits_per_byte", "indexer_kl") if k in row)
    return (f"step {int(row['step'])}: loss {row['loss']:.4f}, {row['bits_per_byte']:.3f} "
            f"bits/byte{extra}, grad {row['grad_norm']:.2f}, lr {row['lr']:.2e}, "
            f"{elapsed / steps:.3f} s/step")  # fmt: skip


def rounded(cfg: ModelConfig, params: dict[str, torch.Tensor], dtype=torch.bfloat16):
    """fp32 weights rounded through ``dtype`` (what a saved file holds), detached."""
    with torch.no_grad():
        return from_state_dict(cfg, {n: t.detach().to(dtype).float() for n, t in params.items()})
