"""Host cost per decode step of HiSparse graph decode (`adapters.memory.residency.GraphResidency`)
on the CPU: `before_step` (drain, `C4Offload.begin_step`), `sync_table`, `commit` (the deferred
plan of the previous step: `Coordinator.plan_step`, the mirror -> buffer copies) and
`after_step` (the step's records to the host) — the work that, on the H200, runs while the
graph step runs on the device and outlasts it (docs/hisparse.md, "Planning off the critical
path").

No model runs: a `C4Offload` of the flash-shaped model's C4 KV sources (2 layers at the
default) over ``--batch`` requests of ``--context`` tokens each (their C4 pages all hold data:
the coordinator and the page lives learn it as in bench/hisparse_decode.py's `fill`), a device
buffer of ``--buffer-fraction`` of those pages, and per step what the captured graph leaves
in the residency's record buffers: each query row's top-``k`` selected pages and the entry
slot it wrote (one C4 entry every 4 tokens, into its request's tail page: a fresh page every
``spp`` entries). Selections: ``random`` (a uniform top-k each step: no temporal locality,
~3000 missed pages per layer-step at 200K x 8 with a 20% buffer) and ``local`` (each step keeps
``--keep`` of the previous step's entries and draws the rest anew).

``--head-dim`` (default 4, not the model's 512) keeps the CPU's own mirror -> buffer copies
small: on CUDA they are device gathers queued behind the step, not host work. Reported:
median µs per step of each phase (``before_step`` without its `sync_table`, which is its own
row) over ``--steps`` steps after ``--warmup``, the best median of ``--repeat`` runs; with
``--commit-every`` above 1 the mean instead (one step of each window commits).

    python bench/hisparse_commit.py --json bench/results/hisparse_commit_cpu.json
    python bench/hisparse_commit.py --profile local   # cProfile of the local scenario's steps
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapters.memory.offload import C4Offload  # noqa: E402
from adapters.memory.residency import GraphResidency  # noqa: E402
from adapters.model.model_config import preset  # noqa: E402
from bench.meta import run_meta  # noqa: E402
from shadowradix import ShadowRadixCache  # noqa: E402

PHASES = ("before_step", "sync_table", "commit", "after_step", "total")
SCENARIOS = ("random", "local")


class Workload:
    """Request ``r`` owns virtual pages ``[r * P, (r + 1) * P)``: its context's C4 pages, then
    decode tail pages."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        base = preset(args.model)
        rope = min(base.rope_dim, args.head_dim)
        model = preset(args.model, head_dim=args.head_dim, rope_dim=rope)
        self.model = model
        tokens = args.context + 4 * (args.warmup + args.steps + 2) * args.tokens
        page = args.page_size
        self.pages_per_request = -(-tokens // page) + 2
        cc = model.cache_config(page_size=page, full_capacity=page * self.pages_per_request
                                * args.batch, swa_capacity=page * 64)  # fmt: skip
        self.cache = ShadowRadixCache(cc)
        self.spp = cc.stream(4).slots_per_page
        self.context_entries = args.context // 4
        self.context_pages = -(-self.context_entries // self.spp)
        self.c4_pages = args.batch * self.context_pages
        self.buffer_pages = max(model.index_topk + 2, int(self.c4_pages * args.buffer_fraction))
        events = self.cache.subscribe_events()
        self.offload = C4Offload(model, cc, torch.device("cpu"), torch.float32,
                                 self.buffer_pages, events=events)  # fmt: skip
        self._fill()
        self.rows = args.batch * args.tokens
        self.res = GraphResidency(self.offload, model, self.rows,
                                  commit_every=args.commit_every)  # fmt: skip
        self.rng = np.random.default_rng(args.seed)
        self.entries = self._draw((self.rows, model.index_topk))  # entry index in the context
        self.step = 0

    def _fill(self) -> None:
        """The context pages hold data (coordinator + page lives), the last placed resident."""
        off, base = self.offload, self._bases()
        pages = (base[:, None] + np.arange(self.context_pages)).reshape(-1)
        for host in off.host.values():
            host.normal_()
        chunk = max(1, off.device_pages // 2)
        for j in range(len(off.layers)):
            for i in range(0, len(pages), chunk):
                part = pages[i : i + chunk]
                plan = off.coordinator.plan_step(j, pages[:0], part, np.ones(len(part), bool))
                off.coordinator.complete(plan.swap_in.ticket)
                off.coordinator.complete(plan.backup.ticket)
        off.lives.adopt(pages)
        for j, layer in enumerate(off.layers):  # resident pages' buffer copies = the mirror's
            held = pages[off.coordinator.resident(j, pages)]
            slots = torch.from_numpy(off.coordinator.slots(j, held))
            off.buffer[layer][slots] = off.host[layer][torch.from_numpy(held)]

    def _bases(self) -> np.ndarray:
        return np.arange(self.args.batch, dtype=np.int64) * self.pages_per_request

    def _draw(self, shape: tuple[int, ...]) -> np.ndarray:
        return self.rng.integers(0, self.context_entries, shape, dtype=np.int64)

    def selection(self, scenario: str) -> np.ndarray:
        """The step's top-k as virtual pages ``(rows, k)``."""
        if scenario == "random":
            self.entries = self._draw(self.entries.shape)
        else:
            swap = self.rng.random(self.entries.shape) >= self.args.keep
            self.entries[swap] = self._draw((int(swap.sum()),))
        request = np.arange(self.rows) // self.args.tokens
        return self._bases()[request][:, None] + self.entries // self.spp

    def written(self) -> np.ndarray:
        """Each row's written virtual entry slot, the mirror's sentinel when none completed."""
        a, res = self.args, self.res
        out = np.full(self.rows, res.host_rows, dtype=np.int64)
        for t in range(a.tokens):
            pos = a.context + self.step * a.tokens + t  # the token's position in its request
            if (pos + 1) % 4:
                continue
            entry = pos // 4
            rows = np.arange(a.batch) * a.tokens + t
            out[rows] = self._bases() * self.spp + entry
        self.step += 1
        return out

    def graph_step(self, scenario: str) -> None:
        """What the captured step adds to the window's records (the KV is not touched): one
        read per selected entry (each source has one reader here), the written pages."""
        pages = torch.from_numpy(self.selection(scenario).reshape(-1))
        written = torch.from_numpy(self.written()) // self.spp
        ones = torch.ones(len(pages), dtype=torch.int32)
        for t in self.res.reads.values():
            t.index_add_(0, pages, ones)
        for t in self.res.wrote.values():
            t[written] = True


def timed(fn: Callable[[], None], into: list[float]) -> Callable[[], None]:
    def run() -> None:
        t0 = time.perf_counter()
        fn()
        into.append(time.perf_counter() - t0)

    return run


def run(args: argparse.Namespace, scenario: str, profile: cProfile.Profile | None = None
        ) -> tuple[dict[str, float], dict[str, float]]:  # fmt: skip
    """Median µs per step of each phase, and the residency's counters per layer-step."""
    w = Workload(args)
    res = w.res
    sync: list[float] = []
    res.sync_table = timed(res.sync_table, sync)  # type: ignore[method-assign]
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    clock = time.perf_counter
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            sync.clear()
            for v in times.values():
                v.clear()
            stats0 = dict(vars(res.stats))
            if profile is not None:
                profile.enable()
        t0 = clock()
        res.before_step()
        t1 = clock()
        w.graph_step(scenario)  # the replay (not timed)
        t2 = clock()
        res.after_launch(w.rows)
        t3 = clock()
        res.after_step()
        t4 = clock()
        times["before_step"].append(t1 - t0 - sync[-1])
        times["commit"].append(t3 - t2)
        times["after_step"].append(t4 - t3)
        times["total"].append(t1 - t0 + t4 - t2)
    if profile is not None:
        profile.disable()
    times["sync_table"] = sync
    # a window's commit lands in one of its steps: the mean, not the median, past one step
    average = np.median if args.commit_every == 1 else np.mean
    med = {p: float(average(times[p])) * 1e6 for p in PHASES}
    layer_steps = args.steps * len(w.offload.layers)
    counters = {k: (v - stats0[k]) / (layer_steps if k != "steps" else 1)
                for k, v in vars(res.stats).items()}  # fmt: skip
    return med, counters


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="flash-shaped")
    ap.add_argument("--head-dim", type=int, default=4)
    ap.add_argument("--context", type=int, default=200_000, help="tokens per request")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1, help="query tokens per request and step")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--buffer-fraction", type=float, default=0.2)
    ap.add_argument("--keep", type=float, default=0.9, help="local: entries kept per step")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commit-every", type=int, default=1,
                    help="graph steps per planning window (1: the cost of one commit a step)")
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    ap.add_argument("--profile", choices=SCENARIOS, help="print a cProfile of one scenario")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.profile:
        prof = cProfile.Profile()
        run(args, args.profile, prof)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
        return 0
    probe = Workload(args)
    print(f"# {args.model} (head_dim {args.head_dim}), {len(probe.offload.layers)} C4 source "
          f"layers, top-{probe.model.index_topk}, {probe.spp} entries a page: {args.batch} x "
          f"{args.context:,} tokens, {probe.c4_pages:,} C4 pages, buffer {probe.buffer_pages:,}; "
          f"median of {args.steps} steps, best of {args.repeat}", flush=True)  # fmt: skip
    del probe
    results = {}
    for scenario in args.scenarios:
        best: dict[str, float] | None = None
        for _ in range(args.repeat):
            med, counters = run(args, scenario)
            best = med if best is None else {p: min(best[p], med[p]) for p in PHASES}
        assert best is not None
        results[scenario] = dict(us_per_step=best, per_layer_step=counters)
    head = " | ".join(f"{p} µs" for p in PHASES)
    print(f"| scenario | {head} | missed pages | swapped in |")
    print("|---" * (len(PHASES) + 3) + "|")
    for scenario, r in results.items():
        us, c = r["us_per_step"], r["per_layer_step"]
        print(f"| {scenario} | " + " | ".join(f"{us[p]:.0f}" for p in PHASES)
              + f" | {c['missed_pages']:.0f} | {c['swap_in_pages']:.0f} |")  # fmt: skip
    if args.json:
        out = dict(meta=run_meta(), args=vars(args), results=results)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
