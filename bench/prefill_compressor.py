"""Paged prefill with the Flash Compressor versus the PyTorch compression chain, same process.

Runs the runner's prefill (one generated token, so no decode forward) over ``--requests`` cold
prompts of ``--prompt-len`` tokens twice per repeat: with
``adapters.forward.paged.USE_PREFILL_KERNEL``
on and off. Prints the best prefill forward time of each, the ratio, and the largest difference
between the two runs' first-token logits (the kernel accumulates in fp32 like the chain; the
difference is rounding). Needs CUDA for the kernel arm.

    python bench/prefill_compressor.py --model flash-shaped --prompt-len 8192 --requests 4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapters.engine.runner import Runner  # noqa: E402
from adapters.engine.sampling import SamplingParams  # noqa: E402
from adapters.forward import paged  # noqa: E402
from adapters.model.model_config import preset  # noqa: E402
from adapters.model.weights import init_weights  # noqa: E402


def prefill(model, weights, prompts, chunk: int, page: int) -> tuple[float, torch.Tensor]:
    total = sum(len(p) for p in prompts) + 2 * len(prompts) * page
    cc = model.cache_config(
        page_size=page, full_capacity=total * 2, swa_capacity=(chunk + 4 * page) * len(prompts)
    )
    runner = Runner(model, cc, weights=weights, chunk_tokens=chunk, max_running=len(prompts))
    first: list[torch.Tensor] = []
    runner.on_logits = lambda results, logits: first.append(logits.float().cpu())
    runner.generate(prompts, SamplingParams(max_new_tokens=1))
    return runner.stats.forward_s, torch.cat(first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="flash-shaped")
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--chunk-tokens", type=int, default=8192)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA (the kernel arm)")
    model = preset(args.model)
    weights = init_weights(model, "cuda", torch.bfloat16)
    rng = np.random.default_rng(0)
    best = {True: float("inf"), False: float("inf")}
    logits: dict[bool, torch.Tensor] = {}
    for rep in range(args.repeats + 1):  # the first round warms up
        prompts = [rng.integers(0, 256, args.prompt_len).tolist() for _ in range(args.requests)]
        for fused in (True, False):
            paged.USE_PREFILL_KERNEL = fused
            t, first = prefill(model, weights, prompts, args.chunk_tokens, args.page_size)
            if rep:
                best[fused] = min(best[fused], t)
            logits[fused] = first
    diff = float((logits[True] - logits[False]).abs().max())
    tokens = args.requests * args.prompt_len
    print(f"prefill {args.requests} x {args.prompt_len} tokens, {args.model}, bf16, chunks of "
          f"{args.chunk_tokens}: Flash Compressor {best[True]:.4f} s "
          f"({tokens / best[True]:,.0f} tok/s), PyTorch chain {best[False]:.4f} s "
          f"({tokens / best[False]:,.0f} tok/s), speed-up {best[False] / best[True]:.2f}x; "
          f"max |first-token logit diff| {diff:.3e}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(
            json.dumps(dict(vars(args), fused_s=best[True], torch_s=best[False], logit_diff=diff))
        )


if __name__ == "__main__":
    main()
