"""Host overhead of the runner's decode steps, serialised and with overlap scheduling (#14 item 3).

Submits ``--batch`` prompts of ``--prompt-len`` random tokens, runs until every request decodes,
warms up, then times ``--steps`` decode-only ``Runner.step()`` calls. Per step:

* ``wall``: the duration of one ``step()`` call (in steady state, overlapped or not, one call
  per device step);
* ``gpu``: the device time of the decode step, from CUDA events recorded around its graph
  replay (`GraphDecoder._replay`); on the CPU the host time of the eager forward (no
  asynchrony there, so the CPU figures only check that the script runs);
* ``host share = 1 - gpu / wall``: the part of a step the device waits for the host. Serialised,
  that is every host instruction of the step; overlapped, only what the host could not hide.
  ``gpu idle share`` is measured on the device alone: ``1 - sum(gpu) / span``, with ``span`` from
  the first step's start event to the last step's end event (the bubbles between steps).

``--overlap both`` interleaves the two modes (one runner each, the same prompts, the order
alternating) for ``--reps`` repetitions and reports the median of each figure over them; it
also checks that both modes produced the same tokens. The JSON result records its meta
(`bench.meta`: commit, command, machine, date).

    python bench/runner_overhead.py --batch 32 --prompt-len 4096 --steps 50 --overlap both \
        --json bench/results/runner_overlap_h200_b32.json
    python bench/runner_overhead.py --device cpu --model tiny --batch 4 --prompt-len 64 \
        --steps 8 --page-size 16 --overlap both          # runs anywhere, in seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapters.engine.runner import Runner  # noqa: E402
from adapters.engine.sampling import SamplingParams  # noqa: E402
from adapters.model.model_config import ModelConfig, preset  # noqa: E402
from adapters.model.weights import ModelWeights, init_weights  # noqa: E402
from bench.meta import run_meta  # noqa: E402

WARMUP_STEPS = 3  # graph capture of the batch's buckets, allocator warm-up


def build(args, model: ModelConfig, weights: ModelWeights, dtype, overlap: bool) -> Runner:
    """A fresh runner (an empty cache) with pools for one repetition: nothing is evicted or
    preempted."""
    p = args.page_size
    tokens = args.batch * (args.prompt_len + max_new_tokens(args) + 2 * p)
    cache = model.cache_config(
        page_size=p,
        full_capacity=-(-tokens // p) * p,
        swa_capacity=(args.batch * 4 + 16) * p + args.chunk_tokens + model.window,
    )
    return Runner(model, cache, device=args.device, dtype=dtype, weights=weights,
                  chunk_tokens=args.chunk_tokens, max_running=args.batch, graph_decode=True,
                  overlap=overlap)  # fmt: skip


def max_new_tokens(args) -> int:
    """Enough tokens that no request finishes before the timed steps end: the first request
    decodes while the others are prefilled (at most one step per chunk, plus one each)."""
    prefill_steps = -(-args.batch * args.prompt_len // args.chunk_tokens) + args.batch
    return prefill_steps + WARMUP_STEPS + args.steps + 2


class DeviceTimer:
    """CUDA events around every graph replay of a runner's decoder (on the CPU, where nothing
    is captured, the host time of every eager decode forward)."""

    def __init__(self, runner: Runner) -> None:
        decoder = runner.decoder
        assert decoder is not None
        self.cuda = decoder.use_graphs
        self.marks: list[tuple] = []
        name = "_replay" if self.cuda else "_run"
        inner = getattr(decoder, name)

        def timed(batch: int, context: int):
            start = torch.cuda.Event(enable_timing=True) if self.cuda else time.perf_counter()
            if self.cuda:
                start.record()
            out = inner(batch, context)
            end = torch.cuda.Event(enable_timing=True) if self.cuda else time.perf_counter()
            if self.cuda:
                end.record()
            self.marks.append((start, end))
            return out

        setattr(decoder, name, timed)

    def seconds(self) -> tuple[list[float], float]:
        """Each marked step's device time and the span from the first start to the last end
        (waits for the device)."""
        if not self.cuda:
            return [e - s for s, e in self.marks], self.marks[-1][1] - self.marks[0][0]
        torch.cuda.synchronize()
        busy = [s.elapsed_time(e) / 1e3 for s, e in self.marks]
        return busy, self.marks[0][0].elapsed_time(self.marks[-1][1]) / 1e3


def measure(args, runner: Runner, prompts: list[list[int]]) -> tuple[dict, list[list[int]]]:
    """One repetition on ``runner``: the per-step figures and every request's output."""
    params = SamplingParams(max_new_tokens=max_new_tokens(args))
    ids = [runner.submit(p, params) for p in prompts]
    t0 = time.perf_counter()
    results = []
    while runner.num_prefilling:  # until every request decodes
        results += runner.step()
    for _ in range(WARMUP_STEPS):
        results += runner.step()
    prefill_s = time.perf_counter() - t0
    timer = DeviceTimer(runner)  # the timed steps only
    walls, batches, f0 = [], [], runner.stats.forward_s
    for _ in range(args.steps):
        w0 = time.perf_counter()
        results += runner.step()
        walls.append(time.perf_counter() - w0)
        batches.append(len(runner._running))
    busy, span = timer.seconds()
    forward = (runner.stats.forward_s - f0) / args.steps
    results += runner.run()  # the rest, untimed
    outputs = {r.request_id: r.output for r in results}
    wall, gpu = statistics.median(walls), statistics.median(busy)
    row = {
        "overlap": runner.overlap,
        "step_ms": wall * 1e3,
        "gpu_ms": gpu * 1e3,
        "host_share": 1 - gpu / wall,
        "gpu_idle_share": 1 - sum(busy) / span,
        "host_forward_ms": forward * 1e3,  # serialised: launch + sync; overlapped: launch only
        "tokens_per_s": args.batch / wall,
        "decode_batch": [min(batches), max(batches)],
        "prefill_and_warmup_s": prefill_s,
    }
    return row, [outputs[i] for i in ids]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="flash-shaped")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--chunk-tokens", type=int, default=2048)
    ap.add_argument("--overlap", choices=("on", "off", "both"), default="both")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (median reported)")
    ap.add_argument("--json", help="write the result (meta, config, rows, summary) here")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.steps < 1 or args.batch < 1:
        ap.error("--reps, --steps and --batch must be >= 1")
    meta = run_meta()  # before the runs: the commit that was imported
    out = {"meta": meta, **run(args, preset(args.model))}
    for name, s in out["summary"].items():
        print(f"overlap {name:3}: step {s['step_ms']:.3f} ms, gpu {s['gpu_ms']:.3f} ms, host "
              f"share {100 * s['host_share']:.1f} %, gpu idle {100 * s['gpu_idle_share']:.1f} "
              f"%, {s['tokens_per_s']:,.0f} tokens/s")  # fmt: skip
    print(f"outputs identical across modes: {out['outputs_identical']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if out["outputs_identical"] else 1


def run(args, model: ModelConfig) -> dict:
    """The repetitions of every mode asked for: config, rows, per-mode medians, and whether
    the modes' outputs agreed."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    weights = init_weights(model, device, dtype)
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.overlap]
    rows, identical, paths = [], True, {}
    for rep in range(args.reps):
        rng = np.random.default_rng(rep)
        prompts = [rng.integers(0, 256, args.prompt_len).tolist() for _ in range(args.batch)]
        outputs = []
        for mode in modes if rep % 2 == 0 else modes[::-1]:  # interleaved, order alternating
            runner = build(args, model, weights, dtype, mode)
            row, out = measure(args, runner, prompts)
            rows.append({"rep": rep, **row})
            outputs.append(out)
            paths["on" if mode else "off"] = str(runner.paths)
            del runner
            if device.type == "cuda":
                torch.cuda.empty_cache()
        identical &= all(o == outputs[0] for o in outputs)
    summary = {}
    for mode in modes:
        mine = [r for r in rows if r["overlap"] == mode]
        keys = ("step_ms", "gpu_ms", "host_share", "gpu_idle_share", "tokens_per_s")
        summary["on" if mode else "off"] = {k: statistics.median(r[k] for r in mine) for k in keys}
    config = {**vars(args), "model": model.name, "dtype": str(dtype), "paths": paths}
    return {"config": config, "rows": rows, "summary": summary, "outputs_identical": identical}


if __name__ == "__main__":
    raise SystemExit(main())
