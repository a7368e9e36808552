"""``python -m adapters.train``: trains a preset (default ``tiny-trained``; any preset the model
supports, V4.1 sharing included: ``tiny-shared-trained``) and its MTP layer on the KJV corpus
and writes its weights (docs/training.md). ``--eagle`` trains an EAGLE draft head for the
preset's shipped (frozen) weights instead, or for ``--target FILE``.

``--device cpu`` is a smoke run (the committed fixture excerpt unless ``--corpus``, a few
steps); ``--device cuda`` the real run on the full corpus (``python -m
adapters.training.corpus fetch`` first). ``--ship`` writes the package's file
(``adapters/model/trained/``) and prints the SHA-256 line to record in
`adapters.model.weights_file.SHIPPED` (``SHIPPED_EAGLE`` for a head).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from adapters.memory.device import resolve_device
from adapters.model.eagle import save_eagle
from adapters.model.model_config import plain_fields, preset
from adapters.model.weights import ModelWeights
from adapters.model.weights_file import (
    SHIPPED,
    SHIPPED_EAGLE,
    WeightsError,
    load_shipped,
    load_weights,
    save_weights,
)
from adapters.training.corpus import DEFAULT_DIR, FIXTURE_DIR, CorpusError, load_split

from .training.eagle import train_eagle
from .training.loop import TrainConfig, TrainResult, train

#: the smoke run (CPU) and the real run (one H200: about 8 minutes, docs/training.md)
PROFILES: dict[str, dict[str, Any]] = {
    "cpu": dict(steps=8, batch=2, seq_len=256, warmup=2, log_every=2, eval_bytes=2 * 1024),
    "cuda": dict(steps=3000, batch=16, seq_len=2048, warmup=200, log_every=100),
    # an EAGLE head: a small layer over a frozen target (about 4x cheaper a step than the model)
    "cuda-eagle": dict(steps=3000, batch=16, seq_len=2048, warmup=100, log_every=100, lr=1e-3),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m adapters.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | auto (default)")
    p.add_argument("--preset", default="tiny-trained", help="model preset (default tiny-trained)")
    p.add_argument("--corpus", type=Path, help="split folder (default: data/kjv on CUDA, the "
                   "committed fixture data/kjv_fixture on the CPU)")  # fmt: skip
    for name in ("steps", "batch", "seq-len", "warmup", "log-every", "seed", "eval-bytes"):
        p.add_argument(f"--{name}", type=int)
    for name in ("lr", "mtp-weight", "aux-weight", "weight-decay", "eagle-reg-weight"):
        p.add_argument(f"--{name}", type=float)
    p.add_argument("--eagle", action="store_true", help="train an EAGLE draft head for the "
                   "preset's shipped weights (frozen) instead of the model")  # fmt: skip
    p.add_argument("--eagle-depth", type=int, help="chained draft steps trained (default 3)")
    p.add_argument("--target", type=Path, help="--eagle: the target's weights file (default: "
                   "the preset's shipped file)")  # fmt: skip
    p.add_argument("--fp32", action="store_true", help="no bf16 autocast on CUDA")
    p.add_argument("--out", type=Path, help="weights file (default train_out/<preset>.safetensors)")
    p.add_argument(
        "--ship", action="store_true", help="write the package's file (adapters/model/trained)"
    )
    p.add_argument("--log", type=Path, help="JSON record of the run (default: next to --out)")
    p.add_argument("--checkpoint", type=Path, help="resumable checkpoint (.pt), every 500 steps")
    p.add_argument("--resume", type=Path, help="continue the run of this checkpoint")
    p.add_argument("--budget-minutes", type=float, help="set --steps from the measured speed "
                   "so that the run (with its evaluation) takes about this long")  # fmt: skip
    p.add_argument("--max-minutes", type=float, help="stop early (checkpointed) after this long")
    p.add_argument("--stop-at", type=int, help="stop (checkpointed) after this many steps")
    return p


def train_config(args: argparse.Namespace, device: torch.device) -> TrainConfig:
    profile = "cpu" if device.type != "cuda" else "cuda-eagle" if args.eagle else "cuda"
    fields = dict(PROFILES[profile], preset=args.preset)
    for f in dataclasses.fields(TrainConfig):
        value = getattr(args, f.name, None)
        if value is not None and f.name != "preset":
            fields[f.name] = value
    return TrainConfig(**fields, bf16=not args.fp32)  # type: ignore[arg-type]


def _target(args: argparse.Namespace, device: torch.device) -> ModelWeights:
    """The frozen target of an EAGLE run (fp32 on ``device``). Raises `WeightsError`."""
    cfg = preset(args.preset)
    if args.target is not None:
        return load_weights(args.target, cfg, device)
    return load_shipped(cfg, device)


def _meta() -> dict[str, object]:
    try:
        from bench.meta import run_meta  # the repository's bench helpers, when run from its root

        return run_meta()
    except ImportError:
        return dict(command=" ".join(sys.argv), date=time.strftime("%Y-%m-%d %H:%M:%S %Z"))


def _evaluation(e: object) -> dict[str, object] | None:
    if e is None:
        return None
    record = dataclasses.asdict(e)  # type: ignore[call-overload]
    if hasattr(e, "acceptance_estimate"):  # an EAGLE head's
        record["acceptance_estimate"] = e.acceptance_estimate
    return record  # type: ignore[no-any-return]


def _record(path: Path, result: TrainResult, out: Path, sha: str) -> None:
    record = dict(
        meta=_meta(), train_config=dataclasses.asdict(result.config),
        model_config=plain_fields(result.weights.config), weights=str(out), sha256=sha,
        steps_done=result.steps_done, stopped_early=result.stopped_early, wall_s=result.wall_s,
        train=_evaluation(result.train), heldout=_evaluation(result.heldout), log=list(result.log),
    )  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    device = resolve_device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    tc = train_config(args, device)
    corpus_dir = args.corpus or (DEFAULT_DIR if device.type == "cuda" else FIXTURE_DIR)
    try:
        corpus = load_split(corpus_dir, verify=corpus_dir.resolve() == DEFAULT_DIR)
    except CorpusError as exc:
        print(f"train: error: {exc}", file=sys.stderr)
        return 2
    registry, kind = (SHIPPED_EAGLE, "EAGLE head") if tc.eagle else (SHIPPED, "file")
    if args.ship and tc.preset not in registry:
        print(f"train: error: preset {tc.preset!r} has no shipped {kind}", file=sys.stderr)
        return 2
    try:
        target = _target(args, device) if tc.eagle else None
    except (WeightsError, OSError) as exc:
        print(f"train: error: {exc}", file=sys.stderr)
        return 2
    suffix = "-eagle" if tc.eagle else ""
    out = registry[tc.preset].path if args.ship else args.out
    out = out or Path("train_out") / f"{tc.preset}{suffix}.safetensors"
    print(f"train: {tc} on {device}, corpus {corpus_dir} ({len(corpus.train)} train / "
          f"{len(corpus.heldout)} held-out bytes)", flush=True)  # fmt: skip
    budget = dict(checkpoint=args.checkpoint, resume=args.resume, max_minutes=args.max_minutes,
                  budget_minutes=args.budget_minutes, stop_at=args.stop_at)  # fmt: skip
    logger = lambda s: print(s, flush=True)  # noqa: E731
    if target is not None:
        result = train_eagle(tc, corpus, device, target, log=logger, **budget)
        sha = save_eagle(result.weights, target, out)
    else:
        result = train(tc, corpus, device, log=logger, **budget)
        sha = save_weights(result.weights, out)
    _record(args.log or out.with_suffix(".json"), result, out, sha)
    early = " (stopped early: continue it with --resume)" if result.stopped_early else ""
    print(f"train: {result.steps_done} steps in {result.wall_s:.0f} s{early}; weights {out} "
          f"({out.stat().st_size} bytes), SHA-256 {sha}")  # fmt: skip
    if args.ship:
        name = "SHIPPED_EAGLE" if tc.eagle else "SHIPPED"
        print(f"record it in adapters/model/weights_file.py: {name}[{tc.preset!r}] = "
              f"ShippedWeights({out.name!r}, {sha!r})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
