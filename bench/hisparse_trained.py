"""HiSparse on real attention (#15 item 5): the C4 pages a decode step reads with the trained
indexer, the device buffer's hit rate, and the smallest buffer that holds a step.

Each held-out document (``--context`` bytes of the KJV held-out split) is prefilled through the
runner, then ``--new-tokens`` greedy tokens are decoded with the C4 KV in a host mirror and a
device buffer of each ``--buffers`` pages per C4 layer. Only the decode steps are counted (the
counters are read after the first token, when the prefill is over). Per setup:

* ``pages_per_step``: distinct C4 pages one layer-step reads (mean), and ``max_pages_per_step``,
  the most one layer-step read: a buffer smaller than that cannot hold the step.
* ``hit_rate``: reads whose page was already on the device when the step was planned.
* ``swap_ins_per_step``: pages copied host -> device per layer-step.
* ``equal``: the greedy tokens equal those of the all-resident run (HiSparse is exact).

The same shapes with seeded random weights (``tiny``) are the baseline: an indexer that has
learned nothing spreads its top-k over the context, the trained one should not.

    python bench/hisparse_trained.py --context 8192 --new-tokens 64 --docs 2 \\
        --buffers 33,48,64,96 --json bench/results/hisparse_trained_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from adapters.engine.runner import Runner  # noqa: E402
from adapters.engine.sampling import SamplingParams  # noqa: E402
from adapters.memory.device import resolve_device  # noqa: E402
from adapters.model.model_config import ModelConfig, preset  # noqa: E402
from adapters.model.tokenizer import BOS  # noqa: E402
from adapters.model.weights import ModelWeights, init_weights  # noqa: E402
from adapters.model.weights_file import load_shipped  # noqa: E402
from bench.meta import run_meta  # noqa: E402
from bench.quality import default_data, heldout_docs  # noqa: E402


def make_runner(model: ModelConfig, weights: ModelWeights, args, buffer: int | None) -> Runner:
    p = args.page_size
    full = -(-2 * (args.context + args.new_tokens + 2 * p) // p) * p
    cache = model.cache_config(page_size=p, full_capacity=full, swa_capacity=full)
    return Runner(model, cache, device=weights.device, dtype=weights.dtype, weights=weights,
                  chunk_tokens=args.chunk_tokens, max_running=1, graph_decode=False,
                  hisparse_pages=buffer)  # fmt: skip


def decode(runner: Runner, prompt: list[int], new_tokens: int) -> tuple[list[int], dict | None]:
    """Greedy tokens of ``prompt`` and the HiSparse counters of its decode steps only."""
    runner.submit(prompt, SamplingParams(max_new_tokens=new_tokens))
    before = None
    results = []
    while runner.num_pending:
        results += runner.step()
        off = runner.offload
        if off is not None and before is None and runner.num_prefilling == 0:
            before = _counters(runner)  # the prefill is over: decode steps from here
            off.stats.max_read_pages = 0  # the most one decode layer-step reads
    (result,) = results
    if runner.offload is None:
        return list(result.output), None
    after = _counters(runner)
    delta = {k: after[k] - before[k] for k in after if k != "max_read_pages"}
    steps = max(1, delta["exchanges"])
    return list(result.output), dict(
        layer_steps=delta["exchanges"],
        pages_per_step=delta["read_pages"] / steps,
        max_pages_per_step=after["max_read_pages"],
        hit_rate=delta["read_hits"] / max(1, delta["reads"]),
        swap_ins_per_step=delta["swap_ins"] / steps,
    )


def _counters(runner: Runner) -> dict:
    off = runner.offload
    hs = off.coordinator.stats()
    return dict(exchanges=off.stats.exchanges, read_pages=off.stats.read_pages,
                max_read_pages=off.stats.max_read_pages, reads=hs.reads,
                read_hits=hs.read_hits, swap_ins=hs.swap_ins)  # fmt: skip


def model_weights(name: str, device: torch.device, dtype: torch.dtype):
    if name == "tiny-trained":
        model = preset(name)
        return model, load_shipped(model, device, dtype)
    model = preset("tiny")
    return model, init_weights(model, device, dtype)


def run(args: argparse.Namespace) -> dict:
    meta = run_meta()  # the commit that runs, before anything can move HEAD
    device = resolve_device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    docs = heldout_docs(Path(args.data), args.docs, args.context)
    rows = []
    for name in args.models.split(","):
        model, weights = model_weights(name, device, dtype)
        for d, doc in enumerate(docs):
            prompt = [BOS, *doc]
            t0 = time.perf_counter()
            exact, _ = decode(make_runner(model, weights, args, None), prompt, args.new_tokens)
            for buffer in [int(b) for b in args.buffers.split(",")]:
                try:
                    out, stats = decode(make_runner(model, weights, args, buffer), prompt,
                                        args.new_tokens)  # fmt: skip
                except ValueError as exc:  # a buffer the runner refuses
                    rows.append(dict(model=name, doc=d, buffer=buffer, refused=str(exc)))
                    continue
                rows.append(dict(model=name, doc=d, buffer=buffer, equal=out == exact, **stats))
                print(json.dumps(rows[-1]), flush=True)
            print(f"# {name} doc {d}: {time.perf_counter() - t0:.1f} s", flush=True)
    return dict(meta=meta, config=vars(args), rows=rows)


def table(report: dict) -> str:
    lines = ["| model | buffer (pages / C4 layer) | pages read per layer-step (mean / max) | "
             "hit rate | swap-ins per layer-step | tokens equal |", "|---|---|---|---|---|---|"]
    by = {}
    for r in report["rows"]:
        by.setdefault((r["model"], r["buffer"]), []).append(r)
    for (model, buffer), rs in by.items():
        if any("refused" in r for r in rs):
            lines.append(f"| {model} | {buffer} | refused: {rs[0]['refused'][:60]} | | | |")
            continue
        n = len(rs)
        lines.append(
            f"| {model} | {buffer} | {sum(r['pages_per_step'] for r in rs) / n:.1f} / "
            f"{max(r['max_pages_per_step'] for r in rs)} | "
            f"{sum(r['hit_rate'] for r in rs) / n:.1%} | "
            f"{sum(r['swap_ins_per_step'] for r in rs) / n:.2f} | "
            f"{sum(r['equal'] for r in rs)}/{n} |"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--models", default="tiny-trained,tiny")
    ap.add_argument("--data", default=str(default_data()))
    ap.add_argument("--docs", type=int, default=2)
    ap.add_argument("--context", type=int, default=8192, help="held-out bytes per prompt")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--buffers", default="33,48,64,96")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--compile-watch", action="store_true",
                    help="report every Triton compile of the run (CUDA)")  # fmt: skip
    ap.add_argument("--json", help="write the report here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    watch = None
    if args.compile_watch:
        from bench.compile_watch import CompileWatch

        watch = CompileWatch.install()
    report = run(args)
    if watch is not None:
        report["compiles"] = [list(e) for e in watch.events]
        total = sum(e[3] for e in watch.events)
        print(f"# {len(watch.events)} Triton compiles, {total:.1f} s compiling")
        for at, name, text, took in watch.events[:40]:
            print(f"#   {at:7.1f} s  {took:5.2f} s  {name}  {text[:100]}")
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
