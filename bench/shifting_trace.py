"""A trace that shifts from short to long requests, within one byte budget: the prompt hit ratio
of static SWA / full splits against run-time re-balancing (issue #14 item 5; CPU, core only).

The pools cost what `KVPools` would allocate for the flash-shaped model (page 64, BF16:
`adapters.memory.pool_budget.pool_costs`, measured on meta tensors), and ``--budget-mib`` of them is
split by SGLang's ``swa_full_tokens_ratio`` (`budget_cache_config`). The trace, deterministic:

* short phase: ``--conversations`` chats over one 512-token system prompt, ``--turns`` turns
  each (a 64-token user message, a 32-token answer), interleaved; turn t+1 resumes after turn
  t's whole context, a hit only while turn t's window is live SWA (many windows: SWA-hungry);
* long phase: ``--docs`` documents of ``--doc-tokens`` tokens, each asked ``--questions``
  questions in random order (a 128-token question, a 32-token answer): full-hungry.

A small scheduler drives `ShadowRadixCache` as the runner does (``--running`` requests at once,
prefill chunks of 8192 tokens cached after each chunk, one decode token per step, the youngest
request preempted when an extend cannot fit). Dynamic runs start from the first static split
(``--dynamic-from``) and use `adapters.memory.pool_balance.PoolBalance` (observed once a step,
planned on a capacity error or a failed admission check), the policy of `Runner.pool_balance`,
keeping at least two prefill chunks and their windows of SWA. Reports the prompt hit ratio of
each phase and overall, the capacities at the start and the end, the pools' bytes at the end,
rebalances and preemptions.

    python bench/shifting_trace.py --json bench/results/shifting_trace.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapters.memory.pool_balance import PoolBalance  # noqa: E402
from adapters.memory.pool_budget import budget_cache_config, pool_costs  # noqa: E402
from adapters.model.model_config import FLASH_SHAPED  # noqa: E402
from bench.meta import run_meta  # noqa: E402
from shadowradix import CapacityError, ConfigError, ShadowRadixCache  # noqa: E402

CHUNK = 8192


@dataclass
class Turn:
    prompt: np.ndarray
    out: int
    phase: str
    after: int | None = None  # the turn that must finish first (its context is this prompt's)


def trace(args: argparse.Namespace) -> list[Turn]:
    rng = np.random.default_rng(args.seed)
    system = rng.integers(0, 10**6, 512)
    turns: list[Turn] = []
    chats = [(system, None)] * args.conversations
    order = [c for c in range(args.conversations) for _ in range(args.turns)]
    rng.shuffle(order)
    for c in order:  # each chat's turns in order, chats interleaved
        context, prev = chats[c]
        prompt = np.concatenate((context, rng.integers(0, 10**6, 64)))
        turns.append(Turn(prompt, 32, "short", prev))
        answer = _answer(prompt, 32)
        chats[c] = (np.concatenate((prompt, answer)), len(turns) - 1)
    docs = [rng.integers(0, 10**6, args.doc_tokens) for _ in range(args.docs)]
    asks = [d for d in range(args.docs) for _ in range(args.questions)]
    rng.shuffle(asks)
    for d in asks:
        turns.append(Turn(np.concatenate((docs[d], rng.integers(0, 10**6, 128))), 32, "long"))
    return turns


def _answer(prompt: np.ndarray, n: int) -> np.ndarray:
    """The tokens a turn 'generates': fixed by its prompt (the next turn's context)."""
    return np.random.default_rng(int(prompt[-1]) + len(prompt)).integers(0, 10**6, n)


class Sim:
    """The runner's loop over the core alone."""

    def __init__(self, cache: ShadowRadixCache, balance: PoolBalance | None, running: int):
        self.cache, self.balance, self.max_running = cache, balance, running
        self.step = self.rebalances = self.preemptions = self.dropped = 0
        self.hits = {"short": [0, 0], "long": [0, 0]}
        self.done: set[int] = set()  # finished (or dropped) turns

    def run(self, turns: list[Turn]) -> None:
        waiting, running, done = deque(range(len(turns))), [], self.done
        while waiting or running:
            self.step += 1
            self._observe()
            for i in list(waiting):  # admission in arrival order, a turn after its predecessor
                if len(running) >= self.max_running:
                    break
                t = turns[i]
                if t.after is not None and t.after not in done:
                    continue
                if running and not self._fits(len(t.prompt) + t.out):
                    break  # admission control, as `Runner._fits`: room for the whole request
                waiting.remove(i)
                r = self.cache.admit(t.prompt)
                h = self.hits[t.phase]
                h[0], h[1] = h[0] + r.match.hit_len, h[1] + len(t.prompt)
                running.append([i, r, 0])
            for item in self._prefill_batch(running):
                self._extend(item, running, waiting, item[1].prompt_remaining[:CHUNK])
                if item[1].is_active:
                    self.cache.cache_unfinished(item[1])
            for item in [x for x in running if not len(x[1].prompt_remaining)]:
                i, r, emitted = item
                if emitted == turns[i].out:
                    self.cache.finish(r)
                    running.remove(item)
                    done.add(i)
                    continue
                token = int(_answer(turns[i].prompt, turns[i].out)[emitted])
                if self._extend(item, running, waiting, [token]):
                    item[2] += 1

    def _fits(self, num_tokens: int) -> bool:
        st, p = self.cache.stats(), self.cache.config.page_size
        full_room = st.full.free_pages + st.full.evictable_pages
        swa_room = st.swa.free_pages + st.swa.evictable_pages
        window = -(-(self.cache.config.window + min(CHUNK, num_tokens)) // p) + 1
        if -(-num_tokens // p) <= full_room and window <= swa_room:
            return True
        return self._rebalance_for(-(-num_tokens // p) - full_room, window - swa_room)

    def _rebalance_for(self, full_short: int, swa_short: int) -> bool:
        if full_short > 0 and swa_short > 0:
            return False
        pool, short = ("full", full_short) if full_short > 0 else ("swa", swa_short)
        return self._rebalance(pool, short) and self._fits_now(pool, short)

    def _fits_now(self, pool: str, short: int) -> bool:
        return True  # the plan grew the pool by at least the shortfall

    def _prefill_batch(self, running: list) -> list:
        """The prefilling requests this step: the first with prompt left (one chunk a step)."""
        return [x for x in running if len(x[1].prompt_remaining)][:1]

    def _extend(self, item: list, running: list, waiting: deque, tokens) -> bool:
        while item[1].is_active:
            try:
                self.cache.extend(item[1], tokens)
                return True
            except CapacityError as err:
                if self._rebalance(err.pool, err.needed_pages - err.available_pages):
                    continue
                others = [x for x in running if x is not item]
                if not others:
                    if self._rebalance(err.pool, err.needed_pages - err.available_pages, True):
                        continue
                    self.cache.abort(item[1])  # it can never fit this split: dropped
                    running.remove(item)
                    self.done.add(item[0])
                    self.dropped += 1
                    return False
                victim = others[-1]
                self.cache.abort(victim[1])
                running.remove(victim)
                waiting.appendleft(victim[0])
                self.preemptions += 1
        return False

    def _observe(self) -> None:
        if self.balance is None:
            return
        seen = self.balance.observe(self.cache.stats(), self.cache.eviction_ages(), self.step)
        if seen is not None:
            self._apply(seen[0], seen[1])

    def _rebalance(self, pool: str, short: int, force: bool = False) -> bool:
        if self.balance is None:
            return False
        plan = self.balance.plan(self.cache.stats(), pool, short, self.step, force)
        return plan is not None and self._apply(pool, plan)

    def _apply(self, pool: str, plan: tuple[int, int]) -> bool:
        try:
            self.cache.rebalance(full_capacity=plan[0], swa_capacity=plan[1])
        except (CapacityError, ConfigError):
            return False
        assert self.balance is not None
        self.balance.applied(self.step, pool)
        self.rebalances += 1
        return True


def one(args, turns, ratio: float, dynamic: bool) -> dict[str, object]:
    budget = args.budget_mib * 2**20
    cfg = budget_cache_config(FLASH_SHAPED, budget, ratio, torch.bfloat16, page_size=64)
    costs = pool_costs(FLASH_SHAPED, cfg, torch.bfloat16)
    cache = ShadowRadixCache(cfg)
    p = cfg.page_size
    balance = (
        PoolBalance(
            costs,
            budget,
            min_full_pages=cfg.window_pages + 1,
            min_swa_pages=2 * -(-(CHUNK + cfg.window + 2 * p) // p),
        )  # fmt: skip
        if dynamic
        else None
    )
    sim = Sim(cache, balance, args.running)
    t0 = time.perf_counter()
    sim.run(turns)
    st = cache.stats()
    ratio_of = {k: v[0] / v[1] for k, v in sim.hits.items()}
    cache.check_invariants()
    return dict(
        split="dynamic" if dynamic else "static",
        swa_full_tokens_ratio=ratio,
        start_capacity_tokens=dict(full=cfg.full_capacity, swa=cfg.swa_capacity),
        end_capacity_tokens=dict(full=st.full.capacity_pages * p, swa=st.swa.capacity_pages * p),
        pool_bytes_end=costs.nbytes(st.full.capacity_pages, st.swa.capacity_pages),
        hit_ratio=st.hit_ratio,
        hit_ratio_short=ratio_of["short"],
        hit_ratio_long=ratio_of["long"],
        rebalances=sim.rebalances,
        preemptions=sim.preemptions,
        dropped=sim.dropped,
        steps=sim.step,
        wall_s=round(time.perf_counter() - t0, 2),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget-mib", type=int, default=320)
    ap.add_argument(
        "--ratios",
        default="0.1,0.04,0.06,0.08,0.15,0.25,0.5",
        help="static swa_full_tokens_ratio splits (SGLang's DeepSeek-V4 0.1 first)",
    )
    ap.add_argument(
        "--dynamic-from", default="0.1,0.5", help="the static splits dynamic runs start from"
    )
    ap.add_argument("--conversations", type=int, default=300)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-tokens", type=int, default=24576)
    ap.add_argument("--questions", type=int, default=12)
    ap.add_argument("--running", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    meta = run_meta()
    turns = trace(args)
    ratios = [float(x) for x in args.ratios.split(",")]
    rows = [one(args, turns, r, False) for r in ratios]
    rows += [one(args, turns, float(r), True) for r in args.dynamic_from.split(",")]
    for row in rows:
        print(json.dumps(row))
    best = max(rows, key=lambda r: r["hit_ratio"] if r["split"] == "static" else -1)
    for row in rows:
        if row["split"] == "dynamic":
            rel = (row["hit_ratio"] - best["hit_ratio"]) / best["hit_ratio"]
            print(
                f"dynamic from {row['swa_full_tokens_ratio']}: {row['hit_ratio']:.4f}, "
                f"{rel:+.2%} against the best static split "
                f"({best['swa_full_tokens_ratio']}: {best['hit_ratio']:.4f})"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
