"""The console script's argument parsing (`OneLineParser`, integer types) and its cache-only
``demo`` command (``shadowradix demo``: `adapters.cli.main`)."""

from __future__ import annotations

import argparse
import sys

from adapters.cli.demo import DemoTrace, main_demo
from adapters.cli.flag_checks import check_pools, shape_config
from shadowradix import CacheConfig
from shadowradix.config import SUPPORTED_PAGE_SIZES


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (``prog: error: ...``) and exit
    status 2, without the usage block (``--help`` still prints it)."""

    def error(self, message: str):  # type: ignore[override]
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1)


def non_negative(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0)


def bounded(low: int, high: int):
    """argparse type: an integer in ``[low, high]`` (a flag whose huge values would exhaust
    memory or spin for hours gets a one-line error instead)."""

    def parse(text: str) -> int:
        value = _int_at_least(text, low)
        if value > high:
            raise argparse.ArgumentTypeError(f"{value} is above {high}")
        return value

    return parse


def page_size(text: str) -> int:
    """argparse type: a page size the cache supports (a power of two, at most 256)."""
    value = _int_at_least(text, 1)
    if value not in SUPPORTED_PAGE_SIZES:
        raise argparse.ArgumentTypeError(
            f"{value} is not a power of two from {SUPPORTED_PAGE_SIZES[0]} to "
            f"{SUPPORTED_PAGE_SIZES[-1]}"
        )
    return value


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{value} is below {low}")
    return value


def add_demo_parser(sub) -> None:  # type: ignore[no-untyped-def]
    demo = sub.add_parser("demo", help="replay a built-in multi-turn chat trace through the cache")
    demo.add_argument("--page-size", type=page_size, default=64,
                      help="tokens per page: a power of two, at most 256 (default 64)")  # fmt: skip
    demo.add_argument("--full-tokens", type=positive, default=64 * 1024,
                      help="full pool capacity in tokens (default 65536)")  # fmt: skip
    demo.add_argument("--swa-tokens", type=positive, default=16 * 1024,
                      help="sliding-window pool capacity in tokens (default 16384)")  # fmt: skip
    demo.add_argument("--conversations", type=bounded(1, 100_000), default=48,
                      help="conversations in the trace (default 48)")  # fmt: skip
    demo.add_argument("--turns", type=bounded(1, 1_000), default=4,
                      help="turns per conversation (default 4)")  # fmt: skip
    demo.add_argument("--replay", action="store_true", help="enable bounded replay (approximate)")


def run_demo(args: argparse.Namespace) -> int:
    shape = shape_config(CacheConfig, args.page_size, CacheConfig.window)
    check_pools(shape, args.full_tokens, args.swa_tokens)
    config = CacheConfig(
        page_size=args.page_size,
        full_capacity=args.full_tokens,
        swa_capacity=args.swa_tokens,
        bounded_replay=args.replay,
    )
    trace = DemoTrace(conversations=args.conversations, turns=args.turns)
    print(
        f"shadowradix demo: {trace.conversations} conversations x {trace.turns} turns, page "
        f"{config.page_size}, full pool {config.full_capacity} tokens, SWA pool "
        f"{config.swa_capacity} tokens, window {config.window}",
        flush=True,
    )
    print(main_demo(config, trace))
    return 0
