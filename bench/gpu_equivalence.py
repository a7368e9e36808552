"""End-to-end equivalence on a device: the runner against the dense reference forward.

Checks, on ``--device`` (default cuda), in fp64 and fp32:
* paged chunked prefill logits versus ``reference_logits`` (max abs difference), for lengths
  crossing 4/8/128/256/512 with odd chunk sizes;
* the runner's greedy tokens (shared prefixes, waves, chunked prefill, batched graph decode,
  tiny pools so eviction and preemption happen) versus ``reference_generate``.
Prints one line per check and exits non-zero on any failure.

    python bench/gpu_equivalence.py --device cuda [--model tiny-shared]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapters.engine.runner import Runner  # noqa: E402
from adapters.engine.sampling import SamplingParams  # noqa: E402
from adapters.forward.paged import build_step, run_step  # noqa: E402
from adapters.memory.pools import KVPools  # noqa: E402
from adapters.model.model_config import preset  # noqa: E402
from adapters.model.reference import reference_generate, reference_logits  # noqa: E402
from adapters.model.weights import init_weights  # noqa: E402
from shadowradix import ShadowRadixCache  # noqa: E402

SMALL = dict(
    hidden=64,
    num_heads=2,
    head_dim=32,
    rope_dim=8,
    index_dim=16,
    index_heads=2,
    index_topk=8,
    mlp_hidden=96,
)
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-3}


def prefill_diff(model, weights, device, dtype, length: int, chunk: int, page: int) -> float:
    cc = model.cache_config(
        page_size=page,
        full_capacity=page * (length // page + 4),
        swa_capacity=page * ((chunk + 256) // page + 4),
        debug=True,
    )
    cache, pools = ShadowRadixCache(cc), KVPools(model, cc, device, dtype)
    prompt = np.random.default_rng(length).integers(0, 256, length)
    r = cache.admit(prompt)
    outs = []
    while len(r.prompt_remaining):
        toks = r.prompt_remaining[:chunk]
        start = r.length
        alloc = cache.extend(r, toks)
        step = build_step(model, alloc, [cache.read_plan(r, start=start)], toks, device)
        outs.append(run_step(weights, pools, step, None))
    ref = reference_logits(weights, prompt.tolist())
    return float((torch.cat(outs) - ref).abs().max())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtypes", default="float64,float32", help="comma-separated torch dtypes")
    ap.add_argument("--model", default="tiny", help="tiny, or tiny-shared (V4.1 sharing)")
    args = ap.parse_args()
    failures = 0
    model = preset(args.model, **SMALL)
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        weights = init_weights(model, args.device, dtype)
        for length, chunk, page in (
            (5, 3, 4),
            (9, 4, 4),
            (129, 37, 16),
            (257, 100, 64),
            (513, 77, 16),
            (600, 600, 64),
        ):
            d = prefill_diff(model, weights, args.device, dtype, length, chunk, page)
            ok = d <= TOLERANCE[dtype]
            failures += not ok
            print(
                f"prefill {str(dtype):14} len {length:4} chunk {chunk:3} page {page:2}: "
                f"max |logit diff| {d:.3e} {'ok' if ok else 'FAIL'}",
                flush=True,
            )
        for graphs, hisparse in ((False, None), (True, None), (False, 12)):
            t0 = time.perf_counter()
            agree, total, hits, pre = generate_check(
                model, weights, args.device, dtype, graphs, hisparse
            )
            ok = agree == total
            failures += not ok
            mode = f"hisparse={hisparse}" if hisparse else f"graphs={graphs!s:5}"
            print(
                f"runner  {str(dtype):14} {mode}: greedy agreement {agree}/{total}"
                f" requests, hit tokens {hits}, preemptions {pre} "
                f"({time.perf_counter() - t0:.1f} s) {'ok' if ok else 'FAIL'}",
                flush=True,
            )
    print("FAILURES" if failures else "all checks passed", failures)
    return 1 if failures else 0


def generate_check(
    model, weights, device, dtype, graphs: bool, hisparse: int | None = None
) -> tuple[int, int, int, int]:
    """Greedy outputs of the runner versus the reference, request by request."""
    rng = np.random.default_rng(7)
    system = rng.integers(0, 256, 300).tolist()
    prompts = [system + rng.integers(0, 256, int(n)).tolist() for n in rng.integers(1, 230, 10)]
    prompts += [rng.integers(0, 256, int(n)).tolist() for n in (3, 4, 5, 127, 129)]
    cc = model.cache_config(page_size=16, full_capacity=16 * 110, swa_capacity=16 * 40, debug=True)
    runner = Runner(
        model,
        cc,
        device=device,
        dtype=dtype,
        weights=weights,
        chunk_tokens=77,
        max_running=6,
        graph_decode=graphs,
        hisparse_pages=hisparse,  # a buffer of 12 pages of 4 C4 entries: constant swap-ins
    )
    params = SamplingParams(max_new_tokens=10)
    results = runner.generate(prompts[:1], params) + runner.generate(prompts[1:], params)
    agree = sum(
        res.output == reference_generate(weights, p, len(res.output))
        for p, res in zip(prompts, results)
    )
    hits = runner.cache.stats().hit_tokens
    runner.cache.check_invariants()
    return agree, len(prompts), hits, runner.stats.preemptions


if __name__ == "__main__":
    raise SystemExit(main())
