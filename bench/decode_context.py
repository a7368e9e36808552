"""Decode throughput versus context length through the runner's decode path (GPU).

For each (batch, context) point: admit ``batch`` requests whose ``context`` tokens are extended
through the cache in chunks (allocations are never materialised) while the pools are filled with
random values — the *synthetic context*: the decode step then reads exactly what it would read
after a real prefill, at a fraction of the cost. Then ``--steps`` decode steps run through the
cache (``extend_batch`` fast path) and `GraphDecoder` (CUDA graphs, or eager with --no-graphs),
and each step is timed end to end (host scheduling + cache bookkeeping + table upload + GPU).

    python bench/decode_context.py --contexts 4096,65536,1048576 --batches 1,32
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
from adapters.memory.pools import KVPools  # noqa: E402
from adapters.model.model_config import preset  # noqa: E402
from adapters.model.weights import init_weights  # noqa: E402
from shadowradix import ShadowRadixCache  # noqa: E402


def fill_pools(pools: KVPools, gen: torch.Generator) -> None:
    for group in (
        pools.swa,
        list(pools.compressed.values()),
        list(pools.index_keys.values()),
        list(pools.ring.values()),
        list(pools.index_ring.values()),
    ):
        for t in group:
            t.copy_(torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float32))


def setup(model, weights, batch: int, context: int, steps: int, page: int):
    full = batch * (-(-(context + steps + 1) // page) + 1) * page
    chunk = 16384
    cache_cfg = model.cache_config(
        page_size=page,
        full_capacity=full,
        swa_capacity=2 * chunk + 8 * page + batch * 4 * page,  # a chunk is trimmed after the next
    )
    cache = ShadowRadixCache(cache_cfg)
    pools = KVPools(model, cache_cfg, weights.device, weights.dtype)
    rng = np.random.default_rng(batch * 7919 + context)
    requests = []
    for _ in range(batch):
        prompt = rng.integers(0, 256, context + 1)
        r = cache.admit(prompt)  # no match: fresh tree per point
        while len(r.prompt_remaining) > 2:
            cache.extend(r, r.prompt_remaining[: min(chunk, len(r.prompt_remaining) - 2)])
        cache.extend(r, r.prompt_remaining[:1])  # a one-token step trims the chunk's window
        requests.append(r)
    gen = torch.Generator(device=weights.device).manual_seed(context)
    fill_pools(pools, gen)
    return cache, cache_cfg, pools, requests


def time_point(model, weights, batch, context, steps, page, graphs: bool, warmup: int = 3):
    cache, cache_cfg, pools, requests = setup(model, weights, batch, context, steps + warmup, page)
    decoder = GraphDecoder(
        weights,
        pools,
        cache_cfg,
        max_batch=batch,
        max_context=context + steps + warmup + 1,
        use_graphs=graphs,
        min_context_bucket=context + steps + warmup + 1,
    )
    tokens = [int(r.prompt_remaining[0]) for r in requests]
    host_s, step_s = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        plan = cache.extend_batch(requests, [[t] for t in tokens])
        decoder.buffers.load(requests, tokens, plan.deltas)
        t1 = time.perf_counter()
        # the step's deltas are applied: step() only places the rows again
        logits = decoder.step(requests, tokens, ()) if i == 0 else _replay(decoder, requests)
        tokens = logits.argmax(-1).tolist()  # synchronises
        t2 = time.perf_counter()
        if i >= warmup:
            host_s.append(t1 - t0)
            step_s.append(t2 - t0)
    step = float(np.median(step_s))
    host = float(np.median(host_s))
    del cache, pools, decoder
    torch.cuda.empty_cache()
    return {
        "batch": batch,
        "context": context,
        "graphs": graphs,
        "step_ms": step * 1e3,
        "host_ms": host * 1e3,
        "host_share": host / step,
        "tokens_per_s": batch / step,
    }


def _replay(decoder: GraphDecoder, requests):
    """`GraphDecoder.step` minus the table upload already done (it is part of host time)."""
    context = decoder.buffers.max_context
    batch = len(requests)
    if not decoder.use_graphs:
        return decoder._run(batch, context)[:batch]
    return decoder._replay(batch, context)[:batch]


def profile_point(model, weights, batch: int, context: int, page: int) -> None:
    """Where the time of one eager decode step goes (CUDA kernel totals over 5 steps)."""
    from torch.profiler import ProfilerActivity, profile

    cache, cache_cfg, pools, requests = setup(model, weights, batch, context, 8, page)
    decoder = GraphDecoder(
        weights,
        pools,
        cache_cfg,
        batch,
        context + 9,
        use_graphs=False,
        min_context_bucket=context + 9,
    )
    tokens = [int(r.prompt_remaining[0]) for r in requests]
    plan = cache.extend_batch(requests, [[t] for t in tokens])
    decoder.step(requests, tokens, plan.deltas)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            decoder._run(batch, context + 9)
        torch.cuda.synchronize()
    print(f"# profile: batch {batch}, context {context}, 5 eager steps")
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="flash-shaped")
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--contexts", default="4096,16384,65536,262144,1048576")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument(
        "--eager-contexts",
        default="4096,65536",
        help="also time these contexts without CUDA graphs",
    )
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--profile", default="", help="BATCHxCONTEXT[,...]: top CUDA kernels there")
    args = ap.parse_args()
    model = preset(args.model)
    if args.layers:
        model = dataclasses.replace(model, compress_ratios=model.compress_ratios[: args.layers])
    t0 = time.perf_counter()
    weights = init_weights(model, "cuda", torch.bfloat16)
    print(
        f"# {model.name}: ratios {model.compress_ratios}, weights in "
        f"{time.perf_counter() - t0:.1f} s, {torch.cuda.get_device_name()}",
        flush=True,
    )
    rows = []
    eager = {int(c) for c in args.eager_contexts.split(",") if c}
    print("| batch | context | graphs | step ms | tokens/s | host ms | host share |")
    print("|---|---|---|---|---|---|---|")
    for b in (int(x) for x in args.batches.split(",")):
        for c in (int(x) for x in args.contexts.split(",")):
            for graphs in (True, False) if c in eager else (True,):
                row = time_point(model, weights, b, c, args.steps, args.page_size, graphs)
                rows.append(row)
                print(
                    f"| {b} | {c} | {'yes' if graphs else 'no'} | {row['step_ms']:.3f} | "
                    f"{row['tokens_per_s']:.0f} | {row['host_ms']:.3f} | "
                    f"{row['host_share']:.1%} |",
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    for point in filter(None, args.profile.split(",")):
        b, c = (int(x) for x in point.split("x"))
        profile_point(model, weights, b, c, args.page_size)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
