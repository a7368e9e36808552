"""``shadowradix`` console script: ``demo`` (cache only) and ``run`` (the embedded model)."""

from __future__ import annotations

import argparse
import sys

from shadowradix.cli import add_demo_parser, run_demo

DEFAULT_SYSTEM = (
    "You are a careful assistant for an inference engine team. Answer briefly, cite the "
    "component you rely on, and prefer measured numbers to guesses. The engine serves a hybrid "
    "sparse-attention model: sliding-window attention over the last 128 tokens, 4:1 compressed "
    "attention with a top-k indexer, and 128:1 dense compressed attention. "
)
DEFAULT_QUESTIONS = (
    "Why does prefix caching need a window checkpoint?",
    "What is a ring shadow?",
    "How are two-counter locks released?",
    "When is a node tombstoned?",
    "What does bounded replay trade away?",
    "Why must rings double under speculative decoding?",
    "How large is the C4 in-flight state?",
    "What does HiSparse keep on the GPU?",
)


def add_run_parser(sub) -> None:
    run = sub.add_parser("run", help="decode prompts end to end with the embedded model")
    run.add_argument("prompts", nargs="*", help="prompt texts (default: a built-in chat set)")
    run.add_argument("--file", help="read prompts from a file, one per line")
    run.add_argument(
        "--model",
        default="tiny",
        help="model preset: tiny | flash-shaped | tiny-shared | flash-shared",
    )
    run.add_argument("--layers", type=int, help="keep only the first N layers of the preset")
    run.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    run.add_argument("--max-new-tokens", type=int, default=48)
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--page-size", type=int, default=64)
    run.add_argument("--full-tokens", type=int, default=64 * 1024)
    run.add_argument("--swa-tokens", type=int, default=8 * 1024)
    run.add_argument("--chunk-tokens", type=int, default=256)
    run.add_argument("--max-running", type=int, default=32)
    run.add_argument(
        "--index-format",
        choices=("bf16", "fp8", "fp4"),
        default="bf16",
        help="cache format of the C4 indexer keys (fp8: e4m3 with a scale per row; fp4: V4.1 "
        "e2m1 with a scale per 32 channels, torch path only)",
    )
    run.add_argument(
        "--swa-format",
        choices=("bf16", "fp8"),
        default="bf16",
        help="cache format of the sliding-window KV (fp8: e4m3 with a scale per row)",
    )
    run.add_argument(
        "--memory-budget-gib",
        type=float,
        help="transient device memory per forward step beyond pools and weights (default: "
        "85%% of what is free on CUDA; prefill steps are sized to it)",
    )
    run.add_argument(
        "--hisparse-pages",
        type=int,
        help="keep C4 KV in host memory with this many device pages per C4 layer",
    )
    run.add_argument(
        "--tail-only",
        action="store_true",
        help="decoder-side tail-only prefill (a *-shared model; approximate, docs/sharing.md)",
    )
    run.add_argument(
        "--bounded-replay",
        action="store_true",
        help="serve hits whose window was evicted by recomputing it (approximate, flagged)",
    )
    run.add_argument(
        "--speculative",
        type=int,
        metavar="K",
        help="speculative decoding: the MTP layer drafts K tokens per step (greedy only)",
    )
    run.add_argument(
        "--arrival-steps",
        type=int,
        default=2,
        help="submit one prompt every N steps (0: all at once)",
    )
    run.add_argument("--quiet", action="store_true", help="no progress bar, no completions")


def _prompts(args) -> list[str]:
    texts = list(args.prompts)
    if args.file:
        with open(args.file, encoding="utf-8") as fh:
            texts += [line.rstrip("\n") for line in fh if line.strip()]
    return texts or [DEFAULT_SYSTEM + "Q: " + q + " A:" for q in DEFAULT_QUESTIONS]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shadowradix", description="ShadowRadix KV-cache manager")
    sub = parser.add_subparsers(dest="command", required=True)
    add_demo_parser(sub)
    add_run_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return run_demo(args)
    from .run_command import run_command  # torch is imported only for ``run``

    try:
        return run_command(args, _prompts(args))
    except (ValueError, OSError) as exc:
        print(f"shadowradix run: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
