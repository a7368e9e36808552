"""The built-in demo: replay a multi-turn chat trace through the cache and print what it reused.

Each conversation's turn ``t`` sends the whole history (system prompt, earlier turns and the
model's earlier replies) plus a new user message, so turn ``t`` can reuse turn ``t - 1``'s
cached prefix. Conversations share one of a few system prompts. Until the model runner exists,
"decoding" appends deterministic pseudo-random tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from shadowradix import CacheConfig, CapacityError, Request, ShadowRadixCache


@dataclass(frozen=True)
class DemoTrace:
    conversations: int = 48
    turns: int = 4
    system_prompts: int = 3
    system_len: int = 1024
    user_len: int = 96
    reply_len: int = 64
    batch: int = 16
    seed: int = 0


@dataclass(frozen=True)
class TurnRow:
    turn: int
    requests: int
    prompt_tokens: int
    hit_tokens: int
    replayed_tokens: int
    full_used: float
    swa_used: float
    evicted_pages: int


def run_demo(config: CacheConfig, trace: DemoTrace) -> list[TurnRow]:
    """Serve every conversation turn by turn; returns one row of statistics per turn."""
    rng = np.random.default_rng(trace.seed)
    systems = rng.integers(0, 32000, (trace.system_prompts, trace.system_len))
    histories = [systems[i % trace.system_prompts].tolist() for i in range(trace.conversations)]
    cache = ShadowRadixCache(config)
    rows = []
    for turn in range(trace.turns):
        before = cache.stats()
        for h in histories:
            h.extend(rng.integers(0, 32000, trace.user_len).tolist())
        _serve_turn(cache, histories, trace, rng)
        after = cache.stats()
        rows.append(
            TurnRow(
                turn=turn + 1,
                requests=len(histories),
                prompt_tokens=after.prompt_tokens - before.prompt_tokens,
                hit_tokens=after.hit_tokens - before.hit_tokens,
                replayed_tokens=after.replayed_tokens - before.replayed_tokens,
                full_used=after.full.used_fraction,
                swa_used=after.swa.used_fraction,
                evicted_pages=(after.evicted.full_pages + after.evicted.swa_pages)
                - (before.evicted.full_pages + before.evicted.swa_pages),
            )
        )
        cache.check_invariants()
    return rows


def _serve_turn(
    cache: ShadowRadixCache, histories: list[list[int]], trace: DemoTrace, rng: np.random.Generator
) -> None:
    pending = list(range(len(histories)))
    while pending:
        batch: list[tuple[int, Request]] = []
        refused: CapacityError | None = None
        while pending and len(batch) < trace.batch:
            i = pending[0]
            prompt = np.asarray(histories[i])
            try:
                request = cache.admit(prompt, cache.match_prefix(prompt[:-1]))
            except CapacityError as exc:
                refused = exc
                break
            try:
                cache.extend(request, request.prompt_remaining)
            except CapacityError as exc:
                cache.abort(request)
                refused = exc
                break
            cache.cache_unfinished(request)
            batch.append((pending.pop(0), request))
        if not batch:  # not even one conversation fits: the pool that refused it
            if refused is None:
                raise ValueError("a demo batch holds at least one conversation")
            raise refused
        for _ in range(trace.reply_len):
            tokens = rng.integers(0, 32000, (len(batch), 1))
            cache.extend_batch([r for _, r in batch], tokens)
        for i, request in batch:
            histories[i] = request.tokens
            cache.finish(request)


def format_rows(rows: list[TurnRow], seconds: float) -> str:
    header = (
        f"{'turn':>4} {'requests':>8} {'prompt tok':>10} {'hit ratio':>9} {'replayed':>8} "
        f"{'full pool':>9} {'swa pool':>8} {'evicted pg':>10}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        ratio = r.hit_tokens / r.prompt_tokens if r.prompt_tokens else 0.0
        lines.append(
            f"{r.turn:>4} {r.requests:>8} {r.prompt_tokens:>10} {ratio:>9.3f} "
            f"{r.replayed_tokens:>8} "
            f"{100 * r.full_used:>8.0f}% {100 * r.swa_used:>7.0f}% {r.evicted_pages:>10}"
        )
    total = sum(r.prompt_tokens for r in rows)
    hits = sum(r.hit_tokens for r in rows)
    lines.append(
        f"overall hit ratio {hits / total:.3f} over {total} prompt tokens in {seconds:.2f}s"
    )
    return "\n".join(lines)


def main_demo(config: CacheConfig | None = None, trace: DemoTrace | None = None) -> str:
    config = config or CacheConfig(page_size=64, full_capacity=64 * 1024, swa_capacity=16 * 1024)
    trace = trace or DemoTrace()
    start = time.perf_counter()
    rows = run_demo(config, trace)
    return format_rows(rows, time.perf_counter() - start)
