"""HiSparse inside graph decode: tokens/s of CUDA-graph decode with every C4 page resident versus
CUDA-graph decode with the C4 KV in the host mirror and a device buffer of ``--buffer-fraction``
of the C4 pages (`adapters.memory.residency.GraphResidency`: a plan from the last window of
``--commit-every`` graph steps, misses read zero-copy from the pinned mirror; one HiSparse arm
per value given).

``--batch`` requests of ``--context`` tokens of synthetic context (pages filled with random
values through the cache and the coordinator, as in bench/hisparse_decode.py), then ``--steps``
timed decode steps (after 3 of warm-up, the first captures the graph) through `GraphDecoder`,
each timed end to end (the cache's ``extend_batch``, the step with HiSparse's commit / table
sync / records, the argmax read back). Random weights: the top-k has no temporal locality, a
worst case for a plan taken from earlier steps. Target: HiSparse >= 0.95x all-resident, in
tokens/s over the *mean* step time (a window's commit lands in one of its steps: the median
would hide it; the median is reported too).

    python bench/hisparse_graph.py --context 200000 --batch 8 --steps 20 --out result.json
    python bench/hisparse_graph.py --device cpu --context 2048 --batch 2 --steps 4  # smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapters.forward.graph_decode import GraphDecoder  # noqa: E402
from adapters.memory.offload import C4Offload  # noqa: E402
from adapters.memory.pools import KVPools  # noqa: E402
from adapters.memory.residency import COMMIT_EVERY, GraphResidency  # noqa: E402
from adapters.model.model_config import ModelConfig, preset  # noqa: E402
from adapters.model.weights import ModelWeights, init_weights  # noqa: E402
from bench.hisparse_decode import cache_config, fill  # noqa: E402
from bench.meta import run_meta  # noqa: E402
from shadowradix import ShadowRadixCache  # noqa: E402

WARMUP = 3


@dataclasses.dataclass(frozen=True)
class Point:
    batch: int
    context: int
    steps: int
    page_size: int

    @property
    def max_context(self) -> int:
        return self.context + self.steps + WARMUP + 1

    @property
    def c4_pages(self) -> int:
        """Host pages of C4 KV the requests end with (the cache's virtual pages)."""
        return self.batch * (-(-(self.max_context + 8) // self.page_size) + 1)


def buffer_pages(model: ModelConfig, point: Point, fraction: float) -> int:
    """``fraction`` of the C4 pages, at least one query's top-k pages plus two."""
    return max(model.index_topk + 2, int(point.c4_pages * fraction))


def load_buffer(off: C4Offload, pages: np.ndarray) -> None:
    """Copies the mirror pages that `fill` left resident into their buffer slots (a resident
    page's buffer copy equals its mirror page, as `GraphResidency` keeps it)."""
    for j, layer in enumerate(off.layers):
        held = pages[off.coordinator.resident(j, pages)]
        slots = torch.from_numpy(off.coordinator.slots(j, held)).to(off.device)
        off.buffer[layer][slots] = off.host[layer][torch.from_numpy(held)].to(off.device)


def decode_arm(model: ModelConfig, weights: ModelWeights, point: Point, pages: int | None,
               max_swaps: int | None, commit_every: int | None = None) -> dict:  # fmt: skip
    """One arm: all-resident (``pages`` None) or HiSparse with ``pages`` buffer pages,
    planning once every ``commit_every`` graph steps."""
    dev, dtype, p = weights.device, weights.dtype, point
    cc = cache_config(model, p.batch * (p.max_context + 2 * p.page_size + 8), p.page_size,
                      2 * 16384 + p.batch * 4 * p.page_size + 8 * p.page_size)  # fmt: skip
    pools = KVPools(model, cc, dev, dtype, offload_c4=pages is not None)
    cache = ShadowRadixCache(cc)
    off = None
    if pages is not None:
        off = C4Offload(model, cc, dev, dtype, pages, events=cache.subscribe_events())
    gen = torch.Generator(device=dev).manual_seed(p.context)
    reqs = fill(model, cache, pools, off, p.batch, p.context, gen)
    res = None
    if off is not None:
        load_buffer(off, np.unique(np.concatenate([np.asarray(r.vpages) for r in reqs])))
        res = GraphResidency(off, model, p.batch, max_swaps, commit_every)
    decoder = GraphDecoder(weights, pools, cc, p.batch, p.max_context,
                           min_context_bucket=p.max_context, hisparse=res)  # fmt: skip
    tokens = [int(r.prompt_remaining[0]) for r in reqs]
    commits = None if res is None else time_commits(res)
    times: list[float] = []
    before, counts = GraphStatsSnapshot.of(res), (0, 0)
    for i in range(WARMUP + p.steps):
        if i == WARMUP:
            before, counts = GraphStatsSnapshot.of(res), res.hit_rate() if res else (0, 0)
        t0 = time.perf_counter()
        plan = cache.extend_batch(reqs, [[t] for t in tokens])
        logits = decoder.step(reqs, tokens, plan.deltas)
        tokens = logits.argmax(-1).tolist()  # synchronises
        times.append(time.perf_counter() - t0)
    step_s = float(np.median(times[WARMUP:]))
    mean_s = float(np.mean(times[WARMUP:]))  # a window's commit lands in one step of it
    row = dict(buffer_pages=pages, c4_pages=p.c4_pages, graphs=decoder.use_graphs,
               commit_every=None if res is None else res.commit_every, step_ms=step_s * 1e3,
               mean_step_ms=mean_s * 1e3, tokens_per_s=p.batch / mean_s)  # fmt: skip
    row["steps_ms"] = [round(1e3 * t, 3) for t in times[WARMUP:]]
    if res is not None and off is not None:
        row.update(hisparse_row(res, off, before, counts, p.steps))
    if commits is not None:
        host, events = commits
        if dev.type == "cuda":
            torch.cuda.synchronize()
        row["commit_host_ms"] = [round(t, 3) for t in host]
        row["commit_copy_device_ms"] = [round(a.elapsed_time(b), 3) for a, b in events]
    del decoder, res, off, pools, cache
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def time_commits(res: GraphResidency) -> tuple[list[float], list]:
    """Wraps ``res``: the host ms of each commit that planned a window, and (CUDA) the device
    time of each commit's mirror -> buffer copies, as event pairs."""
    host: list[float] = []
    events: list = []
    commit, copy = res._commit_pending, res._copy_pages

    def timed_commit() -> None:
        busy = res._pending is not None
        t0 = time.perf_counter()
        commit()
        if busy:
            host.append(1e3 * (time.perf_counter() - t0))

    def timed_copy(*a, **k):  # type: ignore[no-untyped-def]
        if res.offload.device.type != "cuda":
            return copy(*a, **k)
        pair = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        pair[0].record()
        out = copy(*a, **k)
        pair[1].record()
        events.append(pair)
        return out

    res._commit_pending = timed_commit  # type: ignore[method-assign]
    res._copy_pages = timed_copy  # type: ignore[method-assign]
    return host, events


@dataclasses.dataclass(frozen=True)
class GraphStatsSnapshot:
    """`GraphStats` counters at one moment (the timed steps' are a difference)."""

    steps: int = 0
    commits: int = 0
    swap_in_pages: int = 0
    missed_pages: int = 0
    dropped_misses: int = 0

    @classmethod
    def of(cls, res: GraphResidency | None) -> GraphStatsSnapshot:
        return cls() if res is None else cls(**dataclasses.asdict(res.stats))

    def minus(self, other: GraphStatsSnapshot) -> dict[str, int]:
        mine, theirs = dataclasses.asdict(self), dataclasses.asdict(other)
        return {k: mine[k] - theirs[k] for k in mine}


def hisparse_row(res: GraphResidency, off: C4Offload, before: GraphStatsSnapshot,
                 counts: tuple[int, int], steps: int) -> dict:  # fmt: skip
    """The timed steps' HiSparse counters: the commits their `before_step` ran (each of the
    step before: the last timed step's is never run) and their entries read."""
    hit, read = res.hit_rate()
    hit, read = hit - counts[0], read - counts[1]
    timed = GraphStatsSnapshot.of(res).minus(before)
    layer_steps = max(1, steps * len(off.layers))
    return {
        "copy_path": off.copy_path,
        "max_swaps": res.max_swaps,
        "graph_stats": timed,
        "graph_stats_total": dataclasses.asdict(res.stats),
        "entry_hit_rate": hit / max(1, read),
        "missed_pages_per_layer_step": timed["missed_pages"] / layer_steps,
        "swap_in_pages_per_layer_step": timed["swap_in_pages"] / layer_steps,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="preset (default: flash-shaped on CUDA, tiny on the CPU)")
    ap.add_argument("--device", default="cuda", help="cpu: a functional smoke run only")
    ap.add_argument("--context", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--buffer-fraction", type=float, default=0.2)
    ap.add_argument("--max-swaps", type=int, help="GraphResidency's bound (default: the top-k)")
    ap.add_argument("--commit-every", type=int, nargs="+", default=[COMMIT_EVERY],
                    help="graph steps per HiSparse planning window; one arm per value")
    ap.add_argument("--out", help="write the JSON result here")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    model = preset(args.model or ("flash-shaped" if cuda else "tiny"))
    dtype = torch.bfloat16 if cuda else torch.float32
    t0 = time.perf_counter()
    weights = init_weights(model, args.device, dtype)
    point = Point(args.batch, args.context, args.steps, args.page_size)
    pages = buffer_pages(model, point, args.buffer_fraction)
    print(f"# {model.name} with RANDOM weights ({dtype}, {args.device}; weights in "
          f"{time.perf_counter() - t0:.1f} s): {point.batch} x {point.context:,} tokens, "
          f"{point.steps} timed steps; HiSparse buffer {pages:,} of {point.c4_pages:,} C4 "
          f"pages per layer ({pages / point.c4_pages:.0%})", flush=True)  # fmt: skip
    resident = decode_arm(model, weights, point, None, None)
    arms = [decode_arm(model, weights, point, pages, args.max_swaps, every)
            for every in args.commit_every]  # fmt: skip
    ratios = [arm["tokens_per_s"] / resident["tokens_per_s"] for arm in arms]
    for hisparse, ratio in zip(arms, ratios):
        report(resident, hisparse, ratio)
    hisparse, ratio = arms[0], ratios[0]
    if args.out:
        result = dict(meta=run_meta(), model=model.name, weights="random", dtype=str(dtype),
                      batch=point.batch, context=point.context, steps=point.steps,
                      page_size=point.page_size, buffer_fraction=args.buffer_fraction,
                      resident=resident, hisparse=hisparse, ratio=ratio, target=0.95,
                      met=ratio >= 0.95, ratio_basis="mean step time",
                      by_commit_every=[{**arm, "ratio": r} for arm, r in zip(arms, ratios)],
                      )  # fmt: skip
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


def report(resident: dict, hisparse: dict, ratio: float) -> None:
    print("| arm | graphs | buffer pages | commit every | median step ms | mean step ms | "
          "tokens/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, row in (("all resident", resident), ("HiSparse", hisparse)):
        print(f"| {name} | {'yes' if row['graphs'] else 'no (eager)'} | "
              f"{row['buffer_pages'] or '-'} | {row['commit_every'] or '-'} | "
              f"{row['step_ms']:.2f} | {row['mean_step_ms']:.2f} | "
              f"{row['tokens_per_s']:.1f} |")  # fmt: skip
    print(f"HiSparse / all resident: {ratio:.3f}x (target >= 0.95: "
          f"{'met' if ratio >= 0.95 else 'NOT met'})")  # fmt: skip
    print(f"HiSparse ({hisparse['copy_path']}, max_swaps {hisparse['max_swaps']}), timed steps: "
          f"{hisparse['graph_stats']}; entry hit rate {hisparse['entry_hit_rate']:.1%}; per "
          f"layer-step {hisparse['missed_pages_per_layer_step']:.1f} missed pages, "
          f"{hisparse['swap_in_pages_per_layer_step']:.1f} swapped in", flush=True)  # fmt: skip
    for name, row in (("all resident", resident), ("HiSparse", hisparse)):
        print(f"{name} steps ms: {row['steps_ms']}")
    print(f"HiSparse commits, host ms: {hisparse.get('commit_host_ms')}; copies' device ms "
          f"(per layer): {hisparse.get('commit_copy_device_ms')}", flush=True)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
