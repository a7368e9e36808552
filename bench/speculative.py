"""Speculative decoding through the runner: acceptance and decode speed-up per draft source.

For each batch size, ``batch`` random prompts are generated greedily three ways:

1. **Check** (``--check-dtype``, default fp32; fp64 on the CPU): the plain runner, then a
   speculative runner per (source, k). Every output must equal the plain one token for token,
   or the bench stops (exit status 1) before timing anything.
2. **Plain** timing run (``--dtype``): decode tokens/s of the runner without speculation (graph
   decode on CUDA).
3. **Speculative** timing runs per (source, k): decode tokens/s, mean acceptance length (tokens
   emitted per request per verify step), tokens per forward, acceptance rate, time in the draft
   source. ``agree``: the fraction of outputs equal to the plain timing run's (bf16 runs may
   differ where two logits are within rounding; the check above is the correctness gate).

Each timing run executes the whole workload twice on the same runner and times the second pass
only (CUDA graphs are captured in the first), from the step where every request decodes, while
every request does (each generates enough tokens to outlast the other requests' prefills and
the timed steps: `max_new`; the first finishing ends the window) and up to ``--new-tokens``
tokens a request; the rows record the mean and least batch of the timed steps. Draft sources
(``--sources`` or its alias ``--draft``, a comma-separated list): ``oracle:R`` (the target's
greedy continuation from the check's plain run, each token kept with probability R,
`OracleDraft`), ``mtp`` (the model's MTP layer), ``eagle`` (the preset's shipped
EAGLE head, `EagleDraft`; ``--eagle-weights FILE`` for another; a `WeightsError` if there is
none) and ``eagle:random`` (a seeded random head: the draft cost only).

    python bench/speculative.py                                    # tiny model, CPU
    python bench/speculative.py --model flash-shaped --batches 1,8,32 --json spec.json
    python bench/speculative.py --model tiny-trained --prompts heldout --draft mtp,eagle
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapters.engine.eagle_draft import EagleDraft  # noqa: E402
from adapters.engine.runner import Runner  # noqa: E402
from adapters.engine.sampling import SamplingParams  # noqa: E402
from adapters.engine.speculative import DraftSource, MTPDraft, OracleDraft, SpecStats  # noqa: E402
from adapters.memory.device import resolve_device  # noqa: E402
from adapters.model.eagle import (  # noqa: E402
    EagleConfig,
    EagleWeights,
    init_eagle,
    load_eagle,
    load_shipped_eagle,
)
from adapters.model.model_config import ModelConfig, preset  # noqa: E402
from adapters.model.weights import ModelWeights, init_weights  # noqa: E402
from adapters.model.weights_file import SHIPPED, load_shipped  # noqa: E402
from adapters.training.corpus import FIXTURE_DIR, load_split  # noqa: E402
from bench.meta import run_meta  # noqa: E402

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class Setup:
    model: ModelConfig
    device: torch.device
    page_size: int
    prompt_len: int
    new_tokens: int
    chunk: int
    max_k: int = 0  # the largest k of the run: the plain run generates as much as its runner


def make_runner(
    s: Setup, weights: ModelWeights, batch: int, k: int | None, draft: DraftSource | None
) -> Runner:
    p, w = s.page_size, s.model.window
    per_request = s.prompt_len + max_new(s, batch, s.max_k) + (k or 0) + 2 * p
    cc = s.model.cache_config(
        page_size=p,
        full_capacity=-(-(batch * per_request + 4 * p) // p) * p,
        swa_capacity=-(-(batch * (w + 3 * p + (k or 0)) + s.chunk + w + 2 * p) // p) * p,
        speculative=k is not None,
    )
    return Runner(
        s.model,
        cc,
        device=s.device,
        dtype=weights.dtype,
        weights=weights,
        chunk_tokens=s.chunk,
        max_running=batch,
        speculative_tokens=k,
        draft=draft,
    )


def max_new(s: Setup, batch: int, k: int | None) -> int:
    """Tokens each request generates: enough that none finishes before the timed steps end.
    Every step also decodes the requests whose prefill ended (continuous batching), so the
    first of them decodes through the other prefills: at most one step per ``chunk`` of the
    batch's prompts plus one per request, each emitting up to ``k + 1``, then the timed
    ``new_tokens``."""
    prefill_steps = batch * s.prompt_len // s.chunk + batch + 1
    return prefill_steps * (1 + (k or 0)) + 1 + s.new_tokens


def source(
    name: str, continuations: dict, seed: int, head: EagleWeights | None = None
) -> DraftSource:
    if name == "mtp":
        return MTPDraft()
    if name.startswith("eagle"):
        assert head is not None, "eagle_head() first"
        return EagleDraft(head)
    kind, _, rate = name.partition(":")
    if kind != "oracle":
        raise SystemExit(f"unknown draft source {name!r}: use oracle:RATE, mtp or eagle")
    return OracleDraft(continuations, float(rate), seed)


def eagle_head(name: str, weights: ModelWeights, path: str | None) -> EagleWeights | None:
    """The head an ``eagle`` source drafts with for ``weights`` (None for other sources):
    ``eagle:random`` a seeded random one, else ``path`` or the preset's shipped head (both
    checked against ``weights``: `WeightsError` for another target or no file)."""
    if not name.startswith("eagle"):
        return None
    if name == "eagle:random":
        cfg = EagleConfig.for_target(weights.config)
        return init_eagle(cfg, weights.device, weights.dtype)
    if name != "eagle":
        raise SystemExit(f"unknown draft source {name!r}: use eagle or eagle:random")
    return load_eagle(path, weights) if path else load_shipped_eagle(weights)


def _weights(model, device, dtype) -> ModelWeights:
    """The shipped trained weights of a trained preset (a `WeightsError` if its file is not
    there: never random weights under a trained name), else random."""
    if model.name in SHIPPED:
        return load_shipped(model, device, dtype)
    return init_weights(model, device, dtype)


def _prompts(kind: str, rng: np.random.Generator, batch: int, length: int) -> list[list[int]]:
    """``batch`` prompts of ``length`` bytes: random, or windows of the held-out text at
    random offsets (a trained model's drafts only agree on text like its training data)."""
    if kind == "random":
        return [rng.integers(0, 256, length).tolist() for _ in range(batch)]
    if kind != "heldout":
        raise SystemExit(f"--prompts: {kind!r} is not random or heldout")
    real = Path(__file__).resolve().parents[1] / "data" / "kjv"
    text = load_split(real if (real / "heldout.txt").exists() else FIXTURE_DIR, False).heldout
    starts = rng.integers(0, len(text) - length, batch)
    return [list(text[int(a) : int(a) + length]) for a in starts]


def generate(runner: Runner, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    return [r.output for r in runner.generate(prompts, SamplingParams(max_new_tokens=new_tokens))]


def timed_pass(runner: Runner, prompts: list[list[int]], new_tokens: int, window: int):
    """Outputs, decode seconds, decode tokens and the batch of each timed step of one pass,
    timed from the first step where every request decodes, while every one does, up to
    ``window`` tokens a request; the rest untimed."""
    params = SamplingParams(max_new_tokens=new_tokens)
    ids = [runner.submit(p, params) for p in prompts]
    done, batches = [], []
    while runner.num_prefilling:
        done += runner.step()
    stop = runner.stats.decode_tokens + window * len(prompts)
    tokens0, t0 = runner.stats.decode_tokens, time.perf_counter()
    while runner.num_pending == len(prompts) and runner.stats.decode_tokens < stop:
        batches.append(runner.num_pending)  # every request decodes (all are prefilled)
        done += runner.step()
    seconds = time.perf_counter() - t0
    tokens = runner.stats.decode_tokens - tokens0
    done += runner.run()
    by_id = {r.request_id: r.output for r in done}
    return [by_id[i] for i in ids], seconds, tokens, batches


def time_runner(runner: Runner, prompts: list[list[int]], new_tokens: int, window: int):
    timed_pass(runner, prompts, new_tokens, window)  # graph capture, warm-up
    if runner.spec is not None:
        runner.spec.stats = SpecStats()
    return timed_pass(runner, prompts, new_tokens, window)


def check(s: Setup, weights: ModelWeights, batch, prompts, names, ks, check_tokens, heads) -> None:
    """Greedy equality of every (source, k) with the plain runner, in ``weights.dtype``."""
    plain = generate(make_runner(s, weights, batch, None, None), prompts, s.new_tokens)
    table = {tuple(p): o for p, o in zip(prompts, plain)}
    for name in names:
        for k in ks:
            draft = source(name, table, k, heads.get(name))
            runner = make_runner(s, weights, batch, k, draft)
            got = generate(runner, prompts, check_tokens)
            bad = [i for i, (g, o) in enumerate(zip(got, plain)) if g != o[:check_tokens]]
            if bad:
                print(f"# FAIL: {name} k={k} batch={batch}: outputs {bad} differ from plain")
                raise SystemExit(1)
    print(
        f"# check ({weights.dtype}, batch {batch}): {len(names) * len(ks)} speculative runs "
        f"equal the plain run over {check_tokens} tokens",
        flush=True,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny | flash-shaped")
    ap.add_argument("--layers", type=int, help="V4 layer pattern (0, 0, 4, 128, ...) of N layers")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="timing dtype (auto: bf16 cuda, fp32 cpu)")
    ap.add_argument("--check-dtype", default="auto", help="auto: fp32 cuda, fp64 cpu")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--ks", default="1,3,5")
    ap.add_argument("--sources", "--draft", dest="sources",
                    default="oracle:1.0,oracle:0.8,oracle:0.5,oracle:0.0,mtp",
                    help="draft sources: oracle:RATE, mtp, eagle, eagle:random")  # fmt: skip
    ap.add_argument("--eagle-weights", help="eagle: this head file instead of the shipped one")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--check-tokens", type=int, default=24)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: 1 on the CPU)")
    ap.add_argument(
        "--prompts",
        default="random",
        help="random bytes | heldout (KJV held-out "
        "split: data/kjv, else the committed fixture; for trained presets)",
    )
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    device = resolve_device(None if args.device == "auto" else args.device)
    cuda = device.type == "cuda"
    if args.threads or not cuda:
        torch.set_num_threads(args.threads or 1)  # tiny matmuls: more threads only contend
    dtype = DTYPES.get(args.dtype) or (torch.bfloat16 if cuda else torch.float32)
    check_dtype = DTYPES.get(args.check_dtype) or (torch.float32 if cuda else torch.float64)
    model = preset(args.model)
    if args.layers:
        ratios = ((0, 0) + (4, 128) * args.layers)[: args.layers]
        model = dataclasses.replace(model, compress_ratios=ratios)
    names = [x for x in args.sources.split(",") if x]
    ks = [int(x) for x in args.ks.split(",")]
    s = Setup(model, device, args.page_size, args.prompt_len, args.new_tokens, args.chunk_tokens,
              max(ks))  # fmt: skip
    torch.manual_seed(args.seed)
    weights = _weights(model, device, dtype)
    check_weights = weights if check_dtype == dtype else _weights(model, device, check_dtype)
    heads = {n: eagle_head(n, weights, args.eagle_weights) for n in names}
    check_heads = {n: eagle_head(n, check_weights, args.eagle_weights) for n in names}
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"# {model.name} {model.compress_ratios} + MTP, {dtype} on {name}, "
          f"{torch.get_num_threads()} threads; prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, page {args.page_size}")  # fmt: skip
    print("| source | k | batch | accept len | tok/forward | accept rate | plain tok/s | "
          "spec tok/s | speed-up | draft ms/step | agree |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    rng = np.random.default_rng(args.seed)
    for batch in (int(x) for x in args.batches.split(",")):
        prompts = _prompts(args.prompts, rng, batch, args.prompt_len)
        check(s, check_weights, batch, prompts, names, ks, args.check_tokens, check_heads)
        plain_runner = make_runner(s, weights, batch, None, None)
        plain, plain_s, plain_tokens, plain_batches = time_runner(
            plain_runner, prompts, max_new(s, batch, s.max_k), args.new_tokens
        )
        del plain_runner
        plain_tps = plain_tokens / plain_s
        table = {tuple(p): o for p, o in zip(prompts, plain)}  # the timing dtype's own greedy
        for src in names:
            for k in ks:
                draft = source(src, table, k, heads.get(src))
                runner = make_runner(s, weights, batch, k, draft)
                out, sec, tokens, batches = time_runner(
                    runner, prompts, max_new(s, batch, k), args.new_tokens
                )
                assert runner.spec is not None
                st = runner.spec.stats
                row = dict(
                    model=model.name,
                    layers=model.num_layers,
                    device=name,
                    dtype=str(dtype),
                    source=src,
                    k=k,
                    batch=batch,
                    prompt_len=args.prompt_len,
                    new_tokens=args.new_tokens,
                    mean_acceptance_length=st.mean_acceptance_length,
                    tokens_per_forward=st.tokens_per_forward,
                    acceptance_rate=st.acceptance_rate,
                    plain_tokens_per_s=plain_tps,
                    spec_tokens_per_s=tokens / sec,
                    speedup=tokens / sec / plain_tps,
                    draft_ms_per_step=1e3 * st.draft_s / max(st.forwards, 1),
                    agree=sum(a[: s.new_tokens] == b[: s.new_tokens]
                              for a, b in zip(out, plain)) / batch,
                    mean_batch=sum(batches) / max(1, len(batches)),
                    min_batch=min(batches, default=0), timed_steps=len(batches),
                    plain_mean_batch=sum(plain_batches) / max(1, len(plain_batches)),
                    plain_min_batch=min(plain_batches, default=0),
                )  # fmt: skip
                rows.append(row)
                print(
                    f"| {src} | {k} | {batch} | {row['mean_acceptance_length']:.2f} | "
                    f"{row['tokens_per_forward']:.2f} | {row['acceptance_rate']:.2f} | "
                    f"{plain_tps:.1f} | {row['spec_tokens_per_s']:.1f} | "
                    f"{row['speedup']:.2f}x | {row['draft_ms_per_step']:.2f} | "
                    f"{row['agree']:.2f} |",
                    flush=True,
                )
                del runner
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": run_meta(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
