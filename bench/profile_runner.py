"""Where a long real prompt's prefill and decode time goes (GPU): torch.profiler + cProfile.

Warms up on a short prompt (kernel compiles), then profiles ``--profile-chunks`` prefill steps
and ``--decode-steps`` decode steps of one ``--context``-token prompt through the runner, and
prints the top ops by CUDA time and the top host functions by cumulative time.

    python bench/profile_runner.py --context 131072 --out profile_dir
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapters.engine.sampling import SamplingParams  # noqa: E402
from adapters.memory.formats import CacheFormat  # noqa: E402
from adapters.model.model_config import preset  # noqa: E402
from adapters.model.tokenizer import ByteTokenizer  # noqa: E402
from adapters.model.weights import init_weights  # noqa: E402
from bench.long_context import corpus, make_runner  # noqa: E402
from bench.meta import run_meta  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _steps(runner, n: int) -> list[float]:
    times = []
    for _ in range(n):
        _sync()
        t0 = time.perf_counter()
        runner.step()
        _sync()
        times.append(time.perf_counter() - t0)
    return times


def profiled(runner, n: int, label: str, out: Path) -> None:
    prof = cProfile.Profile()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as tp:
        prof.enable()
        times = _steps(runner, n)
        prof.disable()
    print(f"== {label}: step ms {[round(t * 1e3, 1) for t in times]}", flush=True)
    averages = tp.key_averages()
    table = averages.table(sort_by="self_cuda_time_total", row_limit=100)
    gpu_ms = sum(e.self_device_time_total for e in averages) / 1e3 / max(n, 1)
    print(f"== {label}: GPU ms a step (self device time, all kernels) {gpu_ms:.3f}", flush=True)
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(45)
    (out / f"{label}_cuda.txt").write_text(table)
    (out / f"{label}_host.txt").write_text(s.getvalue())
    print(table[:6000], flush=True)
    print(s.getvalue()[:7000], flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--profile-chunks", type=int, default=2)
    ap.add_argument("--decode-steps", type=int, default=6)
    ap.add_argument(
        "--batch",
        type=int,
        default=0,
        help="profile the decode of this many requests sharing the prompt instead",
    )
    ap.add_argument("--out", default="profile")
    ap.add_argument("--model", default="flash-shaped")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kv-format", default="bf16", choices=("bf16", "fp8"),
                    help="format of the window KV and the indexer keys")  # fmt: skip
    args = ap.parse_args()
    fmt = CacheFormat[args.kv_format.upper()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(run_meta(), flush=True)
    model = preset(args.model)
    weights = init_weights(
        model, args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    )
    data = corpus(None, args.context + 64 * (args.batch + 1))
    warm = make_runner(model, weights, 4096, 0, 8, args.chunk, fmt)
    warm.generate([[ByteTokenizer.bos] + list(data[:4095])], SamplingParams(max_new_tokens=8))
    del warm
    runner = make_runner(model, weights, args.context, args.batch, 64, args.chunk, fmt)
    prompt = [ByteTokenizer.bos] + list(data[: args.context - 1])
    first = 2 if args.batch else 64  # with --batch the prompt is only the shared prefix
    runner.submit(prompt, SamplingParams(max_new_tokens=first))
    chunks = -(-args.context // args.chunk)
    lead = _steps(runner, chunks - args.profile_chunks - 1)
    print(f"prefill steps ms {[round(t * 1e3, 1) for t in lead]}", flush=True)
    if args.profile_chunks:
        profiled(runner, args.profile_chunks, "prefill", out)
    if args.batch:  # the batch reuses the whole prompt only once its first request finished
        while runner._running or runner._waiting:
            runner.step()
    for i in range(args.batch):
        tail = list(data[args.context + 64 * i : args.context + 64 * (i + 1)])
        runner.submit(prompt + tail, SamplingParams(max_new_tokens=64))
    rest = _steps(runner, 1 + 12)  # last chunk(s), then decode (graph capture happens here)
    print(f"last chunk + decode warm ms {[round(t * 1e3, 1) for t in rest]}", flush=True)
    profiled(runner, args.decode_steps, f"decode_b{max(args.batch, 1)}", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
