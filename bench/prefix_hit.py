"""Per-request cost of the core when every request hits one long cached prefix (CPU).

A ``--prefix``-token prompt is cached once (page 1 by default, the V4-Flash layer pattern, the
400K / 40K pools of the reference trace); then each of ``--reqs`` requests admits that prefix
plus a distinct 384-token suffix (a hit of the whole prefix), prefills the suffix, decodes 16
tokens one step at a time and finishes. Reports µs per request (the median of ``--reps``
repetitions) and the hottest functions of one more repetition (cProfile).

    python bench/prefix_hit.py --prefix 131072 --json out.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.meta import run_meta  # noqa: E402
from shadowradix import CacheConfig, ShadowRadixCache  # noqa: E402
from shadowradix.config import V4_FLASH_RATIOS  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix", type=int, default=131072)
    ap.add_argument("--page", type=int, default=1)
    ap.add_argument("--reqs", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    meta = run_meta()  # before the runs: the commit that was imported
    cfg = CacheConfig(page_size=args.page, window=128, compress_ratios=V4_FLASH_RATIOS,
                      overlap_ratios=(4,), full_capacity=400_000 // args.page * args.page,
                      swa_capacity=40_000 // args.page * args.page)  # fmt: skip
    cache = ShadowRadixCache(cfg)
    prefix = np.arange(args.prefix, dtype=np.int64)
    r = cache.admit(prefix)
    while len(r.prompt_remaining):
        cache.extend(r, r.prompt_remaining[:8192])
    cache.finish(r)
    counter = iter(range(10**9))

    def one() -> None:
        i = next(counter)
        suffix = np.arange(10**7 + 400 * i, 10**7 + 400 * i + 384, dtype=np.int64)
        req = cache.admit(np.concatenate((prefix, suffix)))
        assert req.length >= args.prefix - args.page
        cache.extend(req, req.prompt_remaining)
        for _ in range(16):
            cache.extend_batch([req], [[7]])
        cache.finish(req)

    for _ in range(3):
        one()
    per = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        for _ in range(args.reqs):
            one()
        per.append((time.perf_counter() - t0) / args.reqs * 1e6)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.reqs):
        one()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(8)
    out = dict(meta=meta, prefix=args.prefix, page=args.page,
               us_per_request=statistics.median(per), reps_us=per)  # fmt: skip
    print(json.dumps(out))
    print(text.getvalue())
    cache.check_invariants()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
