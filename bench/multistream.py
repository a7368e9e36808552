"""Graph decode with multi-stream attention prep against the single-stream graph, in one process.

Two runners over the same weights, ``graph_decode=True``, ``multi_stream`` off and on (each
compressed layer's compressor and indexer on a side stream, concurrent with its q / kv
projections: docs/runner.md, "Multi-stream attention prep"). Overlap scheduling is off, so a
decode step's wall time is its host work plus its graph. Interleaved over ``--reps`` timed
repetitions after a warm-up rep 0 (captures the graphs, not timed); each rep decodes its own
random prompts (``--prompt-len``), ``--steps`` timed decode steps after the first, every
request decoding in each (each generates enough tokens to outlast the other requests' prefills
and the timed steps: `max_new`; the rows record the mean and least batch of the timed steps).
``--hisparse-pages``: both arms with HiSparse's C4 KV in the graph (`GraphResidency`).

Per (batch, arm): median wall ms per decode step, median device ms of the graph replay (CUDA
events around `CudaGraphs.replay`), and the multi-stream / single-stream ratios of both. Greedy
outputs must be equal between the arms in float32 / float64 (exit 1 otherwise); in bfloat16
the share of equal requests is reported. ``--model``: ``tiny-trained`` (shipped weights,
`weights_file.load_shipped`) or any preset with seeded random weights (``flash-shaped``:
V4-Flash's attention dimensions). On the CPU both arms run on one stream (the prep runs
inline): the smoke run checks the plumbing, not a speed-up.

    python bench/multistream.py --model flash-shaped --batches 1,4 \
        --json bench/results/multistream_h200.json
    python bench/multistream.py --device cpu --steps 4 --reps 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from adapters.engine.runner import Runner  # noqa: E402
from adapters.engine.sampling import SamplingParams  # noqa: E402
from adapters.model.model_config import ModelConfig, preset  # noqa: E402
from adapters.model.weights import ModelWeights, init_weights  # noqa: E402
from adapters.model.weights_file import load_shipped  # noqa: E402
from bench.meta import run_meta  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
PAGE = 64
CHUNK = 1024  # the runners' prefill tokens a step


@dataclass
class Arm:
    """One runner (its graphs stay captured across reps) and its timed passes."""

    multi_stream: bool
    runner: Runner
    step_ms: list[float] = field(default_factory=list)  # one median per timed rep
    batches: list[int] = field(default_factory=list)  # requests decoding in each timed step
    graph_ms: list[float | None] = field(default_factory=list)  # None: not on CUDA
    replays: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return "multi-stream" if self.multi_stream else "single-stream"


def load_weights(model: ModelConfig, device: torch.device, dtype: torch.dtype) -> ModelWeights:
    if model.name == "tiny-trained":
        return load_shipped(model, device, dtype)
    return init_weights(model, device, dtype)


def make_arm(model, weights, args, batch: int, multi_stream: bool) -> Arm:
    # room for every rep's prompts and outputs: no eviction, no rep served from another's pages
    per_rep = (args.prompt_len + max_new(args, batch) + 2 + 2 * PAGE) * batch
    full = -(-max(args.reps + 2, 4) * per_rep // PAGE) * PAGE
    cache = model.cache_config(page_size=PAGE, full_capacity=full, swa_capacity=full)
    runner = Runner(model, cache, device=weights.device, dtype=weights.dtype, weights=weights,
                    chunk_tokens=CHUNK, max_running=batch, graph_decode=True, overlap=False,
                    multi_stream=multi_stream, hisparse_pages=args.hisparse_pages)  # fmt: skip
    arm = Arm(multi_stream, runner)
    decoder = runner.decoder
    assert decoder is not None
    if weights.device.type == "cuda":  # device time of every graph replay
        replay = decoder._replay

        def timed_replay(b: int, context: int) -> torch.Tensor:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = replay(b, context)
            end.record()
            arm.replays.append((start, end))
            return out

        setattr(decoder, "_replay", timed_replay)  # noqa: B010 - mypy: method assign
    return arm


def max_new(args, batch: int) -> int:  # type: ignore[no-untyped-def]
    """Tokens each request generates: enough that none finishes before the timed steps end.
    Every step also decodes the requests whose prefill ended (continuous batching), so the
    first of them decodes through the other prefills: at most one step per chunk of the
    batch's prompts plus one per request, then the timed steps."""
    prefill_steps = batch * args.prompt_len // CHUNK + batch + 1
    return prefill_steps + args.steps + 2


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_pass(arm: Arm, prompts: list[list[int]], steps: int, new: int, timed: bool):  # type: ignore[no-untyped-def]
    """Prefill and the first decode step untimed, then ``steps`` decode steps timed (their
    batches kept in ``arm.batches`` where ``timed``), then the rest. Returns median wall ms per
    step, median graph ms (None off CUDA), outputs."""
    runner = arm.runner
    st = runner.stats
    ids = [runner.submit(p, SamplingParams(max_new_tokens=new)) for p in prompts]
    done, decode0 = [], st.decode_tokens
    while runner.num_prefilling or st.decode_tokens == decode0:
        done += runner.step()
    walls: list[float] = []
    arm.replays.clear()
    for _ in range(steps):
        if timed:
            arm.batches.append(len(runner.budget.decode_rows()))
        sync(runner.device)
        t0 = time.perf_counter()
        done += runner.step()
        sync(runner.device)
        walls.append(1e3 * (time.perf_counter() - t0))
    graph = [s.elapsed_time(e) for s, e in arm.replays]
    while runner.num_pending:
        done += runner.step()
    by_id = {r.request_id: r.output for r in done}
    median_graph = statistics.median(graph) if graph else None
    return statistics.median(walls), median_graph, [by_id[i] for i in ids]


def run_batch(model, weights, args, batch: int) -> tuple[list[Arm], float]:
    """Both arms over rep 0 (warm-up) and ``args.reps`` timed reps, interleaved (the order
    alternating per rep). Returns the arms and the share of requests whose outputs agree."""
    arms = [make_arm(model, weights, args, batch, on) for on in (False, True)]
    rng = np.random.default_rng(batch)
    equal = total = 0
    for rep in range(args.reps + 1):
        prompts = [rng.integers(0, model.vocab_size, args.prompt_len).tolist()
                   for _ in range(batch)]  # fmt: skip
        outputs = {}
        for arm in arms if rep % 2 == 0 else arms[::-1]:
            wall, graph, outputs[arm.multi_stream] = run_pass(
                arm, prompts, args.steps, max_new(args, batch), rep > 0
            )
            if rep:
                arm.step_ms.append(wall)
                arm.graph_ms.append(graph)
        equal += sum(a == b for a, b in zip(outputs[False], outputs[True], strict=True))
        total += batch
    return arms, equal / total


def rows_of(batch: int, arms: list[Arm], equal_share: float) -> list[dict[str, Any]]:
    rows = []
    base_step, base_graph = statistics.median(arms[0].step_ms), _graph_median(arms[0])
    for arm in arms:
        step, graph = statistics.median(arm.step_ms), _graph_median(arm)
        rows.append(dict(
            batch=batch, arm=arm.name, multi_stream=arm.multi_stream, ms_per_step=step,
            ms_per_step_reps=[round(x, 4) for x in arm.step_ms], graph_ms=graph,
            graph_ms_reps=[None if x is None else round(x, 4) for x in arm.graph_ms],
            step_ratio=step / base_step, equal_share=equal_share,
            mean_batch=statistics.fmean(arm.batches), min_batch=min(arm.batches),
            graph_ratio=None if graph is None or base_graph is None else graph / base_graph,
        ))  # fmt: skip
    return rows


def _graph_median(arm: Arm) -> float | None:
    graph = [x for x in arm.graph_ms if x is not None]
    return statistics.median(graph) if graph else None


def line_of(row: dict[str, Any]) -> str:
    graph = "graph: not on CUDA"
    if row["graph_ms"] is not None:
        graph = f"graph {row['graph_ms']:8.3f} ms ({row['graph_ratio']:5.3f}x)"
    return (f"batch {row['batch']:2d}  {row['arm']:13s}  {row['ms_per_step']:8.3f} ms/step "
            f"({row['step_ratio']:5.3f}x)  {graph}  equal {row['equal_share']:.2f}  "
            f"batch {row['mean_batch']:.2f} (min {row['min_batch']})")  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--model", default="tiny-trained", help="a preset: tiny-trained (shipped "
                    "weights) or any other with random weights, e.g. flash-shaped")  # fmt: skip
    ap.add_argument("--batches", default="1")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per rep")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on CUDA, else "
                    "float32; float32 / float64 require equal outputs")  # fmt: skip
    ap.add_argument("--hisparse-pages", type=int, help="HiSparse in the graph: a device "
                    "buffer of this many pages per C4 layer (default: all resident)")  # fmt: skip
    ap.add_argument("--json")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    model = preset(args.model)
    weights = load_weights(model, device, DTYPES[args.dtype])
    if device.type != "cuda":
        print("note: on the CPU both arms run on one stream (the multi-stream prep runs inline)")
    out: dict = dict(meta=run_meta(), args=vars(args), rows=[],
                     concurrent=device.type == "cuda")  # fmt: skip
    failed = False
    for batch in [int(b) for b in args.batches.split(",")]:
        arms, equal_share = run_batch(model, weights, args, batch)
        for row in rows_of(batch, arms, equal_share):
            out["rows"].append(row)
            print(line_of(row), flush=True)
        failed |= equal_share < 1.0 and args.dtype != "bfloat16"
    if failed:
        print(f"FAIL: multi-stream outputs differ from single-stream in {args.dtype}")
    else:
        print("greedy outputs equal between the arms: "
              + ("yes" if args.dtype != "bfloat16" else "see equal_share (bf16)"))  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
