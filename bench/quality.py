"""Quality through the cache (issue #15 item 3): held-out bits per byte of the trained model
computed through the runner, and what each approximation costs, as a delta against exact
prefill.

Per-token log-probabilities come from every row of every prefill chunk. The runner's own
``SamplingParams(prompt_logprobs=True)`` computes the whole prompt (a cached prefix has no
logits to give), so it cannot measure reuse; `ScoringRunner` (below, bench-only, as
bench/tail_only.py's ``LogitTap``) asks the prefill forward for every row of each chunk and
keeps them per position, so a request admitted on a cache hit scores exactly the positions it
computes. Nothing in ``adapters/`` changes.

1. **Exactness** (``--exact-docs`` documents of ``--exact-bytes`` held-out bytes, fp64): each
   document is scored by two requests, ``BOS + doc[:half]`` and then ``BOS + doc`` (admitted
   on a cache hit of the first one), and every log-probability is compared with the dense
   reference (`adapters.model.reference.reference_logits`): max |difference| (0.0 expected).
2. **Approximations** (``--long-docs`` documents of ``--long-bytes`` held-out bytes,
   ``--dtype``): bits per byte of the last ``--score-bytes`` bytes against the exact runner's,
   and greedy agreement over ``--greedy-tokens`` tokens generated after the whole document:

   * ``bounded replay``: ``doc[:-score]`` cached, every window tombstoned, then ``doc``
     admitted on a REPLAY hit (its window rebuilt from ``W`` tokens, docs/replay.md);
   * ``fp8 index`` / ``fp4 index`` / ``fp8 swa``: the cache formats of the indexer keys and of
     the window KV (`adapters.memory.formats.CacheFormat`), the whole document scored;
   * ``hisparse``: C4 KV in a host mirror with a ``--hisparse-pages`` device buffer (exact by
     construction: the delta should be 0);
   * ``tail-only``: needs a V4.1-shared model (``--model tiny-shared-trained``; the unshared
     model reports the runner's ``ValueError``). Greedy agreement after the whole document
     prefilled tail-only; the bits of the scored bytes computed in chunks of W after a
     tail-only prefill of the rest (`tail_only_scores`: skipped rows have no logits to score).

    python bench/quality.py                              # CPU, tiny-trained
    python bench/quality.py --device cuda --long-bytes 8192 --json bench/results/quality_h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from adapters.engine.batch import with_every_row  # noqa: E402
from adapters.engine.runner import GenerationResult, Runner  # noqa: E402
from adapters.engine.sampling import SamplingParams  # noqa: E402
from adapters.memory.device import resolve_device  # noqa: E402
from adapters.memory.formats import CacheFormat  # noqa: E402
from adapters.model.model_config import ModelConfig, preset  # noqa: E402
from adapters.model.reference import reference_logits  # noqa: E402
from adapters.model.tokenizer import BOS  # noqa: E402
from adapters.model.weights import ModelWeights  # noqa: E402
from adapters.model.weights_file import load_shipped  # noqa: E402
from adapters.training.corpus import load_split  # noqa: E402
from bench.meta import run_meta  # noqa: E402

EVERYTHING = 10**15
LN2 = math.log(2.0)


class ScoringRunner(Runner):
    """A runner that keeps ``log p(prompt[i] | prompt[:i])`` for every prompt token ``i`` whose
    predicting position its prefill forwards compute: ``scores[request_id][i]`` (fp64)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scores: dict[int, dict[int, float]] = {}
        self.scheduler.logit_rows = with_every_row  # every row of every chunk
        self._prefill_done = self.emission.prefill_done
        self.emission.prefill_done = self._scored  # type: ignore[method-assign]

    def _scored(self, batch, logits):
        blocks = torch.split(logits, [len(c) for c in batch.chunks])
        for seq, start, block in zip(batch.seqs, batch.plan.starts, blocks):
            got = self.scores.setdefault(seq.result.request_id, {})
            got.update(token_logprobs(seq.result.prompt, start, block))
        return self._prefill_done(batch, logits)


def token_logprobs(prompt: list[int], start: int, logits: torch.Tensor) -> dict[int, float]:
    """``{i: log p(prompt[i])}`` from the logits rows of positions ``start, start + 1, ...``."""
    n = min(logits.shape[0], len(prompt) - 1 - start)
    if n <= 0:
        return {}
    targets = torch.tensor(prompt[start + 1 : start + 1 + n], device=logits.device)
    picked = torch.log_softmax(logits[:n].double(), -1).gather(1, targets[:, None])[:, 0]
    return dict(zip(range(start + 1, start + 1 + n), picked.tolist()))


@dataclass(frozen=True)
class Setup:
    """One runner configuration against the exact one."""

    name: str
    bounded_replay: bool = False
    index_format: CacheFormat = CacheFormat.BF16
    swa_format: CacheFormat = CacheFormat.BF16
    hisparse_pages: int | None = None
    tail_only: bool = False


def make_runner(model: ModelConfig, weights: ModelWeights, setup: Setup, max_len: int,
                chunk_tokens: int) -> ScoringRunner:  # fmt: skip
    """A cold runner (one request at a time, paged decode) with room for a few ``max_len``
    requests. Raises the runner's `ValueError` for a refused configuration."""
    p = 16
    full = -(-4 * (max_len + 256) // p) * p
    cache = model.cache_config(page_size=p, full_capacity=full, swa_capacity=full,
                               bounded_replay=setup.bounded_replay)  # fmt: skip
    return ScoringRunner(model, cache, device=weights.device, dtype=weights.dtype,
                         weights=weights, chunk_tokens=chunk_tokens, max_running=1,
                         graph_decode=False, hisparse_pages=setup.hisparse_pages,
                         index_format=setup.index_format, swa_format=setup.swa_format,
                         tail_only=setup.tail_only)  # fmt: skip


def serve(
    runner: ScoringRunner, prompt: list[int], new_tokens: int
) -> tuple[GenerationResult, dict[int, float]]:
    """One greedy request; its result and the log-probabilities its prefill computed."""
    (result,) = runner.generate([prompt], SamplingParams(max_new_tokens=new_tokens))
    if result.finish_reason == "error":
        raise RuntimeError(f"request failed: {result.error}")
    return result, runner.scores.pop(result.request_id, {})


def reference_logprobs(weights: ModelWeights, tokens: list[int]) -> list[float]:
    """``log p(tokens[i] | tokens[:i])`` for ``i = 1 .. len - 1`` from the dense reference."""
    with torch.no_grad():
        logits = reference_logits(weights, tokens)
    return list(token_logprobs(tokens, 0, logits).values())


# -- item 1: exactness through prefix reuse ------------------------------------------------


@dataclass(frozen=True)
class Exactness:
    documents: int
    scored_bytes: int
    hit_tokens: int
    bits_per_byte: float
    reference_bits_per_byte: float
    max_abs_logprob_diff: float


def exactness(model: ModelConfig, weights: ModelWeights, docs: list[bytes],
              chunk_tokens: int = 256) -> Exactness:  # fmt: skip
    """Each document scored by ``BOS + doc[:half]`` and then ``BOS + doc`` (a cache hit on the
    first), every log-probability against the reference's. Raises `RuntimeError` if the second
    request found no hit or a position went unscored."""
    runner = make_runner(model, weights, Setup("exact"), max(len(d) for d in docs) + 2,
                         chunk_tokens)  # fmt: skip
    total, ref_total, worst, hits, scored = 0.0, 0.0, 0.0, 0, 0
    for doc in docs:
        tokens = [BOS, *doc]
        _, first = serve(runner, tokens[: len(tokens) // 2 + 1], 1)
        second, rest = serve(runner, tokens, 1)
        if second.cached_tokens == 0:
            raise RuntimeError("the second request of a document found no cache hit")
        ref = reference_logprobs(weights, tokens)
        got = []
        for i in range(1, len(tokens)):
            if i not in rest and i not in first:
                raise RuntimeError(f"position {i} was not scored")
            got.append(rest[i] if i in rest else first[i])
        both = [(first[i], ref[i - 1]) for i in first] + list(zip(got, ref))
        worst = max(worst, max(abs(a - b) for a, b in both))
        total, ref_total = total - sum(got), ref_total - sum(ref)
        hits, scored = hits + second.cached_tokens, scored + len(doc)
    return Exactness(len(docs), scored, hits, total / LN2 / scored, ref_total / LN2 / scored,
                     worst)  # fmt: skip


# -- item 2: approximations against exact prefill -------------------------------------------


@dataclass(frozen=True)
class Served:
    bits: float  # summed over the scored bytes
    tokens: list[int]
    approximate: bool
    replayed_hits: int


def serve_setup(model: ModelConfig, weights: ModelWeights, setup: Setup, doc: bytes,
                score_bytes: int, greedy: int, chunk_tokens: int) -> Served:  # fmt: skip
    """``BOS + doc`` through a cold runner of ``setup``; the bits of the last ``score_bytes``
    bytes and ``greedy`` tokens generated after the document. Bounded replay first caches
    ``doc[:-score_bytes]`` and tombstones every window, so the document is a REPLAY hit."""
    runner = make_runner(model, weights, setup, len(doc) + greedy + 2, chunk_tokens)
    tokens = [BOS, *doc]
    first = len(tokens) - score_bytes
    if setup.bounded_replay:
        serve(runner, tokens[:first], 1)
        runner.cache.evict(swa_tokens=EVERYTHING)
    result, scores = serve(runner, tokens, greedy)
    if setup.tail_only:
        scores = tail_only_scores(model, weights, setup, tokens, first, greedy, chunk_tokens)
    bits = -sum(scores[i] for i in range(first, len(tokens))) / LN2
    return Served(bits, result.output, result.approximate, runner.stats.replayed_hits)


def tail_only_scores(model: ModelConfig, weights: ModelWeights, setup: Setup, tokens: list[int],
                     first: int, greedy: int, chunk_tokens: int) -> dict[int, float]:  # fmt: skip
    """Tail-only is a *decoder-side* approximation: a prefill row it skips has no later-layer
    state and no logits worth scoring (the runner refuses prompt logprobs with it). So the
    prefix ``tokens[:first]`` is prefilled tail-only (chunks of ``chunk_tokens`` keep the later
    layers for their last W tokens only), then the scored bytes are computed in chunks of W,
    which skip nothing: every scored position runs every layer, as a decode step would, over
    the approximate state the prefix left. Returns their log-probabilities."""
    runner = make_runner(model, weights, setup, len(tokens) + greedy + 2, chunk_tokens)
    serve(runner, tokens[:first], 1)
    runner.chunk_tokens = model.window  # the scored part: chunks that skip nothing
    _, scores = serve(runner, tokens, 1)
    return scores


def agreement(a: list[int], b: list[int]) -> tuple[int, float]:
    """Tokens equal up to the first difference, and the share equal position-wise."""
    prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return prefix, sum(x == y for x, y in zip(a, b)) / max(1, len(a))


def setups(hisparse_pages: int) -> list[Setup]:
    return [
        Setup("bounded replay", bounded_replay=True),
        Setup("tail-only", tail_only=True),
        Setup("fp8 index keys", index_format=CacheFormat.FP8),
        Setup("fp4 index keys", index_format=CacheFormat.FP4),
        Setup("fp8 window KV", swa_format=CacheFormat.FP8),
        Setup(f"hisparse ({hisparse_pages} pages)", hisparse_pages=hisparse_pages),
    ]


def approximations(
    model: ModelConfig, weights: ModelWeights, docs: list[bytes], args
) -> list[dict]:
    """One row per setup: Δ bits per byte against the exact runner over the scored bytes of
    every document, and greedy agreement; a refused setup keeps its reason."""
    exact = [serve_setup(model, weights, Setup("exact"), d, args.score_bytes, args.greedy_tokens,
                         args.chunk_tokens) for d in docs]  # fmt: skip
    scored = args.score_bytes * len(docs)
    base = sum(e.bits for e in exact) / scored
    rows = [dict(setup="exact", bits_per_byte=base, delta_bits_per_byte=0.0, delta_pct=0.0,
                 greedy_prefix=float(args.greedy_tokens), greedy_share=1.0)]  # fmt: skip
    for setup in setups(args.hisparse_pages):
        t0 = time.perf_counter()
        try:
            got = [serve_setup(model, weights, setup, d, args.score_bytes, args.greedy_tokens,
                               args.chunk_tokens) for d in docs]  # fmt: skip
        except ValueError as err:
            rows.append(dict(setup=setup.name, refused=str(err).splitlines()[0]))
            continue
        bpb = sum(g.bits for g in got) / scored
        agree = [agreement(e.tokens, g.tokens) for e, g in zip(exact, got)]
        rows.append(dict(
            setup=setup.name, bits_per_byte=bpb, delta_bits_per_byte=bpb - base,
            delta_pct=100 * (bpb - base) / base,
            greedy_prefix=sum(a[0] for a in agree) / len(agree),
            greedy_share=sum(a[1] for a in agree) / len(agree),
            approximate=sum(g.approximate for g in got),
            replayed_hits=sum(g.replayed_hits for g in got),
            seconds=round(time.perf_counter() - t0, 1),
        ))  # fmt: skip
    return rows


# -- the documents, the report --------------------------------------------------------------


def heldout_docs(data: Path, n: int, size: int) -> list[bytes]:
    """``n`` documents of ``size`` held-out bytes spread evenly over the split, each starting
    at a line. Raises `ValueError` when the split is too short."""
    text = load_split(data, verify=False).heldout
    if n * size > len(text):
        raise ValueError(f"{n} x {size} bytes: the held-out split has {len(text)}")
    stride = (len(text) - size) // max(1, n - 1) if n > 1 else 0
    docs = []
    for k in range(n):
        at = text.rfind(b"\n", 0, k * stride) + 1 if k else 0
        docs.append(text[at : at + size])
    return docs


def default_data() -> Path:
    full = ROOT / "data" / "kjv"
    return full if (full / "heldout.txt").exists() else ROOT / "data" / "kjv_fixture"


def table(report: dict) -> str:
    ex = report["exactness"]
    lines = [
        f"held-out, {ex['documents']} x {report['args']['exact_bytes']} bytes through the runner "
        f"(second request of each on a cache hit, {ex['hit_tokens']} hit tokens), float64: "
        f"{ex['bits_per_byte']:.4f} bits per byte; reference {ex['reference_bits_per_byte']:.4f}; "
        f"max |Δ log-prob| {ex['max_abs_logprob_diff']:.3g}",
        "",
        f"approximations, {report['args']['long_docs']} documents of "
        f"{report['args']['long_bytes']} bytes, the last {report['args']['score_bytes']} scored, "
        f"{report['args']['dtype']}, greedy {report['args']['greedy_tokens']} tokens:",
        "",
        "| setup | bits/byte | Δ bits/byte | Δ % | greedy prefix | greedy agreement |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["approximations"]:
        if "refused" in r:
            lines.append(f"| {r['setup']} | refused: {r['refused']} | | | | |")
            continue
        lines.append(f"| {r['setup']} | {r['bits_per_byte']:.4f} | "
                     f"{r['delta_bits_per_byte']:+.4f} | {r['delta_pct']:+.2f} | "
                     f"{r['greedy_prefix']:.1f} | {100 * r['greedy_share']:.1f} % |")  # fmt: skip
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-trained")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    ap.add_argument("--data", type=Path, default=None)
    ap.add_argument("--exact-docs", type=int, default=4)
    ap.add_argument("--exact-bytes", type=int, default=1024)
    ap.add_argument("--long-docs", type=int, default=2)
    ap.add_argument("--long-bytes", type=int, default=4096)
    ap.add_argument("--score-bytes", type=int, default=512)
    ap.add_argument("--greedy-tokens", type=int, default=64)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--hisparse-pages", type=int, default=40)
    ap.add_argument("--json", type=Path, default=None)
    return ap


def run(args: argparse.Namespace) -> dict:
    device = resolve_device(args.device)
    model = preset(args.model)
    data = args.data or default_data()
    t0 = time.perf_counter()
    w64 = load_shipped(model, device, torch.float64)
    ex = exactness(model, w64, heldout_docs(data, args.exact_docs, args.exact_bytes),
                   args.chunk_tokens)  # fmt: skip
    t1 = time.perf_counter()
    weights = load_shipped(model, device, getattr(torch, args.dtype))
    rows = approximations(model, weights, heldout_docs(data, args.long_docs, args.long_bytes), args)
    t2 = time.perf_counter()
    recorded = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    return dict(
        meta=run_meta(), args=recorded,
        data=str(data), exactness=ex.__dict__, approximations=rows,
        seconds=dict(exactness=round(t1 - t0, 1), approximations=round(t2 - t1, 1)),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    torch.manual_seed(0)
    report = run(args)
    print(table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
