"""Host cost of the HiSparse coordinator: `plan_step` + `complete` per C4 layer-step.

Each scenario serves ``--batch`` decode requests whose C4 KV spans ``--pages`` host pages each
(64K-token contexts at 16 entries per page are ~4K pages), all prefilled to the host mirror
first. Every step reads the top-``--topk`` entries of each request (an int64 array of host
pages, shape ``(batch, topk)``) and writes one new entry per request into its tail page (fresh
every ``entries_per_page`` steps); the previous step's two tickets are completed before the
next step is planned, as an adapter polling its copy events would. Reported: median and p90 µs
per layer-step over ``--steps`` steps (after warm-up; the best of ``--repeat`` runs, as the
machine is shared), read hit ratio, pages swapped in and evicted per step.

Scenarios: ``steady`` (top-k drifts: ``--churn`` of each request's entries are replaced per
step, the rest re-read), ``all-hit`` (top-k fixed), ``random`` (each step a new uniform top-k:
no temporal reuse), ``cold`` (a streaming scan: every page read is one not read for a long
time, 0% hits, the worst case).

    python bench/hisparse_plan.py                  # the table in docs/hisparse.md
    python bench/hisparse_plan.py --batch 1 --steps 2000
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hisparse import Coordinator, HiSparseConfig, StepPlan  # noqa: E402

Reads = Callable[[int], np.ndarray]


class Workload:
    """Host-page layout: request ``r`` owns context pages ``[r*P, (r+1)*P)`` and decode tail
    pages after all contexts."""

    def __init__(self, args: argparse.Namespace, rng: np.random.Generator) -> None:
        self.args, self.rng = args, rng
        self.epp = args.entries_per_page
        tail_pages = (args.warmup + args.steps) // self.epp + 2
        self.tail_base = args.batch * args.pages
        self.config = HiSparseConfig(
            num_layers=1,
            device_slots=args.device_slots,
            max_host_pages=self.tail_base + args.batch * tail_pages,
            entries_per_page=self.epp,
        )
        self.tail_pages = tail_pages
        self.base = (np.arange(args.batch, dtype=np.int64) * args.pages)[:, None]
        self.topk = self._entries()

    def _entries(self) -> np.ndarray:
        a = self.args
        return self.rng.integers(0, a.pages * self.epp, (a.batch, a.topk), dtype=np.int64)

    def reads(self, scenario: str, step: int) -> np.ndarray:
        a = self.args
        if scenario == "steady":
            swap = self.rng.random(self.topk.shape) < a.churn
            self.topk[swap] = self.rng.integers(0, a.pages * self.epp, int(swap.sum()))
        elif scenario == "random":
            self.topk = self._entries()
        elif scenario == "cold":
            window = (step * a.topk + np.arange(a.topk, dtype=np.int64)) % a.pages
            return self.base + window[None, :]
        return self.base + self.topk // self.epp

    def writes(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        a = self.args
        tail = self.tail_base + np.arange(a.batch, dtype=np.int64) * self.tail_pages
        pages = tail + step // self.epp
        return pages, np.full(a.batch, step % self.epp == 0)


def prefill(coord: Coordinator, work: Workload) -> None:
    """Write every context page once (fresh), in chunks, completing as we go."""
    total = work.tail_base
    chunk = max(1, coord.config.device_slots // 2)
    for start in range(0, total, chunk):
        pages = np.arange(start, min(total, start + chunk), dtype=np.int64)
        plan = coord.plan_step(0, pages[:0], pages, np.ones(len(pages), bool))
        coord.complete(plan.swap_in.ticket)
        coord.complete(plan.backup.ticket)


def run(scenario: str, args: argparse.Namespace) -> dict[str, float]:
    work = Workload(args, np.random.default_rng(args.seed))
    coord = Coordinator(work.config)
    prefill(coord, work)
    times: list[int] = []
    last: StepPlan | None = None
    swaps = evictions = 0
    for step in range(args.warmup + args.steps):
        reads = work.reads(scenario, step)
        writes, fresh = work.writes(step)
        t0 = time.perf_counter_ns()
        if last is not None:
            coord.complete(last.swap_in.ticket)
            coord.complete(last.backup.ticket)
        last = coord.plan_step(0, reads, writes, fresh)
        t1 = time.perf_counter_ns()
        if step == args.warmup:
            before = coord.stats(0)
        if step >= args.warmup:
            times.append(t1 - t0)
            swaps += len(last.swap_in)
            evictions += len(last.evicted_pages)
    after = coord.stats(0)
    us = np.asarray(times) / 1e3
    return {
        "median_us": float(np.median(us)),
        "p90_us": float(np.percentile(us, 90)),
        "hit_ratio": (after.read_hits - before.read_hits) / (after.reads - before.reads),
        "swap_ins": swaps / args.steps,
        "evictions": evictions / args.steps,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--topk", type=int, default=512)
    ap.add_argument("--pages", type=int, default=4096, help="host pages per request")
    ap.add_argument("--entries-per-page", type=int, default=16)
    ap.add_argument("--device-slots", type=int, default=24576)
    ap.add_argument("--churn", type=float, default=0.02)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3, help="runs per scenario; the best is shown")
    ap.add_argument("--scenarios", default="all-hit,steady,random,cold")
    args = ap.parse_args()
    print(
        f"batch {args.batch} x top-k {args.topk}, {args.pages} host pages/request, "
        f"{args.device_slots} device slots, churn {args.churn:.0%}, {args.steps} steps"
    )
    print(
        f"{'scenario':<10}{'median µs':>11}{'p90 µs':>9}{'hits':>8}{'swap-in/step':>14}"
        f"{'evict/step':>12}"
    )
    for scenario in args.scenarios.split(","):
        r = min((run(scenario, args) for _ in range(args.repeat)), key=lambda x: x["median_us"])
        print(
            f"{scenario:<10}{r['median_us']:>11.1f}{r['p90_us']:>9.1f}{r['hit_ratio']:>8.1%}"
            f"{r['swap_ins']:>14.1f}{r['evictions']:>12.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
