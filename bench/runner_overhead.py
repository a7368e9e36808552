"""Host overhead of the runner's decode steps (scheduler + cache bookkeeping + table upload).

Submits ``--batch`` prompts of ``--prompt-len`` random bytes, runs until every request decodes,
then times ``--steps`` decode-only ``Runner.step()`` calls: wall time per step versus the time
spent inside the forward (graph replay plus the device sync). The host share is
``1 - forward / wall``: everything the CPU does per step that the GPU waits for.

    python bench/runner_overhead.py --batch 32 --prompt-len 4096 --steps 50
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

from adapters.model_config import preset  # noqa: E402
from adapters.runner import Runner  # noqa: E402
from adapters.sampling import SamplingParams  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="flash-shaped")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()
    model = preset(args.model)
    tokens = args.batch * (args.prompt_len + args.steps + 64 + 2 * args.page_size)
    cache = model.cache_config(
        page_size=args.page_size,
        full_capacity=-(-tokens // args.page_size) * args.page_size,
        swa_capacity=(args.batch * 4 + 16) * args.page_size + 2048,
    )
    runner = Runner(model, cache, device=args.device, chunk_tokens=2048, max_running=args.batch)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_new_tokens=args.steps + 8)
    for _ in range(args.batch):
        runner.submit(rng.integers(0, 256, args.prompt_len).tolist(), params)
    t0 = time.perf_counter()
    while runner.num_prefilling:  # until every request decodes
        runner.step()
    for _ in range(3):  # graph capture and warm-up
        runner.step()
    prefill_s = time.perf_counter() - t0
    walls, fwds = [], []
    for _ in range(args.steps):
        f0, w0 = runner.stats.forward_s, time.perf_counter()
        runner.step()
        walls.append(time.perf_counter() - w0)
        fwds.append(runner.stats.forward_s - f0)
    wall, fwd = float(np.median(walls)), float(np.median(fwds))
    row = {
        "model": model.name,
        "device": str(runner.device),
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "graphs": runner.decoder is not None,
        "step_ms": wall * 1e3,
        "forward_ms": fwd * 1e3,
        "host_ms": (wall - fwd) * 1e3,
        "host_share": 1 - fwd / wall,
        "tokens_per_s": args.batch / wall,
        "prefill_and_warmup_s": prefill_s,
    }
    print(json.dumps(row, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=1))
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
