"""Engram placement (#17 item 5): KV capacity at a fixed GPU budget, and decode throughput and
greedy equality per placement.

Capacity: the GPU bytes left for the KV pools and the Engram tables (``--kv-budget-gib``,
after the weights: the same in every placement) hold the tables too when they are on the
device; off the device (host or host-sharded) the pools get all of it. Both numbers come from
allocated sizes: the pools' per-page bytes measured on ``meta`` pools (`pool_budget`), the
tables' bytes from `engram_table.init_table(..., "meta")`.

Decode: one runner per placement (device, host; sharded needs a process group: see
tests/test_engram_shard.py), the same prompts, greedy; generated tokens per second of a whole
`generate` (prefill included: with short prompts mostly decode) and whether the outputs equal
the device placement's.

    python bench/engram.py                                    # CPU: tiny-engram decode
    python bench/engram.py --device cuda --preset flash-engram --engram-rows 4000000 \\
        --batch 8 --new 64 --out bench/results/engram_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from adapters.engine.runner import Runner  # noqa: E402
from adapters.engine.sampling import SamplingParams  # noqa: E402
from adapters.memory.engram_table import init_table  # noqa: E402
from adapters.memory.pool_budget import budget_cache_config  # noqa: E402
from adapters.model.model_config import EngramPlacement, ModelConfig, preset  # noqa: E402
from adapters.model.weights import init_weights  # noqa: E402
from bench.meta import run_meta  # noqa: E402

GIB = 2**30


def capacity(cfg: ModelConfig, budget_gib: float, ratio: float, page_size: int) -> dict:
    """Full-pool tokens that fit ``budget_gib`` with the tables on the device and off it."""
    table = init_table(cfg, "meta").nbytes
    budget = int(budget_gib * GIB)

    def tokens(nbytes: int) -> int:
        cc = budget_cache_config(cfg, nbytes, ratio, torch.bfloat16, page_size=page_size)
        return cc.full_capacity

    on, off = tokens(budget - table), tokens(budget)
    return dict(
        preset=cfg.name, kv_budget_gib=budget_gib, table_gib=round(table / GIB, 3),
        swa_full_tokens_ratio=ratio, page_size=page_size, tokens_table_on_device=on,
        tokens_table_off_device=off, gain=round(off / on - 1, 4),
    )  # fmt: skip


def decode(
    cfg: ModelConfig, device: str, batch: int, new: int, prompt_len: int, reps: int
) -> list[dict]:
    """Both placements' runners built first, each warmed up on the timed batch's shapes (graph
    capture and kernel compilation stay out of the timing), then ``reps`` timed runs
    alternating between them; the median wall time."""
    prompts = [[(31 * i + 7 * b) % 256 for i in range(prompt_len)] for b in range(batch)]
    runners = {}
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    weights = init_weights(cfg, device, dtype)  # drawn once (a flash-shaped draw takes a minute)
    for placement in (EngramPlacement.DEVICE, EngramPlacement.HOST):
        model = replace(cfg, engram_placement=placement)
        full = -(-(batch * (prompt_len + new) + 1024) // 64) * 64
        cc = model.cache_config(page_size=64, full_capacity=full,
                                swa_capacity=batch * 2 * (model.window + 64))  # fmt: skip
        runner = Runner(model, cc, device=device, weights=replace(weights, config=model),
                        dtype=dtype, chunk_tokens=max(256, prompt_len),
                        max_running=batch)  # fmt: skip
        runner.generate(prompts, SamplingParams(max_new_tokens=new))  # warm-up, same shapes
        runners[placement] = runner
    walls: dict = {p: [] for p in runners}
    outputs: dict = {}
    for _ in range(reps):
        for placement, runner in runners.items():
            _sync(device)
            t0 = time.perf_counter()
            results = runner.generate(prompts, SamplingParams(max_new_tokens=new))
            _sync(device)
            walls[placement].append(time.perf_counter() - t0)
            outputs[placement] = [r.output for r in results]
    base = outputs[EngramPlacement.DEVICE]
    out = []
    for placement, runner in runners.items():
        wall = statistics.median(walls[placement])
        out.append(dict(
            placement=placement.value, paths=str(runner.paths), reps=reps,
            wall_s=round(wall, 4), wall_s_all=[round(w, 4) for w in walls[placement]],
            tokens_per_s=round(batch * new / wall, 1),
            greedy_equal_device=outputs[placement] == base,
        ))  # fmt: skip
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-engram")
    ap.add_argument("--engram-rows", type=int, default=None, help="override the table rows")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--kv-budget-gib", type=float, default=120.0)
    ap.add_argument("--swa-ratio", type=float, default=0.1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="bench/results/engram_cpu.json")
    args = ap.parse_args()
    flash = preset("flash-engram")
    result = dict(
        meta=run_meta(),
        capacity=capacity(flash, args.kv_budget_gib, args.swa_ratio, 256),
    )
    cfg = preset(args.preset)
    if args.engram_rows is not None:
        cfg = replace(cfg, engram_rows=args.engram_rows)
    result["decode"] = dict(
        preset=cfg.name, engram_rows=cfg.engram_rows, batch=args.batch, new=args.new,
        prompt_len=args.prompt_len, reps=args.reps,
        runs=decode(cfg, args.device, args.batch, args.new, args.prompt_len, args.reps),
    )  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
