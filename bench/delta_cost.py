"""What the core's page-table deltas and read-only result arrays cost per request (CPU), side
by side in one run: arms interleaved, median of ``--reps``.

The workload is bench/prefix_hit.py's shape (a cached ``--prefix``, each request a distinct
``--suffix``, ``--decode`` steps, ``cache_unfinished`` after its prefill, ``finish``), small
enough that the per-call constants show. Arms: ``as is``; ``no deltas``
(`TableEdits.changes` returns an empty `TableChanges`: what the calls cost before they
reported deltas); ``writable`` (result arrays left writable). The deltas of extend steps are
lazy already (`StepPlan.deltas`).

    python bench/delta_cost.py --json bench/results/delta_cost_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.meta import run_meta  # noqa: E402
from shadowradix import CacheConfig, ShadowRadixCache, results, table_edits  # noqa: E402
from shadowradix.config import V4_FLASH_RATIOS  # noqa: E402
from shadowradix.deltas import TableChanges  # noqa: E402


@contextmanager
def arm(name: str):
    saved = table_edits.TableEdits.changes, results._read_only
    if name == "no deltas":
        empty = lambda self: TableChanges(self.request.id)  # noqa: E731
        table_edits.TableEdits.changes = empty  # type: ignore[method-assign]
    elif name == "writable":
        results._read_only = lambda arrays: None  # type: ignore[assignment]
    try:
        yield
    finally:
        table_edits.TableEdits.changes, results._read_only = saved


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--page", type=int, default=1)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--decode", type=int, default=4)
    ap.add_argument("--reqs", type=int, default=500)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    meta = run_meta()
    cfg = CacheConfig(page_size=args.page, window=128, compress_ratios=V4_FLASH_RATIOS,
                      overlap_ratios=(4,), full_capacity=400_000 // args.page * args.page,
                      swa_capacity=40_000 // args.page * args.page)  # fmt: skip
    cache = ShadowRadixCache(cfg)
    prefix = np.arange(args.prefix, dtype=np.int64)
    r = cache.admit(prefix)
    cache.extend(r, r.prompt_remaining)
    cache.finish(r)
    counter = iter(range(10**9))

    def one() -> None:
        i = next(counter)
        start = 10**7 + (args.suffix + 16) * i
        suffix = np.arange(start, start + args.suffix, dtype=np.int64)
        req = cache.admit(np.concatenate((prefix, suffix)))
        plan = cache.extend(req, req.prompt_remaining)
        plan.reads  # noqa: B018 - an engine reads them
        cache.cache_unfinished(req)
        for _ in range(args.decode):
            cache.extend_batch([req], [[7]]).reads  # noqa: B018
        cache.finish(req)

    arms = ("as is", "no deltas", "writable")
    times: dict[str, list[float]] = {a: [] for a in arms}
    for _ in range(3):
        one()
    for _ in range(args.reps):
        for a in arms:
            with arm(a):
                t0 = time.perf_counter()
                for _ in range(args.reqs):
                    one()
                times[a].append((time.perf_counter() - t0) / args.reqs * 1e6)
    cache.check_invariants()
    rows = [dict(arm=a, us_per_request=statistics.median(t), reps_us=t) for a, t in times.items()]
    out = dict(meta=meta, prefix=args.prefix, page=args.page, suffix=args.suffix,
               decode=args.decode, reqs=args.reqs, rows=rows)  # fmt: skip
    for row in rows:
        lo, hi = min(row["reps_us"]), max(row["reps_us"])
        us = row["us_per_request"]
        print(f"{row['arm']:>10}: {us:8.1f} us/request (reps {lo:.1f}..{hi:.1f})")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
