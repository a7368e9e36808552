"""Cache-only ``demo`` command (the ``shadowradix`` console script lives in ``adapters.cli``)."""

from __future__ import annotations

import argparse

from .config import CacheConfig
from .demo import DemoTrace, main_demo


def add_demo_parser(sub) -> None:  # type: ignore[no-untyped-def]
    demo = sub.add_parser("demo", help="replay a built-in multi-turn chat trace through the cache")
    demo.add_argument("--page-size", type=int, default=64)
    demo.add_argument("--full-tokens", type=int, default=64 * 1024)
    demo.add_argument("--swa-tokens", type=int, default=16 * 1024)
    demo.add_argument("--conversations", type=int, default=48)
    demo.add_argument("--turns", type=int, default=4)
    demo.add_argument("--replay", action="store_true", help="enable bounded replay (approximate)")


def run_demo(args: argparse.Namespace) -> int:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shadowradix", description="ShadowRadix KV-cache manager")
    add_demo_parser(parser.add_subparsers(dest="command", required=True))
    return run_demo(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
