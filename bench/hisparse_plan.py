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

With ``--baseline REV`` the package as committed at git revision ``REV`` (e.g. ``HEAD``, while
the work tree holds a change) is loaded beside the working copy and every scenario runs both,
alternating run by run, so that both see the same machine load; the table then shows both
medians and the speed-up.

    python bench/hisparse_plan.py --baseline 4e47cb8   # the first table in docs/hisparse.md
    python bench/hisparse_plan.py --baseline 4e47cb8 --batch 1 --device-slots 768 --steps 2000
    python bench/hisparse_plan.py --baseline HEAD      # a work-tree change against its commit
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import io
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hisparse  # noqa: E402

Reads = Callable[[int], np.ndarray]


class Workload:
    """Host-page layout: request ``r`` owns context pages ``[r*P, (r+1)*P)`` and decode tail
    pages after all contexts."""

    def __init__(self, args: argparse.Namespace, rng: np.random.Generator) -> None:
        self.args, self.rng = args, rng
        self.epp = args.entries_per_page
        tail_pages = (args.warmup + args.steps) // self.epp + 2
        self.tail_base = args.batch * args.pages
        self.config = dict(
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


def prefill(coord: Any, work: Workload) -> None:
    """Write every context page once (fresh), in chunks, completing as we go."""
    total = work.tail_base
    chunk = max(1, coord.config.device_slots // 2)
    for start in range(0, total, chunk):
        pages = np.arange(start, min(total, start + chunk), dtype=np.int64)
        plan = coord.plan_step(0, pages[:0], pages, np.ones(len(pages), bool))
        coord.complete(plan.swap_in.ticket)
        coord.complete(plan.backup.ticket)


def digest(crc: int, plan: Any) -> int:
    """Fold a plan's decisions (slots, copies, victims) into a running CRC."""
    for array in (
        plan.read_slots,
        plan.write_slots,
        plan.evicted_pages,
        plan.swap_in.host_pages,
        plan.swap_in.device_slots,
        plan.backup.host_pages,
        plan.backup.device_slots,
    ):
        crc = zlib.crc32(np.ascontiguousarray(array, np.int64).tobytes(), crc)
    return crc


def run(pkg: ModuleType, scenario: str, args: argparse.Namespace) -> dict[str, float]:
    """One run of ``scenario`` on the coordinator of package ``pkg``."""
    work = Workload(args, np.random.default_rng(args.seed))
    coord = pkg.Coordinator(pkg.HiSparseConfig(**work.config))
    prefill(coord, work)
    times: list[int] = []
    last: Any = None
    swaps = evictions = crc = 0
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
        if args.baseline:
            crc = digest(crc, last)
    after = coord.stats(0)
    us = np.asarray(times) / 1e3
    return {
        "median_us": float(np.median(us)),
        "p90_us": float(np.percentile(us, 90)),
        "hit_ratio": (after.read_hits - before.read_hits) / (after.reads - before.reads),
        "swap_ins": swaps / args.steps,
        "evictions": evictions / args.steps,
        "digest": float(crc),
    }


def load_revision(rev: str) -> ModuleType:
    """``hisparse/`` as committed at git revision ``rev``, imported as a separate package."""
    tar = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", rev, "hisparse"],
        check=True,
        capture_output=True,
    ).stdout
    where = Path(tempfile.mkdtemp(prefix="hisparse-baseline-"))
    atexit.register(shutil.rmtree, where, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4
            archive.extractall(where, filter="data")
        else:
            archive.extractall(where)  # our own repository's archive
    name = "hisparse_baseline"
    spec = importlib.util.spec_from_file_location(
        name,
        where / "hisparse" / "__init__.py",
        submodule_search_locations=[str(where / "hisparse")],
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def best(runs: list[dict[str, float]]) -> dict[str, float]:
    return min(runs, key=lambda r: r["median_us"])


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
    ap.add_argument(
        "--baseline",
        metavar="REV",
        help="also time hisparse/ as of this git revision, alternating runs (e.g. HEAD)",
    )
    args = ap.parse_args()
    base = load_revision(args.baseline) if args.baseline else None
    print(
        f"batch {args.batch} x top-k {args.topk}, {args.pages} host pages/request, "
        f"{args.device_slots} device slots, churn {args.churn:.0%}, {args.steps} steps"
    )
    columns = f"{'scenario':<10}{'median µs':>11}{'p90 µs':>9}"
    if base is not None:
        columns += f"{f'{args.baseline} median':>16}{f'{args.baseline} p90':>13}{'speed-up':>10}"
    print(f"{columns}{'hits':>8}{'swap-in/step':>14}{'evict/step':>12}")
    same = True
    for scenario in args.scenarios.split(","):
        new: list[dict[str, float]] = []
        old: list[dict[str, float]] = []
        for _ in range(args.repeat):
            new.append(run(hisparse, scenario, args))
            if base is not None:
                old.append(run(base, scenario, args))
        r = best(new)
        line = f"{scenario:<10}{r['median_us']:>11.1f}{r['p90_us']:>9.1f}"
        if base is not None:
            b = best(old)
            same = same and {x["digest"] for x in new + old} == {r["digest"]}
            speedup = b["median_us"] / r["median_us"]
            line += f"{b['median_us']:>16.1f}{b['p90_us']:>13.1f}{speedup:>9.2f}x"
        print(f"{line}{r['hit_ratio']:>8.1%}{r['swap_ins']:>14.1f}{r['evictions']:>12.1f}")
    if base is not None:
        verdict = "identical" if same else "DIFFERENT"
        print(f"plans (slots, copies, victims of every step) vs {args.baseline}: {verdict}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
