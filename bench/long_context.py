"""Real long prompts through the runner (GPU): prefill, time to first token, decode, memory.

Every prompt is real text tokenized by the runner's byte tokenizer — no synthetic pool fill:
by default the Python standard library's own sources (this interpreter's, sorted by path,
concatenated; the prompt's sha256 is recorded), or ``--file``. For each context length:

* one request of that many prompt tokens: prefill tokens/s, time to first token, then batch-1
  decode tokens/s (CUDA graphs; the median step, so graph captures do not count; the wall rate
  with them is ``decode_wall_tokens_per_s``) and its ratio to the first (shortest) length;
* with ``--batch B``: B requests sharing that prompt as a prefix (it is cached by the first
  request, so the others reuse it) plus a distinct 64-byte tail each, then batch-B decode
  tokens/s and its ratio to the shortest length's;
* the peak GPU memory of the point (``torch.cuda.max_memory_allocated``) and what the runner's
  step-memory model predicted for its largest step.

``--paths torch`` times the tiled torch references instead of the Triton indexer and attention
kernels (``--paths both``: side by side in one process). ``--warm`` first prefills a different
prompt of each length (``warmup_ttft_s``), so the measured TTFT is an engine's after warm-up,
without kernel compiles (``triton_compiles`` counts those of the measured prompt).

    python bench/long_context.py --contexts 4096,32768,131072 --batch 32 --json out.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import adapters.kernels as kernels  # noqa: E402
from adapters.engine.runner import Runner  # noqa: E402
from adapters.engine.sampling import SamplingParams  # noqa: E402
from adapters.memory.formats import CacheFormat  # noqa: E402
from adapters.model.model_config import preset  # noqa: E402
from adapters.model.tokenizer import ByteTokenizer  # noqa: E402
from adapters.model.weights import init_weights  # noqa: E402
from bench.compile_watch import CompileWatch  # noqa: E402
from bench.meta import run_meta  # noqa: E402

TAIL = 64


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def corpus(path: str | None, need: int) -> bytes:
    """At least ``need`` bytes of real text: ``path``, or the standard library's sources."""
    if path:
        data = Path(path).read_bytes()
    else:
        parts, size = [], 0
        for f in sorted(Path(os.__file__).parent.rglob("*.py")):
            parts.append(f.read_bytes())
            size += len(parts[-1])
            if size >= need + 64 * TAIL:
                break
        data = b"".join(parts)
    if len(data) < need + 64 * TAIL:
        raise SystemExit(f"the corpus has {len(data)} bytes; {need} are needed")
    return data


def make_runner(
    model, weights, context: int, batch: int, new: int, chunk: int, fmt: CacheFormat
) -> Runner:
    """A runner whose full pool could hold every request unshared: admission control
    (`Runner._fits`) counts a request's whole length, not what it reuses; the prompt is
    still stored once and reused (``prefill_tokens`` shows it)."""
    page = 64
    per = -(-(context + TAIL + new + 2 * page) // page) * page
    full = (batch + 1) * per
    swa = chunk + model.window + (batch + 4) * 4 * page
    cc = model.cache_config(page_size=page, full_capacity=full, swa_capacity=swa)
    return Runner(model, cc, device=weights.device, dtype=weights.dtype, weights=weights,
                  chunk_tokens=chunk, max_running=max(batch, 1),
                  index_format=fmt, swa_format=fmt)  # fmt: skip


def prefill_point(runner: Runner, prompt: list[int], new: int) -> dict[str, float]:
    """One request: time to first token, then the decode of the rest."""
    _sync()
    t0 = time.perf_counter()
    rid = runner.submit(prompt, SamplingParams(max_new_tokens=new))
    steps, first, done, times = 0, None, None, []
    while done is None:
        t1 = time.perf_counter()
        results = runner.step()
        steps += 1
        out = runner._running[0].result.output if runner._running else []
        if first is None and (out or results):
            _sync()
            first = time.perf_counter()
        elif first is not None:
            _sync()
            times.append(time.perf_counter() - t1)  # one decode step: one token
        done = next((r for r in results if r.request_id == rid), None)
    _sync()
    end = time.perf_counter()
    assert first is not None and len(done.output) == new, done
    # steady state: the median step (the first decode steps capture CUDA graphs)
    return dict(ttft_s=first - t0, prefill_tokens_per_s=len(prompt) / (first - t0),
                decode_tokens_per_s=1 / statistics.median(times) if times else None,
                decode_wall_tokens_per_s=(new - 1) / (end - first), steps=steps)  # fmt: skip


def batch_point(runner: Runner, prompt: list[int], data: bytes, batch: int, new: int) -> dict:
    """``batch`` requests reusing the cached prompt, decoding together."""
    tails = [
        list(data[len(prompt) + i * TAIL : len(prompt) + (i + 1) * TAIL]) for i in range(batch)
    ]
    ids = [runner.submit(prompt + t, SamplingParams(max_new_tokens=new)) for t in tails]
    times: list[float] = []
    left = set(ids)
    while left:
        before = runner.stats.decode_tokens
        _sync()
        t0 = time.perf_counter()
        for r in runner.step():
            left.discard(r.request_id)
        _sync()
        if runner.stats.decode_tokens - before == batch:
            times.append(time.perf_counter() - t0)
    if not times:
        raise RuntimeError(f"no step decoded all {batch} requests together: raise --new-tokens")
    steady = sorted(times)[: max(1, len(times) - 2)]  # drop the slowest (graph capture)
    return dict(batch_decode_tokens_per_s=batch / statistics.median(times),
                batch_decode_mean_tokens_per_s=batch * len(steady) / sum(steady),
                batch_decode_steps=len(times))  # fmt: skip


def point(args, model, weights, data: bytes, context: int, kv_format: str) -> dict:
    prompt = [ByteTokenizer.bos] + list(data[: context - 1])  # the tokenizer's bytes
    cuda = weights.device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    fmt = CacheFormat[kv_format.upper()]
    runner = make_runner(model, weights, context, args.batch, args.new_tokens, args.chunk, fmt)
    digest = hashlib.sha256(bytes(t for t in prompt if t < 256)).hexdigest()[:16]
    row: dict[str, object] = dict(kv_format=kv_format, context=len(prompt), sha256=digest)
    if args.warm:  # a different prompt of the same length first, through a runner of the same
        # pools (Triton specialises on their sizes): the kernels it compiles stay compiled
        other = [ByteTokenizer.bos] + list(data[context : 2 * context - 1])
        warm = make_runner(model, weights, context, args.batch, args.new_tokens, args.chunk, fmt)
        row["warmup_ttft_s"] = prefill_point(warm, other, 2)["ttft_s"]
        del warm
    seen = len(args.watch.events) if args.watch else 0
    row.update(prefill_point(runner, prompt, args.new_tokens))
    if args.watch:
        new = args.watch.events[seen:]
        row["triton_compiles"] = len(new)
        row["triton_compile_s"] = sum(e[3] for e in new)
    if args.batch:
        row.update(batch_point(runner, prompt, data, args.batch, args.new_tokens))
    row["prefill_tokens"] = runner.stats.prefill_tokens  # the batch's reuse shows here
    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    step = runner.memory.memory.peak(args.chunk, sum(len(prompt) // r for r in model.ratios))
    row["predicted_step_gib"] = step / 2**30
    row["budget_gib"] = (runner.memory.budget or 0) / 2**30
    del runner
    return row


def _row(args, model, weights, data, context: int, kv_format: str, path: str) -> dict:
    try:
        return dict(path=path, **point(args, model, weights, data, context, kv_format))
    except torch.OutOfMemoryError as exc:
        return dict(path=path, kv_format=kv_format, context=context,
                    error=f"OutOfMemoryError: {exc}"[:300])  # fmt: skip


def _ratios(rows: list[dict], shortest: int) -> None:
    """Each row against the shortest length's row of its path and format (decode, batch), and
    an fp8 row against the bf16 row of its length and path (``fp8_over_bf16``)."""
    ok = [r for r in rows if "error" not in r]
    first = {(r["path"], r["kv_format"]): r for r in ok if r["context"] == shortest}
    bf16 = {(r["path"], r["context"]): r for r in ok if r["kv_format"] == "bf16"}
    for r in ok:
        base = first.get((r["path"], r["kv_format"]))
        for key, ratio in (("decode_tokens_per_s", "decode_ratio_to_first"),
                           ("batch_decode_tokens_per_s", "batch_ratio_to_first")):  # fmt: skip
            if base and r.get(key) and base.get(key):
                r[ratio] = r[key] / base[key]
        other = bf16.get((r["path"], r["context"]))
        if r["kv_format"] == "fp8" and other:
            r["fp8_over_bf16"] = {
                k: r[k] / other[k]
                for k in (
                    "decode_tokens_per_s",
                    "batch_decode_tokens_per_s",
                    "prefill_tokens_per_s",
                )
                if r.get(k) and other.get(k)
            }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--model", default="flash-shaped")
    ap.add_argument("--batch", type=int, default=0, help="also decode this many requests")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--file", default=None, help="prompt text (default: the stdlib sources)")
    ap.add_argument("--paths", default="kernels", help="kernels, torch or both")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--warm",
        action="store_true",
        help="prefill a different prompt of each length first (an engine warmed up at start): "
        "TTFT without kernel compiles; its own TTFT is warmup_ttft_s",
    )
    ap.add_argument(
        "--kv-format",
        default="bf16",
        help="format of the window KV and the indexer keys: bf16, fp8, or bf16,fp8 (side by "
        "side at every length; fp8_over_bf16 in each fp8 row)",
    )
    ap.add_argument("--device", default="cuda", help="cuda (bf16) or cpu (fp32, a smoke run)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU, or --device cpu --model tiny for a smoke run")
        return 2
    formats = args.kv_format.split(",")  # checked before the weights are built (seconds)
    if any(f not in ("bf16", "fp8") for f in formats):
        raise SystemExit(f"--kv-format: bf16, fp8 or bf16,fp8, not {args.kv_format!r}")
    if args.paths not in ("kernels", "torch", "both"):
        raise SystemExit(f"--paths: kernels, torch or both, not {args.paths!r}")
    contexts = [int(c) for c in args.contexts.split(",")]
    need = max(contexts) * (2 if args.warm else 1)
    data = corpus(args.file, need + (args.batch + 1) * TAIL)
    model = preset(args.model)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    weights = init_weights(model, args.device, dtype)
    args.watch = CompileWatch.install() if args.device == "cuda" else None
    out = dict(meta=run_meta(), rows=[])
    print(json.dumps(out["meta"]), flush=True)
    paths = ["kernels", "torch"] if args.paths == "both" else [args.paths]
    for context in contexts:
        for path in paths:
            for kv_format in formats:
                kernels.SPARSE_KERNELS = path == "kernels"
                out["rows"].append(_row(args, model, weights, data, context, kv_format, path))
                print(json.dumps(out["rows"][-1]), flush=True)
    _ratios(out["rows"], contexts[0])
    if args.watch:
        print(args.watch.summary(), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
