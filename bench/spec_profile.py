"""Where a speculative decode step's time goes, against a plain decode step (GPU).

One request (``--batch``) of a held-out prompt decodes ``--new-tokens`` greedily, plain and with
the MTP layer drafting ``--k`` tokens, under `torch.profiler` (CPU and CUDA activities; kernels
inside CUDA graphs are traced too). Per decode step (the runner's steps after the prefill):

* ``wall_ms``: host wall time of the step;
* ``gpu_ms``: the summed duration of the CUDA kernels and copies the step ran;
* ``kernels``: how many kernels it launched (in graphs or not);
* ``tokens``: tokens emitted per step (1 plain; the acceptance length with speculation).

``wall_ms - gpu_ms`` bounds the host time the GPU did not hide; ``kernels`` says how
launch-bound a step of this tiny model is. The top kernels by total time are printed for each.

    python bench/spec_profile.py --k 2 --json bench/results/spec_profile_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from adapters.engine.runner import Runner  # noqa: E402
from adapters.engine.sampling import SamplingParams  # noqa: E402
from adapters.model.model_config import preset  # noqa: E402
from adapters.model.tokenizer import BOS  # noqa: E402
from adapters.model.weights_file import load_shipped  # noqa: E402
from bench.meta import run_meta  # noqa: E402
from bench.quality import default_data, heldout_docs  # noqa: E402


def make_runner(model, weights, args, k: int | None) -> Runner:
    p = 64
    full = -(-4 * (args.prompt_len + args.new_tokens + 4 * p) * args.batch // p) * p
    cache = model.cache_config(page_size=p, full_capacity=full, swa_capacity=full,
                               speculative=k is not None)  # fmt: skip
    return Runner(model, cache, device=weights.device, dtype=weights.dtype, weights=weights,
                  chunk_tokens=1024, max_running=args.batch, speculative_tokens=k)  # fmt: skip


def prefill(runner: Runner, prompts: list[list[int]], new_tokens: int) -> int:
    """Submits the prompts and steps until every one has its first token; returns the decode
    tokens counted so far."""
    params = SamplingParams(max_new_tokens=new_tokens)
    for p in prompts:
        runner.submit(p, params)
    while runner.num_prefilling or runner.stats.decode_tokens == 0:
        runner.step()
    torch.cuda.synchronize()
    return runner.stats.decode_tokens


def decode(runner: Runner, before: int) -> tuple[int, int]:
    """Steps to completion; returns (decode steps, tokens they emitted)."""
    steps = 0
    while runner.num_pending:
        runner.step()
        steps += 1
    torch.cuda.synchronize()
    return steps, runner.stats.decode_tokens - before


def profiled(runner: Runner, prompts, new_tokens: int, top: int) -> dict:
    decode(runner, prefill(runner, prompts, new_tokens))  # warm: graphs captured
    before = prefill(runner, prompts, new_tokens)
    t0 = time.perf_counter()
    steps, tokens = decode(runner, before)  # timed without the profiler
    wall = time.perf_counter() - t0
    before = prefill(runner, prompts, new_tokens)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        psteps, _ = decode(runner, before)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.device_time for e in events)
    by_name: dict[str, float] = {}
    for e in events:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.device_time
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return dict(
        steps=steps,
        tokens_per_step=tokens / max(1, steps),
        wall_ms=1e3 * wall / max(1, steps),
        gpu_ms=1e-3 * gpu_us / max(1, psteps),
        kernels=len(events) / max(1, psteps),
        top=[(name[:80], round(1e-3 * us / max(1, psteps), 4)) for name, us in ranked],
    )


def host_profile(runner: Runner, prompts, new_tokens: int, top: int = 30) -> None:
    """cProfile of one warm speculative decode: where the host time of a step goes."""
    import cProfile
    import pstats

    decode(runner, prefill(runner, prompts, new_tokens))  # warm
    before = prefill(runner, prompts, new_tokens)
    prof = cProfile.Profile()
    prof.enable()
    steps, _ = decode(runner, before)
    prof.disable()
    print(f"host profile over {steps} speculative decode steps (cumulative, then own time):")
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--host-profile", action="store_true",
                    help="also print cProfile's top host functions of the speculative decode")
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.device("cuda")
    model = preset("tiny-trained")
    weights = load_shipped(model, device, torch.bfloat16)
    docs = heldout_docs(default_data(), args.batch, args.prompt_len)
    prompts = [[BOS, *d] for d in docs]
    rows = {}
    for name, k in (("plain", None), (f"mtp k={args.k}", args.k)):
        rows[name] = profiled(make_runner(model, weights, args, k), prompts, args.new_tokens,
                              args.top)  # fmt: skip
        r = rows[name]
        print(f"{name}: {r['steps']} decode steps, {r['tokens_per_step']:.2f} tokens/step, "
              f"wall {r['wall_ms']:.3f} ms/step, GPU {r['gpu_ms']:.3f} ms/step, "
              f"{r['kernels']:.0f} kernels/step", flush=True)  # fmt: skip
        for kname, ms in r["top"]:
            print(f"    {ms:8.4f} ms  {kname}")
    ms_per_token = {n: r["wall_ms"] / r["tokens_per_step"] for n, r in rows.items()}
    if args.host_profile:
        host_profile(make_runner(model, weights, args, args.k), prompts, args.new_tokens)
    speedup = ms_per_token["plain"] / ms_per_token[f"mtp k={args.k}"]
    print(f"speed-up (ms per token): {speedup:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(meta=run_meta(), rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
