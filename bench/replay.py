"""Encoder-side bounded replay: exact reuse versus replay on a shared-prefix workload whose
cached windows are tombstoned.

Workload: ``--groups`` system prompts of ``--prefix-len`` tokens, each cached by one warm-up
request; then ``--waves`` waves of follow-ups, one per group (its system prompt plus a unique
``--suffix-len``-token question). Under ``--pressure evict`` (default) every cached window is
tombstoned before each wave, as heavy traffic through a small SWA pool does; under
``--pressure pool`` only the small SWA pool (``--swa-tokens``) evicts. The same workload runs
through two runners in the same process:

* ``exact``: ``bounded_replay=False``; a hit needs a live window (exact, bit-identical reuse);
* ``replay``: ``bounded_replay=True``; a hit over a tombstoned window replays its last W tokens.

Measured, over the follow-ups only:

1. **Prefill** (``max_new_tokens=1``, so a request is its prefill): hit ratio, replayed hits,
   tokens computed (prefill + replayed), wall and forward time; speed-up = exact / replay.
2. **Divergence** (``--decode`` N greedy tokens): for up to ``--measure`` follow-ups the replay
   runner served by a replay, against a cold prefill of the same prompt (a runner with an empty
   cache): max |logit difference| at the first generated position (also relative to the cold
   logits' max |value|), top-1 agreement there, and greedy agreement over the N tokens (common
   prefix, and per position). The exact runner's divergence on the same prompts is the dtype's
   noise floor (0 in float64: exact reuse is bit-identical to recomputation).
3. With ``--oracle``: the same first-position logits against the explicit replay oracle
   (`adapters.model.replay_reference`, dense, on the same device): 0 in float64, rounding otherwise;
   it shows the divergence above is the replay's approximation, not a bug.

Prints a table; ``--json`` writes every figure.

    python bench/replay.py                                     # CPU, tiny model, float32
    python bench/replay.py --model flash-shaped --device cuda  # H200, bfloat16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapters.engine.runner import GenerationResult, Runner  # noqa: E402
from adapters.engine.sampling import SamplingParams  # noqa: E402
from adapters.memory.device import resolve_device  # noqa: E402
from adapters.model.model_config import ModelConfig, preset  # noqa: E402
from adapters.model.replay_reference import replay_reference_logits  # noqa: E402
from adapters.model.weights import ModelWeights, init_weights  # noqa: E402

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
EVERYTHING = 10**15


@dataclass(frozen=True)
class Workload:
    groups: list[list[int]]
    waves: list[list[list[int]]]


@dataclass
class Served:
    """What one runner did for the follow-ups."""

    results: list[GenerationResult]
    wall_s: float
    forward_s: float
    prompt_tokens: int
    hit_tokens: int
    prefill_tokens: int
    replayed_tokens: int
    replayed_hits: int
    approximate: int
    steps: int
    preemptions: int
    first_logits: dict[int, torch.Tensor] = field(repr=False, default_factory=dict)

    @property
    def computed_tokens(self) -> int:
        return self.prefill_tokens + self.replayed_tokens

    def row(self) -> dict[str, float | int]:
        out = asdict(self)
        for k in ("results", "first_logits"):
            out.pop(k)
        out["hit_ratio"] = self.hit_tokens / max(1, self.prompt_tokens)
        out["computed_tokens"] = self.computed_tokens
        return out


def make_workload(args: argparse.Namespace) -> Workload:
    rng = np.random.default_rng(args.seed)
    groups = [rng.integers(0, 256, args.prefix_len).tolist() for _ in range(args.groups)]
    waves = [
        [g + rng.integers(0, 256, args.suffix_len).tolist() for g in groups]
        for _ in range(args.waves)
    ]
    return Workload(groups, waves)


def make_runner(
    args: argparse.Namespace, model: ModelConfig, weights: ModelWeights, replay: bool
) -> Runner:
    p = args.page_size
    per_request = args.prefix_len + args.suffix_len + args.decode + 2 * p
    full = -(-(args.groups * (args.waves + 1) * per_request) // p) * p
    swa = args.swa_tokens or args.max_running * (args.chunk_tokens + model.window + 2 * p)
    cache = model.cache_config(
        page_size=p,
        full_capacity=full,
        swa_capacity=-(-swa // p) * p,
        bounded_replay=replay,
    )
    return Runner(
        model,
        cache,
        device=weights.device,
        dtype=weights.dtype,
        weights=weights,
        chunk_tokens=args.chunk_tokens,
        max_running=args.max_running,
    )


def serve(runner: Runner, work: Workload, new_tokens: int, pressure: str) -> Served:
    """Warm-up requests cache the system prompts (not measured); then the waves."""
    runner.generate(work.groups, SamplingParams(max_new_tokens=1))
    seen: dict[int, torch.Tensor] = {}

    def capture(results: list[GenerationResult], logits: torch.Tensor) -> None:
        for res, row in zip(results, logits):
            if not res.output:
                seen[res.request_id] = row.float().cpu()

    runner.on_logits = capture
    st0, cs0 = _counters(runner), runner.cache.stats()
    results: list[GenerationResult] = []
    t0 = time.perf_counter()
    for wave in work.waves:
        if pressure == "evict":
            runner.cache.evict(swa_tokens=EVERYTHING)  # tombstones every unlocked window
        results += runner.generate(wave, SamplingParams(max_new_tokens=new_tokens))
    wall = time.perf_counter() - t0
    st, cs = _counters(runner), runner.cache.stats()
    return Served(
        results,
        wall,
        st["forward_s"] - st0["forward_s"],
        cs.prompt_tokens - cs0.prompt_tokens,
        cs.hit_tokens - cs0.hit_tokens,
        st["prefill_tokens"] - st0["prefill_tokens"],
        st["replayed_tokens"] - st0["replayed_tokens"],
        st["replayed_hits"] - st0["replayed_hits"],
        sum(r.approximate for r in results),
        int(st["steps"] - st0["steps"]),
        int(st["preemptions"] - st0["preemptions"]),
        {r.request_id: seen[r.request_id] for r in results},
    )


def _counters(runner: Runner) -> dict[str, float]:
    return dict(asdict(runner.stats))


def cold(runner: Runner, prompts: list[list[int]], n: int) -> list[tuple[torch.Tensor, list[int]]]:
    """First logits and greedy tokens of each prompt computed from an empty cache."""
    seen: dict[int, torch.Tensor] = {}
    runner.on_logits = lambda res, lg: seen.setdefault(res[0].request_id, lg[0].float().cpu())
    out = []
    for prompt in prompts:
        runner.cache.evict(full_tokens=EVERYTHING, swa_tokens=EVERYTHING)
        assert runner.cache.stats().cached_tokens == 0
        res = runner.generate([prompt], SamplingParams(max_new_tokens=n))[0]
        assert res.cached_tokens == 0
        out.append((seen[res.request_id], res.output))
    return out


def divergence(
    served: Served, indices: list[int], baseline: list[tuple[torch.Tensor, list[int]]]
) -> dict[str, float]:
    diffs, rel, top1, prefix, positions = [], [], [], [], []
    for i, (ref_logits, ref_out) in zip(indices, baseline):
        res = served.results[i]
        got = served.first_logits[res.request_id]
        d = float((got - ref_logits).abs().max())
        diffs.append(d)
        rel.append(d / float(ref_logits.abs().max()))
        top1.append(int(got.argmax()) == int(ref_logits.argmax()))
        same = [a == b for a, b in zip(res.output, ref_out)]
        prefix.append((same + [False]).index(False) / len(ref_out))
        positions.append(sum(same) / len(ref_out))
    return {
        "requests": len(indices),
        "max_abs_logit_diff": max(diffs),
        "mean_max_abs_logit_diff": float(np.mean(diffs)),
        "max_rel_logit_diff": max(rel),
        "top1_agreement": float(np.mean(top1)),
        "greedy_prefix_agreement": float(np.mean(prefix)),
        "greedy_position_agreement": float(np.mean(positions)),
    }


def oracle_diff(
    served: Served, indices: list[int], weights: ModelWeights, cached: int
) -> dict[str, float]:
    """First-position logits of never-preempted replayed requests against the replay oracle
    over their cached prefix: the whole pages of the system prompt, which the warm-up cached
    (its prompt only: one new token is never committed) and computed cold."""
    diffs = []
    start = cached - weights.config.window
    for i in indices:
        res = served.results[i]
        if res.preemptions:
            continue
        want = replay_reference_logits(weights, res.prompt, cached, start)[-1].float().cpu()
        diffs.append(float((served.first_logits[res.request_id] - want).abs().max()))
    return {"requests": len(diffs), "max_abs_logit_diff": max(diffs, default=0.0)}


def run(args: argparse.Namespace) -> dict:
    device = resolve_device(args.device)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    model = preset(args.model)
    weights = init_weights(model, device, dtype)
    work = make_workload(args)
    if args.warmup:  # kernels, allocator, lazy inits: one wave through both runners
        small = Workload(work.groups, work.waves[:1])
        for replay in (False, True):
            serve(make_runner(args, model, weights, replay), small, 1, args.pressure)
    prefill = {}
    for name, replay in (("exact", False), ("replay", True)):
        prefill[name] = serve(make_runner(args, model, weights, replay), work, 1, args.pressure)
        _free(device)
    decoded = {
        name: serve(make_runner(args, model, weights, replay), work, args.decode, args.pressure)
        for name, replay in (("exact", False), ("replay", True))
    }
    flagged = [i for i, r in enumerate(decoded["replay"].results) if r.approximate]
    measured = flagged[: args.measure]
    prompts = [decoded["replay"].results[i].prompt for i in measured]
    base = cold(make_runner(args, model, weights, False), prompts, args.decode) if prompts else []
    oracle = {}
    if args.oracle and measured:
        cached = args.prefix_len // args.page_size * args.page_size
        oracle = oracle_diff(decoded["replay"], measured, weights, cached)
    report = {
        "oracle": oracle,
        "config": {k: v for k, v in vars(args).items() if k != "json"}
        | {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "W": model.window},
        "prefill": {k: v.row() for k, v in prefill.items()},
        "speedup_wall": prefill["exact"].wall_s / prefill["replay"].wall_s,
        "speedup_forward": prefill["exact"].forward_s / prefill["replay"].forward_s,
        "divergence": {k: divergence(v, measured, base) for k, v in decoded.items()}
        if measured
        else {},
    }
    return report


def _free(device: torch.device) -> None:
    if device.type == "cuda":  # pragma: no cover - GPU only
        torch.cuda.empty_cache()


def table(report: dict) -> str:
    c = report["config"]
    lines = [
        f"bounded replay: {c['model']} {c['dtype']} on {c['device']}, page {c['page_size']}, "
        f"W {c['W']}, {c['groups']} groups x {c['waves']} waves, prefix {c['prefix_len']} + "
        f"suffix {c['suffix_len']} tokens, pressure {c['pressure']}",
        "",
        f"{'prefill':8} {'hit ratio':>9} {'replayed':>8} {'approx':>6} {'computed tok':>12} "
        f"{'wall s':>8} {'forward s':>9}",
    ]
    for name, r in report["prefill"].items():
        lines.append(
            f"{name:8} {r['hit_ratio']:9.3f} {r['replayed_hits']:8d} {r['approximate']:6d} "
            f"{r['computed_tokens']:12d} {r['wall_s']:8.3f} {r['forward_s']:9.3f}"
        )
    lines.append(
        f"replay speed-up (exact / replay): wall {report['speedup_wall']:.2f}x, forward "
        f"{report['speedup_forward']:.2f}x"
    )
    div = report["divergence"]
    if div:
        n = c["decode"]
        lines += [
            "",
            f"vs cold prefill ({div['replay']['requests']} replayed requests; first generated "
            f"position, greedy over {n} tokens)",
            f"{'':8} {'max|dlogit|':>11} {'mean':>9} {'rel':>9} {'top-1':>6} "
            f"{'prefix':>6} {'pos':>6}",
        ]
        for name, d in div.items():
            lines.append(
                f"{name:8} {d['max_abs_logit_diff']:11.3e} {d['mean_max_abs_logit_diff']:9.3e} "
                f"{d['max_rel_logit_diff']:9.3e} {d['top1_agreement']:6.2f} "
                f"{d['greedy_prefix_agreement']:6.2f} {d['greedy_position_agreement']:6.2f}"
            )
    else:
        lines.append("no follow-up was served by a replay: nothing to compare")
    if report["oracle"]:
        o = report["oracle"]
        lines.append(
            f"replay vs its oracle ({o['requests']} requests, first generated position): "
            f"max |dlogit| {o['max_abs_logit_diff']:.3e}"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny | flash-shaped")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on CUDA, else fp32")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--decode", type=int, default=16, help="greedy tokens compared (N)")
    ap.add_argument("--measure", type=int, default=8, help="replayed requests compared to cold")
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--max-running", type=int, default=4)
    ap.add_argument("--swa-tokens", type=int, help="default: max-running x (chunk + W + 2 pages)")
    ap.add_argument("--pressure", choices=["evict", "pool"], default="evict")
    ap.add_argument("--warmup", action="store_true", help="one throwaway wave first (GPU)")
    ap.add_argument("--oracle", action="store_true", help="also compare with the replay oracle")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    ap.add_argument("--json")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = run(args)
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
