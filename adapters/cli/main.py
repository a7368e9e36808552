"""``shadowradix`` console script: ``demo`` (cache only) and ``run`` (the embedded model)."""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import math
import sys

from adapters.cli.cli_args import (
    OneLineParser,
    add_demo_parser,
    bounded,
    page_size,
    positive,
    run_demo,
)
from adapters.cli.flag_checks import in_flag_terms
from adapters.model.model_config import PRESETS
from shadowradix.errors import ShadowRadixError

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


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"{text} must be a number >= 0")
    if math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text} must be finite")
    return value


def _positive_float(text: str) -> float:
    value = _non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0")
    return value


def add_run_parser(sub) -> None:
    run = sub.add_parser("run", help="decode prompts end to end with the embedded model")
    run.add_argument("prompts", nargs="*", help="prompt texts (default: a built-in chat set)")
    run.add_argument("--file", metavar="PATH",
                     help="read prompts from a file, one per non-empty line ('-': standard "
                     "input)")  # fmt: skip
    run.add_argument(
        "--model",
        choices=sorted(PRESETS),
        metavar="PRESET",
        help=f"model preset: {' | '.join(sorted(PRESETS))} (default tiny-trained where its "
        "trained weights are shipped, else tiny)",
    )
    run.add_argument("--weights", metavar="PATH",
                     help="trained weights (safetensors, `python -m adapters.train`); the "
                     "tiny-trained preset loads its shipped file by default")  # fmt: skip
    run.add_argument("--layers", type=positive,
                     help="keep only the first N layers of the preset")  # fmt: skip
    run.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    run.add_argument("--max-new-tokens", type=positive, default=48,
                     help="tokens to generate per prompt (default 48)")  # fmt: skip
    run.add_argument("--temperature", type=_non_negative_float, default=0.0,
                     help="sampling temperature; 0 is greedy (default)")  # fmt: skip
    run.add_argument("--seed", type=bounded(0, 2**62 - 1), default=0,
                     help="sampling seed: prompt i samples with seed + i (default 0)")  # fmt: skip
    run.add_argument("--page-size", type=page_size, default=64,
                     help="tokens per cache page: a power of two, at most 256 (default 64)")
    run.add_argument("--full-tokens", type=positive,
                     help="full (compressed) pool capacity in tokens (default 65536)")  # fmt: skip
    run.add_argument("--swa-tokens", type=positive,
                     help="sliding-window pool capacity in tokens (default 8192)")  # fmt: skip
    run.add_argument("--pool-budget-gib", type=_positive_float, metavar="GIB",
                     help="size both KV pools from this many GiB instead of --full-tokens / "
                     "--swa-tokens, and move memory between them at run time when one starves "
                     "(not with --hisparse-pages)")  # fmt: skip
    run.add_argument("--swa-full-ratio", type=_positive_float, metavar="R",
                     help="with --pool-budget-gib: SWA tokens per full token to start with "
                     "(default 0.125, the default pools' ratio)")  # fmt: skip
    run.add_argument("--chunk-tokens", type=positive, default=256,
                     help="most prompt tokens a prefill step computes (default 256)")  # fmt: skip
    run.add_argument("--max-running", type=positive, default=32,
                     help="most requests decoding together (default 32)")  # fmt: skip
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
        type=_positive_float,
        help="transient device memory per forward step beyond pools and weights (default: "
        "85%% of what is free on CUDA; prefill steps are sized to it)",
    )
    run.add_argument(
        "--hisparse-pages",
        type=positive,
        help="keep C4 KV in host memory with this many device pages per C4 layer (at least the "
        "model's top-k pages plus one, e.g. 33 for tiny-trained; with --speculative K run "
        "paged, (K + 1) x top-k plus the pages K + 1 tokens span, 2 at page 64; prefill with a "
        "buffer much smaller than a prompt's C4 pages swaps at every chunk and runs far slower)",
    )
    run.add_argument(
        "--graph-decode",
        choices=("auto", "on", "off"),
        default="auto",
        help="the graph decoder (CUDA graphs on a GPU; its code eagerly on the CPU) for decode "
        "and verify steps: auto (default) uses it on CUDA without --hisparse-pages; on also "
        "with HiSparse (C4 pages missing from the buffer are read from the host mirror); off: "
        "the paged path",
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
        type=positive,
        metavar="K",
        help="speculative decoding: the MTP layer drafts K tokens per step (rejection sampling "
        "at --temperature > 0; K + 1 at most the cache's max_draft_len: K <= 8 for tiny-trained)",
    )
    run.add_argument(
        "--draft",
        choices=("mtp", "eagle"),
        help="with --speculative: the draft source, the model's MTP layer (default) or the "
        "preset's shipped EAGLE head (tiny-trained)",
    )
    run.add_argument(
        "--schedule",
        choices=("lpm", "fcfs"),
        default="lpm",
        help="admission order of waiting prompts: lpm, the longest cached prefix first "
        "(default), or fcfs, arrival order",
    )
    run.add_argument(
        "--arrival-steps",
        type=bounded(0, 10_000),
        default=2,
        help="submit one prompt every N steps (0: all at once; default 2)",
    )
    run.add_argument("--quiet", action="store_true", help="no progress bar, no completions")


def _prompts(args) -> list[str]:
    """The prompts to run: the arguments, then the non-empty lines of ``--file`` (``-``:
    standard input); the built-in set only when neither was given. Raises `ValueError` for a
    file without a prompt or not UTF-8, `OSError` (naming ``--file``) for one that cannot be
    read."""
    texts = list(args.prompts)
    if args.file is not None and not args.file.strip():
        raise ValueError("--file: an empty path")
    if any(not text for text in texts):
        raise ValueError("an empty prompt: give it some text (BOS alone predicts nothing)")
    if args.file:
        name = "standard input (--file -)" if args.file == "-" else args.file
        try:
            lines = [line.rstrip("\n") for line in _prompt_lines(args.file) if line.strip()]
        except UnicodeDecodeError as exc:
            raise ValueError(f"{name}: not UTF-8 text ({exc.reason})") from None
        except OSError as exc:
            raise OSError(f"--file {args.file}: {exc.strerror or exc}") from None
        if not lines:
            raise ValueError(f"{name}: no prompts (every line is empty)")
        texts += lines
    return texts or [DEFAULT_SYSTEM + "Q: " + q + " A:" for q in DEFAULT_QUESTIONS]


def _prompt_lines(path: str) -> list[str]:
    """The lines of ``path`` (``-``: standard input, read as UTF-8 whatever its encoding),
    newlines translated as text files read them."""
    if path != "-":
        with open(path, encoding="utf-8") as fh:
            return list(fh)
    stream = getattr(sys.stdin, "buffer", None)
    text = sys.stdin.read() if stream is None else stream.read().decode("utf-8")
    return list(io.StringIO(text, newline=None))


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done, 1 some prompt refused or failed, 2 bad arguments or a one-line error (no
    traceback), 130 interrupted (Ctrl-C)."""
    parser = OneLineParser(prog="shadowradix", description="ShadowRadix KV-cache manager")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_demo_parser(sub)
    add_run_parser(sub)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a bad argument (already reported)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        if args.command == "demo":
            return run_demo(args)
        from adapters.cli.run_command import run_command  # torch is imported only for ``run``

        return run_command(args, _prompts(args))
    except KeyboardInterrupt:
        print(f"shadowradix {args.command}: interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        print(f"shadowradix {args.command}: error: out of host memory (lower --full-tokens / "
              "--swa-tokens)", file=sys.stderr)  # fmt: skip
        return 2
    except (ValueError, OSError, ShadowRadixError) as exc:
        print(f"shadowradix {args.command}: error: {in_flag_terms(str(exc))}", file=sys.stderr)
        return 2


def _version() -> str:
    try:
        return importlib.metadata.version("shadowradix")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a source tree
        return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
