"""HiSparse on the GPU: token capacity at a fixed memory budget, and decode at long context.

1. Capacity: GPU bytes per cached token of the flash-shaped preset with all C4 KV resident and
   with HiSparse (C4 KV in the host mirror; the GPU keeps SWA, C128, the indexer keys and a
   fixed device buffer), measured from the pools actually allocated at two sizes; then the
   tokens that fit in ``--budget-gib``, and an allocation of that size to confirm it.
2. Decode at long context: ``--batch`` requests of ``--context`` tokens (synthetic: pages filled
   with random values through the cache and the coordinator, as in decode_context.py), then
   ``--steps`` decode steps through the paged forward, all-resident versus HiSparse with a
   device buffer of each ``--buffer-fractions`` of the C4 pages. Same eager path for both arms.

    python bench/hisparse_decode.py --context 200000 --batch 8 --steps 20
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapters.forward.paged import build_step, run_step  # noqa: E402
from adapters.memory.offload import C4Offload  # noqa: E402
from adapters.memory.pools import KVPools  # noqa: E402
from adapters.model.model_config import preset  # noqa: E402
from adapters.model.weights import init_weights  # noqa: E402
from bench.meta import run_meta  # noqa: E402
from shadowradix import ShadowRadixCache  # noqa: E402

GIB = 2**30
DEVICE, DTYPE = "cuda", torch.bfloat16


def cache_config(model, tokens: int, page: int, swa_tokens: int):
    full = -(-tokens // page) * page
    return model.cache_config(page_size=page, full_capacity=full, swa_capacity=swa_tokens)


def gpu_bytes(model, tokens, page, offload_pages: int | None, graph: bool = False) -> int:
    """GPU bytes of the pools (and with ``offload_pages``, HiSparse's device buffers; with
    ``graph``, `GraphResidency`'s per host page tensors too: the device page table, the
    window's read counts and written flags, per C4 source)."""
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    cc = cache_config(model, tokens, page, 64 * 1024)
    pools = KVPools(model, cc, "cuda", torch.bfloat16, offload_c4=offload_pages is not None)
    buffers = []
    if offload_pages is not None:  # the device side of C4Offload (its host mirror is not GPU)
        spp = cc.stream(4).slots_per_page
        buffers = [
            torch.empty(offload_pages + 1, spp, model.head_dim, dtype=torch.bfloat16, device="cuda")
            for r in model.compress_ratios
            if r == 4
        ]
        host_pages = -(-tokens // page) + 1
        for _ in range(sum(1 for r in model.compress_ratios if r == 4) if graph else 0):
            buffers += [torch.empty(host_pages, dtype=d, device="cuda")
                        for d in (torch.int64, torch.int32, torch.bool)]  # fmt: skip
    used = torch.cuda.memory_allocated() - base
    del pools, buffers
    torch.cuda.empty_cache()
    return used


def capacity(model, page: int, budget: int, buffer_pages: int) -> list[dict]:
    rows = []
    arms = (("all resident", None, False), ("HiSparse", buffer_pages, False),
            ("HiSparse, graph decode", buffer_pages, True))  # fmt: skip
    for name, pages, graph in arms:
        a, b = 1 << 20, 2 << 20
        ba, bb = gpu_bytes(model, a, page, pages, graph), gpu_bytes(model, b, page, pages, graph)
        per_token = (bb - ba) / (b - a)
        fixed = ba - per_token * a
        fit = int((budget - fixed) / per_token) // page * page
        used = gpu_bytes(model, fit, page, pages, graph)  # confirm: allocate the whole thing
        host = (
            0.0
            if pages is None
            else sum(model.head_dim * 2 / 4 for r in model.compress_ratios if r == 4)
        )
        rows.append(
            {
                "config": name,
                "bytes_per_token": per_token,
                "fixed_bytes": fixed,
                "tokens_fit": fit,
                "allocated_gib": used / GIB,
                "host_bytes_per_token": host,
            }
        )
        print(
            f"| {name} | {per_token:.1f} | {fixed / GIB:.2f} | {fit:,} | {used / GIB:.2f} |",
            flush=True,
        )
    return rows


def fill(model, cache, pools, offload, batch, context, gen):
    rng = np.random.default_rng(context)
    reqs = []
    for _ in range(batch):
        prompt = rng.integers(0, 256, context + 1)
        r = cache.admit(prompt)
        while len(r.prompt_remaining) > 2:
            cache.extend(r, r.prompt_remaining[: min(16384, len(r.prompt_remaining) - 2)])
        cache.extend(r, r.prompt_remaining[:1])
        reqs.append(r)
    for group in (
        pools.swa,
        list(pools.compressed.values()),
        list(pools.index_keys.values()),
        list(pools.ring.values()),
        list(pools.index_ring.values()),
    ):
        for t in group:
            t.copy_(torch.randn(t.shape, generator=gen, device=t.device))
    if offload is not None:
        for host in offload.host.values():
            host.copy_(torch.randn(host.shape, dtype=torch.float32).to(host.dtype))
        pages = np.unique(np.concatenate([np.asarray(r.vpages, dtype=np.int64) for r in reqs]))
        chunk = max(1, offload.device_pages // 2)
        for j, _layer in enumerate(offload.layers):  # the coordinator learns the pages hold data
            for i in range(0, len(pages), chunk):
                plan = offload.coordinator.plan_step(
                    j, pages[:0], pages[i : i + chunk], np.ones(len(pages[i : i + chunk]), bool)
                )
                offload.coordinator.complete(plan.swap_in.ticket)
                offload.coordinator.complete(plan.backup.ticket)
        offload.lives.adopt(pages)  # and so does the executor: their next writes are not fresh
    return reqs


def decode_arm(model, weights, batch, context, steps, page, buffer_fraction, zero_copy=None):
    c4_pages = batch * (-(-(context + steps + 8) // page) + 1)
    pages = (
        None
        if buffer_fraction is None
        else max(model.index_topk + 2, int(c4_pages * buffer_fraction))
    )
    cc = cache_config(
        model,
        batch * (context + steps + 2 * page + 8),
        page,
        2 * 16384 + batch * 4 * page + 8 * page,
    )
    pools = KVPools(model, cc, DEVICE, DTYPE, offload_c4=pages is not None)
    cache = ShadowRadixCache(cc)
    off = (
        None
        if pages is None
        else C4Offload(
            model, cc, torch.device(DEVICE), DTYPE, pages, zero_copy=zero_copy,
            events=cache.subscribe_events(),
        )
    )  # fmt: skip
    mapped = off is not None and any(v is not None for v in off._mapped.values())
    gen = torch.Generator(device=DEVICE).manual_seed(context)
    reqs = fill(model, cache, pools, off, batch, context, gen)
    tokens = [int(r.prompt_remaining[0]) for r in reqs]
    times, swaps = [], []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        starts = [r.length for r in reqs]
        alloc = cache.extend_batch(reqs, [[t] for t in tokens])
        plans = [cache.read_plan(r, start=s) for r, s in zip(reqs, starts)]
        step = build_step(model, alloc, plans, np.array(tokens), torch.device(DEVICE))
        before = off.stats.swap_in_pages if off else 0
        if off is not None:
            off.drain()
            off.begin_step()
        rows = torch.arange(batch, device=DEVICE)
        logits = run_step(weights, pools, step, rows, off)
        tokens = logits.argmax(-1).tolist()
        if i >= 3:
            times.append(time.perf_counter() - t0)
            swaps.append((off.stats.swap_in_pages - before) if off else 0)
    step_s = float(np.median(times))
    swap = float(np.mean(swaps))
    page_bytes = off.spp * model.head_dim * 2 if off else 0
    row = {
        "batch": batch,
        "context": context,
        "buffer_fraction": buffer_fraction,
        "buffer_pages": pages,
        "zero_copy": mapped,
        "c4_pages": c4_pages,
        "step_ms": step_s * 1e3,
        "tokens_per_s": batch / step_s,
        "swap_in_pages_per_step": swap,
        "swap_in_mb_per_step": swap * page_bytes / 1e6,
        "swap_in_gbps_needed": swap * page_bytes / step_s / 1e9,
        "read_pages_per_layer_step": off.stats.read_pages / max(1, off.stats.exchanges)
        if off
        else 0.0,
    }
    del pools, off, cache
    torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="flash-shaped")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--budget-gib", type=float, default=64.0)
    ap.add_argument("--buffer-pages", type=int, default=16384, help="capacity run's buffer")
    ap.add_argument("--context", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--buffer-fractions", default="0.1,0.2,0.3")
    ap.add_argument("--skip-capacity", action="store_true")
    ap.add_argument("--skip-decode", action="store_true", help="the capacity part only")
    ap.add_argument("--json")
    ap.add_argument("--device", default="cuda", help="cpu: a functional smoke run only")
    args = ap.parse_args()
    global DEVICE, DTYPE
    DEVICE, DTYPE = args.device, (torch.bfloat16 if args.device == "cuda" else torch.float32)
    model = preset(args.model)
    out: dict = {}
    if not args.skip_capacity:
        print("| config | GPU bytes / token | fixed GiB | tokens in budget | allocated GiB |")
        print("|---|---|---|---|---|")
        out["capacity"] = capacity(
            model, args.page_size, int(args.budget_gib * GIB), args.buffer_pages
        )
        fits = [row["tokens_fit"] for row in out["capacity"]]
        print(f"capacity ratio HiSparse / resident: {fits[1] / fits[0]:.2f}x; graph decode: "
              f"{fits[2] / fits[0]:.2f}x", flush=True)  # fmt: skip
    if args.skip_decode:
        if args.json:
            out["meta"] = run_meta()
            Path(args.json).write_text(json.dumps(out, indent=1))
        return 0
    weights = init_weights(model, DEVICE, DTYPE)
    print(
        "| buffer | pages | step ms | tokens/s | vs resident | distinct pages read / layer | "
        "swap-in pages/step | MB/step | GB/s needed |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    fractions = [None] + [float(x) for x in args.buffer_fractions.split(",") if x]
    arms = [(f, None) for f in fractions] + [(f, False) for f in fractions[2:3]]
    for frac, zero_copy in arms:
        try:
            row = decode_arm(
                model,
                weights,
                args.batch,
                args.context,
                args.steps,
                args.page_size,
                frac,
                zero_copy,
            )
        except Exception as exc:  # report and go on with the other arms
            print(f"| {frac} | failed: {type(exc).__name__}: {exc} |", flush=True)
            continue
        rows.append(row)
        base = rows[0]["tokens_per_s"]
        label = "resident" if frac is None else f"{frac:.0%}"
        label += " zero-copy" if row["zero_copy"] else (" staged" if frac is not None else "")
        print(
            f"| {label} | {row['buffer_pages'] or '-'} | {row['step_ms']:.2f} | "
            f"{row['tokens_per_s']:.1f} | {row['tokens_per_s'] / base:.0%} | "
            f"{row['read_pages_per_layer_step']:.0f} | "
            f"{row['swap_in_pages_per_step']:.0f} | {row['swap_in_mb_per_step']:.1f} | "
            f"{row['swap_in_gbps_needed']:.1f} |",
            flush=True,
        )
    out["decode"] = rows
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
