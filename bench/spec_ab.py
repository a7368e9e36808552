"""A/B of the speculative step's host path against the device-draft path, in one process.

Interleaved over ``--reps`` repetitions (after a warm-up rep 0, not timed, that captures the
CUDA graphs of every batch bucket up to the batch): plain greedy decode, MTP k=2, EAGLE k=2
and k=3, each speculative row with ``device_drafts`` off (old: drafts read back before verify,
two host reads) and on (new: drafts stay on the device, one host read), at every ``--batches``
size. Every variant keeps one runner (its graphs stay captured); each rep decodes its own
prompts, so no rep starts on a prefix cached by an earlier one (``prefix_hit_tokens``,
expected 0), and the cache holds every rep without evicting. ``timed_captures``: CUDA graphs
captured inside the timed decode loops (expected 0; else a bucket the warm-up missed).
``device_step_share`` and ``acceptance_length`` count the timed reps only. The timed steps are
those where every request decodes (each generates enough tokens to outlast the other requests'
prefills and the timed steps: `max_new`), up to ``--new-tokens`` tokens a request; the rows
record their mean and least batch.

Per row: median wall ms per decode step, tokens per step, ms per token, speed-up over plain
(median ms/token), the share of verify steps that took the device path, and the agreement of
its greedy outputs with plain decoding's of the same rep and batch: in float32 / float64 any
difference stops the run (exit 1); in bfloat16 a 1-token decode and a (k+1)-token verify round
differently, so outputs may legitimately part after some tokens: ``equal_share`` (requests
whose whole output equals plain's) and ``mean_first_diff`` (mean first differing position of
the others; None: none differed) are reported, over every rep.

    python bench/spec_ab.py --json bench/results/spec_ab_h200.json            # GPU, bf16
    python bench/spec_ab.py --device cpu --reps 1 --new-tokens 8 --prompt-len 64 --batches 1,2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from adapters.engine.eagle_draft import EagleDraft  # noqa: E402
from adapters.engine.runner import Runner  # noqa: E402
from adapters.engine.sampling import SamplingParams  # noqa: E402
from adapters.engine.speculative import SpecStats  # noqa: E402
from adapters.model.eagle import load_shipped_eagle  # noqa: E402
from adapters.model.model_config import preset  # noqa: E402
from adapters.model.tokenizer import BOS  # noqa: E402
from adapters.model.weights_file import load_shipped  # noqa: E402
from bench.meta import run_meta  # noqa: E402
from bench.quality import default_data, heldout_docs  # noqa: E402

ROWS = [("plain", None, None), ("mtp", 2, None), ("eagle", 2, None), ("eagle", 3, None)]
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
PAGE = 64
CHUNK = 1024  # the runners' prefill tokens a step


def make_runner(model, weights, args, batch: int, source: str, k: int | None) -> Runner:
    # room for every rep's prompts and outputs (plus speculative slack): no eviction, so no rep
    # pays for another's leftovers (and at least the 4 reps' worth a chunk's window needs)
    per_rep = (args.prompt_len + max_new(args, batch) + 4 * PAGE) * batch
    full = -(-max(args.reps + 2, 4) * per_rep // PAGE) * PAGE
    cache = model.cache_config(page_size=PAGE, full_capacity=full, swa_capacity=full,
                               speculative=k is not None)  # fmt: skip
    draft = EagleDraft(load_shipped_eagle(weights)) if source == "eagle" else None
    return Runner(model, cache, device=weights.device, dtype=weights.dtype, weights=weights,
                  chunk_tokens=CHUNK, max_running=batch, speculative_tokens=k, draft=draft,
                  graph_decode=True)  # fmt: skip


def max_new(args, batch: int) -> int:  # type: ignore[no-untyped-def]
    """Tokens each request generates (every variant alike): enough that none finishes before
    the timed steps end. Every step also decodes the requests whose prefill ended (continuous
    batching), so the first of them decodes through the other prefills: at most one step per
    chunk of the batch's prompts plus one per request, each emitting up to k + 1 (the largest
    k of `ROWS`), then the timed ``--new-tokens``."""
    k = max(k or 0 for _, k, _ in ROWS)
    prefill_steps = batch * (args.prompt_len + 1) // CHUNK + batch + 1
    return prefill_steps * (1 + k) + 1 + args.new_tokens


class CaptureCount:
    """CUDA graphs captured in this process since it was made: every capture site of the
    engine enters `torch.cuda.graph` (wrapped here, once per process)."""

    def __init__(self) -> None:
        self.count = 0
        enter = torch.cuda.graph.__enter__

        def counted(ctx: torch.cuda.graph) -> None:
            self.count += 1
            enter(ctx)

        setattr(torch.cuda.graph, "__enter__", counted)  # noqa: B010 - mypy: method assign


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Pass:
    """One timed pass: decode wall seconds, decode steps, decode tokens, the outputs (in prompt
    order), prompt tokens served from the prefix cache, CUDA graphs captured while timed, the
    batch of each timed step."""

    wall_s: float
    steps: int
    tokens: int
    outputs: list[list[int]]
    hit_tokens: int
    captures: int
    batches: list[int]


def timed(runner: Runner, prompts: list[list[int]], args, graphs: CaptureCount) -> Pass:  # type: ignore[no-untyped-def]
    """Prefill and the first decode step untimed, then decode timed while every request
    decodes, up to ``--new-tokens`` tokens a request, then the rest untimed."""
    st = runner.stats
    prefill0, decode0 = st.prefill_tokens, st.decode_tokens
    params = SamplingParams(max_new_tokens=max_new(args, len(prompts)))
    ids = [runner.submit(p, params) for p in prompts]
    done = []
    while runner.num_prefilling or st.decode_tokens == decode0:
        done += runner.step()
    before, batches = st.decode_tokens, []
    stop = before + args.new_tokens * len(prompts)
    sync(runner.device)
    captures0, t0 = graphs.count, time.perf_counter()
    while runner.num_pending == len(prompts) and st.decode_tokens < stop:
        batches.append(runner.num_pending)  # every request decodes (all are prefilled)
        done += runner.step()
    sync(runner.device)
    wall = time.perf_counter() - t0
    tokens, captures = st.decode_tokens - before, graphs.count - captures0
    done += runner.run()
    by_id = {r.request_id: r.output for r in done}
    hits = sum(len(p) for p in prompts) - (st.prefill_tokens - prefill0)
    return Pass(wall, len(batches), tokens, [by_id[i] for i in ids], hits, captures,
                batches)  # fmt: skip


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ (a length difference counts at the
    shorter's end); None where they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class Agreement:
    """How a variant's outputs compare with plain decoding's, request by request."""

    requests: int = 0
    first_diffs: list[int] = field(default_factory=list)  # one per differing request

    def add(self, outputs: list[list[int]], plain: list[list[int]]) -> int:
        """Counts one pass; returns how many of its requests differ from plain's."""
        diffs = [first_difference(o, p) for o, p in zip(outputs, plain, strict=True)]
        self.requests += len(diffs)
        self.first_diffs += [d for d in diffs if d is not None]
        return sum(d is not None for d in diffs)

    @property
    def equal_share(self) -> float:
        return 1.0 - len(self.first_diffs) / self.requests if self.requests else 1.0

    @property
    def mean_first_diff(self) -> float | None:
        return statistics.mean(self.first_diffs) if self.first_diffs else None


@dataclass
class Variant:
    name: str
    runner: Runner
    device_drafts: bool | None
    passes: list[Pass] = field(default_factory=list)  # timed reps only
    agreement: Agreement = field(default_factory=Agreement)
    warm_stats: SpecStats | None = None  # the speculative counters after the warm-up

    def warm_up(self, prompts: list[list[int]], args, graphs: CaptureCount) -> None:  # type: ignore[no-untyped-def]
        """Rep 0's extra passes, one per smaller power-of-two batch bucket on a prefix of its
        prompts: the graphs a shrinking batch replays (requests finishing at different steps)
        are captured before any timed rep. Then snapshots the speculative counters."""
        n = len(prompts)
        for size in [1 << i for i in range(n.bit_length()) if 1 << i < n]:
            timed(self.runner, prompts[:size], args, graphs)
        if self.runner.spec is not None:
            self.warm_stats = replace(self.runner.spec.stats)

    def timed_stats(self) -> tuple[float, float]:
        """Over the timed reps: (share of verify steps on the device path, tokens emitted per
        request-step)."""
        assert self.runner.spec is not None and self.warm_stats is not None
        end, warm = self.runner.spec.stats, self.warm_stats
        forwards = end.forwards - warm.forwards
        request_steps = end.request_steps - warm.request_steps
        return ((end.device_steps - warm.device_steps) / max(1, forwards),
                (end.emitted_tokens - warm.emitted_tokens) / max(1, request_steps))  # fmt: skip


def make_variants(model, weights, args, batch: int) -> list[Variant]:
    variants = []
    for source, k, _ in ROWS:
        if k is None:
            variants.append(Variant("plain", make_runner(model, weights, args, batch, source, k),
                                    None))  # fmt: skip
            continue
        for on in (False, True):
            r = make_runner(model, weights, args, batch, source, k)
            assert r.spec is not None
            r.spec.device_drafts = on
            variants.append(Variant(f"{source} k={k} {'new' if on else 'old'}", r, on))
    return variants


class OutputMismatch(Exception):
    """A speculative variant's greedy output differs from plain decoding's in an exact dtype."""


def run_batch(model, weights, args, batch: int, exact: bool, graphs: CaptureCount):
    """Every variant over rep 0 (warm-up: `Variant.warm_up`) and ``args.reps`` timed reps,
    each rep on its own prompts; returns the variants. Raises `OutputMismatch` where ``exact``
    and an output differs from plain's."""
    docs = heldout_docs(default_data(), batch * (args.reps + 1), args.prompt_len)
    prompts = [[BOS, *d] for d in docs]
    variants = make_variants(model, weights, args, batch)
    for rep in range(args.reps + 1):
        rep_prompts = prompts[rep * batch : (rep + 1) * batch]
        plain: list[list[int]] = []
        for v in variants:  # plain first: the reference of this rep
            p = timed(v.runner, rep_prompts, args, graphs)
            outputs = [o[: args.new_tokens] for o in p.outputs]  # as many as before the fix
            if v.device_drafts is None:
                plain = outputs
            elif v.agreement.add(outputs, plain) and exact:
                raise OutputMismatch(f"{v.name} batch {batch} rep {rep}: output differs from plain")
            if rep:
                v.passes.append(p)
            else:
                v.warm_up(rep_prompts, args, graphs)
    return variants


def row_of(batch: int, v: Variant, base: float | None) -> dict[str, Any]:
    ms_step = [1e3 * p.wall_s / max(1, p.steps) for p in v.passes]
    ms_tok = [1e3 * p.wall_s / max(1, p.tokens) for p in v.passes]
    row: dict[str, Any] = dict(batch=batch, name=v.name, device_drafts=v.device_drafts,
               ms_per_step=statistics.median(ms_step),
               ms_per_step_all=[round(x, 4) for x in ms_step],
               tokens_per_step=statistics.median(p.tokens / max(1, p.steps) for p in v.passes),
               tokens_per_step_all=[round(p.tokens / max(1, p.steps), 3) for p in v.passes],
               ms_per_token=statistics.median(ms_tok),
               prefix_hit_tokens=sum(p.hit_tokens for p in v.passes),
               mean_batch=statistics.fmean(b for p in v.passes for b in p.batches),
               min_batch=min(b for p in v.passes for b in p.batches),
               timed_captures=sum(p.captures for p in v.passes))  # fmt: skip
    if v.runner.spec is not None:
        row["device_step_share"], row["acceptance_length"] = v.timed_stats()
        row["equal_share"] = v.agreement.equal_share
        row["mean_first_diff"] = v.agreement.mean_first_diff
    row["speedup"] = (base or row["ms_per_token"]) / row["ms_per_token"]
    return row


def line_of(row: dict[str, Any]) -> str:
    text = (f"batch {row['batch']:2d}  {row['name']:16s} {row['ms_per_step']:7.3f} ms/step  "
            f"{row['tokens_per_step']:5.2f} tok/step  {row['ms_per_token']:7.3f} ms/tok  "
            f"{row['speedup']:5.2f}x  device {row.get('device_step_share', 0):.2f}  "
            f"batch {row['mean_batch']:.2f} (min {row['min_batch']})")  # fmt: skip
    if "equal_share" in row:
        text += f"  equal {row['equal_share']:.2f}"
        if row["mean_first_diff"] is not None:
            text += f" (first diff at {row['mean_first_diff']:.1f})"
    if row["timed_captures"]:
        text += f"  [{row['timed_captures']} graphs captured while timed]"
    if row["prefix_hit_tokens"]:
        text += f"  [{row['prefix_hit_tokens']} prefix-hit tokens]"
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on CUDA, else "
                    "float32; float32 / float64 require outputs equal to plain")  # fmt: skip
    ap.add_argument("--json")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    exact = args.dtype != "bfloat16"
    model = preset("tiny-trained")
    weights = load_shipped(model, device, DTYPES[args.dtype])
    graphs = CaptureCount()
    out: dict = dict(meta=run_meta(), args=vars(args), rows=[])
    for batch in [int(b) for b in args.batches.split(",")]:
        try:
            variants = run_batch(model, weights, args, batch, exact, graphs)
        except OutputMismatch as e:
            print(f"FAIL: {e}")
            return 1
        base = None
        for v in variants:
            row = row_of(batch, v, base)
            base = row["ms_per_token"] if v.device_drafts is None else base
            out["rows"].append(row)
            print(line_of(row), flush=True)
    print("outputs equal to plain decoding: " + ("yes" if exact else "see equal_share (bf16)"))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
