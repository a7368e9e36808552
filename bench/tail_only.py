"""Decoder-side tail-only prefill versus the exact prefill on the same shared model, and the
memory V4.1 cross-layer sharing saves per cached token (docs/sharing.md).

Two runners over the same weights, each with a cold cache (distinct random prompts, so no
prefix is reused): the exact one, and ``tail_only=True`` (the layers after the last KV-source
layer compute only the last ``window`` tokens of each chunk). Measured:

* prefill speed-up: time of the prefill forwards (``RunnerStats.forward_s`` with one generated
  token, so no decode forward runs), exact / tail-only, best of ``--repeats`` cold runs after a
  warm-up;
* divergence from the exact prefill: the max |logit difference| at the last prompt position,
  and greedy agreement over ``--decode-tokens`` decoded tokens (tokens equal up to the first
  difference, and position-wise). ``noise`` is the same logit difference between two exact
  prefills with different chunk sizes: the rounding floor of the dtype, for scale;
* memory per cached token (compressed KV + indexer keys) and per SWA token, shared versus
  the same layers unshared, for the ``tiny-shared`` and ``flash-shared`` presets.

    python bench/tail_only.py                                   # CPU, tiny-shared
    python bench/tail_only.py --model flash-shared --device cuda --prompt-len 8192 \\
        --requests 4 --chunk-tokens 8192 --json bench/results/tail_only_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapters.engine.runner import GenerationResult, Runner  # noqa: E402
from adapters.engine.sampling import SamplingParams  # noqa: E402
from adapters.memory.device import resolve_device  # noqa: E402
from adapters.memory.pools import bytes_per_token  # noqa: E402
from adapters.model.model_config import ModelConfig, preset  # noqa: E402
from adapters.model.weights import ModelWeights, init_weights  # noqa: E402


class LogitTap(Runner):
    """A runner that keeps the logits each request's first token was sampled from."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.first_logits: dict[int, torch.Tensor] = {}
        self._emit_all = self.emission.emit_all
        self.emission.emit_all = self._tapped  # type: ignore[method-assign]

    def _tapped(self, seqs, logits: torch.Tensor) -> list[GenerationResult]:
        for seq, row in zip(seqs, logits):
            if not seq.result.output:
                self.first_logits[seq.result.request_id] = row.float().cpu()
        return self._emit_all(seqs, logits)


@dataclass(frozen=True)
class Setup:
    model: ModelConfig
    weights: ModelWeights
    prompt_len: int
    requests: int
    chunk_tokens: int
    decode_tokens: int
    page_size: int

    def runner(self, tail_only: bool, chunk_tokens: int | None = None) -> LogitTap:
        p, w = self.page_size, self.model.window
        chunk = chunk_tokens or self.chunk_tokens
        full = self.requests * (self.prompt_len + self.decode_tokens + 2 * p)
        swa = self.requests * (w + 3 * p) + chunk + w + 4 * p
        cache = self.model.cache_config(
            page_size=p, full_capacity=-(-full // p) * p, swa_capacity=-(-swa // p) * p
        )
        return LogitTap(
            self.model,
            cache,
            device=self.weights.device,
            dtype=self.weights.dtype,
            weights=self.weights,
            chunk_tokens=chunk,
            max_running=self.requests,
            tail_only=tail_only,
        )

    def prompts(self, seed: int) -> list[list[int]]:
        rng = np.random.default_rng(seed)
        return [rng.integers(0, 256, self.prompt_len).tolist() for _ in range(self.requests)]


def prefill_seconds(setup: Setup, tail_only: bool, repeats: int) -> tuple[float, int]:
    """Best prefill-forward time over ``repeats`` cold runs (new cache, new prompts), after
    one warm-up run; and the tokens the tail-only runs skipped in the last run."""
    times, skipped = [], 0
    for rep in range(repeats + 1):
        runner = setup.runner(tail_only)
        runner.generate(setup.prompts(1000 + rep), SamplingParams(max_new_tokens=1))
        if rep:  # rep 0 warms up (allocator, kernels, lazy init)
            times.append(runner.stats.forward_s)
        skipped = runner.stats.tail_skipped_tokens
    return min(times), skipped


def greedy_run(setup: Setup, tail_only: bool, chunk_tokens: int | None = None):
    runner = setup.runner(tail_only, chunk_tokens)
    results = runner.generate(setup.prompts(7), SamplingParams(max_new_tokens=setup.decode_tokens))
    logits = [runner.first_logits[r.request_id] for r in results]
    return results, logits


def divergence(setup: Setup) -> dict[str, float]:
    exact, exact_logits = greedy_run(setup, tail_only=False)
    tail, tail_logits = greedy_run(setup, tail_only=True)
    _, noise_logits = greedy_run(setup, tail_only=False, chunk_tokens=setup.chunk_tokens // 2)
    n = setup.decode_tokens
    prefix, equal = [], []
    for e, t in zip(exact, tail):
        same = [a == b for a, b in zip(e.output, t.output)]
        prefix.append(same.index(False) if False in same else n)
        equal.append(sum(same))

    def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        return max(float((x - y).abs().max()) for x, y in zip(a, b))

    return {
        "max_logit_diff": max_diff(exact_logits, tail_logits),
        "noise_max_logit_diff": max_diff(exact_logits, noise_logits),
        "logit_scale": max(float(x.abs().max()) for x in exact_logits),
        "first_token_agreement": sum(e.output[0] == t.output[0] for e, t in zip(exact, tail))
        / len(exact),
        "greedy_prefix_agreement": sum(prefix) / (n * len(prefix)),
        "greedy_positionwise_agreement": sum(equal) / (n * len(equal)),
        "approximate_flagged": sum(t.approximate for t in tail) / len(tail),
    }


def memory_rows(page_size: int) -> list[dict[str, object]]:
    """Bytes per cached token and per SWA token (bf16 KV, fp32 rings), shared vs unshared."""
    rows = []
    for name in ("tiny-shared", "flash-shared"):
        model = preset(name)
        cache = model.cache_config(
            page_size=page_size, full_capacity=page_size * 64, swa_capacity=page_size * 16
        )
        shared = bytes_per_token(model, cache, torch.bfloat16)
        plain = bytes_per_token(model.unshared(), cache, torch.bfloat16)
        rows.append(
            {
                "model": name,
                "kv_sources": list(model.kv_sources),
                "index_sources": list(model.index_sources),
                "shared": asdict(shared),
                "unshared": asdict(plain),
                "cached_token_bytes": [shared.per_cached_token, plain.per_cached_token],
                "swa_token_bytes": [shared.per_swa_token, plain.per_swa_token],
                "cached_token_saving": 1 - shared.per_cached_token / plain.per_cached_token,
            }
        )
    return rows


def run(args: argparse.Namespace) -> dict[str, object]:
    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else None
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = preset(args.model)
    t0 = time.perf_counter()
    weights = init_weights(model, device, dtype)
    setup = Setup(
        model,
        weights,
        args.prompt_len,
        args.requests,
        args.chunk_tokens,
        args.decode_tokens,
        args.page_size,
    )
    exact_s, _ = prefill_seconds(setup, False, args.repeats)
    tail_s, skipped = prefill_seconds(setup, True, args.repeats)
    prefill_tokens = args.prompt_len * args.requests
    return {
        "model": model.name,
        "layers": model.num_layers,
        "last_kv_source": model.last_kv_source,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "dtype": str(dtype).removeprefix("torch."),
        "prompt_len": args.prompt_len,
        "requests": args.requests,
        "chunk_tokens": args.chunk_tokens,
        "decode_tokens": args.decode_tokens,
        "repeats": args.repeats,
        "exact_prefill_s": exact_s,
        "tail_only_prefill_s": tail_s,
        "exact_prefill_tok_s": prefill_tokens / exact_s,
        "tail_only_prefill_tok_s": prefill_tokens / tail_s,
        "speedup": exact_s / tail_s,
        "skipped_token_fraction": skipped / prefill_tokens,
        **divergence(setup),
        "memory": memory_rows(args.page_size),
        "bench_s": time.perf_counter() - t0,
    }


def render(r: dict) -> str:
    lines = [
        f"tail-only prefill, {r['model']} ({r['layers']} layers, last KV source "
        f"{r['last_kv_source']}), {r['dtype']} on {r['gpu'] or r['device']}: {r['requests']} x "
        f"{r['prompt_len']} tokens, chunks of {r['chunk_tokens']}",
        "",
        "| prefill | s | tok/s |",
        "|---|---:|---:|",
        f"| exact | {r['exact_prefill_s']:.4f} | {r['exact_prefill_tok_s']:,.0f} |",
        f"| tail-only | {r['tail_only_prefill_s']:.4f} | {r['tail_only_prefill_tok_s']:,.0f} |",
        "",
        f"speed-up {r['speedup']:.2f}x; {100 * r['skipped_token_fraction']:.1f}% of prefill "
        "tokens stop after the last KV-source layer",
        f"divergence vs exact: max |logit diff| at the last prompt position "
        f"{r['max_logit_diff']:.3g} (logits up to {r['logit_scale']:.3g}; exact vs exact with "
        f"half the chunk: {r['noise_max_logit_diff']:.3g}); first token agrees "
        f"{100 * r['first_token_agreement']:.0f}%; greedy agreement over {r['decode_tokens']} "
        f"tokens {100 * r['greedy_prefix_agreement']:.1f}% up to the first difference, "
        f"{100 * r['greedy_positionwise_agreement']:.1f}% position-wise; "
        f"{100 * r['approximate_flagged']:.0f}% of tail-only results flagged approximate",
        "",
        "| model | bytes / cached token shared | unshared | saving "
        "| bytes / SWA token shared | unshared |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for m in r["memory"]:
        cached, swa = m["cached_token_bytes"], m["swa_token_bytes"]
        lines.append(
            f"| {m['model']} | {cached[0]:,.1f} | {cached[1]:,.1f} | "
            f"{100 * m['cached_token_saving']:.1f}% | {swa[0]:,.1f} | {swa[1]:,.1f} |"
        )
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-shared", help="a preset with kv_sources")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU) | float32 …")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--chunk-tokens", type=int, default=1024)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    result = run(args)
    print(render(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
