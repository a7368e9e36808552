"""A/B of the speculative step's host path against the device-draft path, in one process.

Interleaved over ``--reps`` repetitions: plain greedy decode, MTP k=2, EAGLE k=2 and k=3, each
speculative row with ``device_drafts`` off (old: drafts read back before verify, two host
reads) and on (new: drafts stay on the device, one host read), at every ``--batches`` size.
Per row: median wall ms per decode step, tokens per step, ms per token, speed-up over plain
(median ms/token), and the share of verify steps that took the device path. Greedy outputs of
every row are checked equal to plain decoding (it stops on a difference).

    python bench/spec_ab.py --json bench/results/spec_ab_h200.json            # GPU, ~2 min
    python bench/spec_ab.py --device cpu --reps 1 --new-tokens 8 --prompt-len 64  # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from adapters.engine.eagle_draft import EagleDraft  # noqa: E402
from adapters.engine.runner import Runner  # noqa: E402
from adapters.engine.sampling import SamplingParams  # noqa: E402
from adapters.model.eagle import load_shipped_eagle  # noqa: E402
from adapters.model.model_config import preset  # noqa: E402
from adapters.model.tokenizer import BOS  # noqa: E402
from adapters.model.weights_file import load_shipped  # noqa: E402
from bench.meta import run_meta  # noqa: E402
from bench.quality import default_data, heldout_docs  # noqa: E402

ROWS = [("plain", None, None), ("mtp", 2, None), ("eagle", 2, None), ("eagle", 3, None)]


def make_runner(model, weights, args, batch: int, source: str, k: int | None) -> Runner:
    p = 64
    full = -(-4 * (args.prompt_len + args.new_tokens + 4 * p) * batch // p) * p
    cache = model.cache_config(page_size=p, full_capacity=full, swa_capacity=full,
                               speculative=k is not None)  # fmt: skip
    draft = EagleDraft(load_shipped_eagle(weights)) if source == "eagle" else None
    return Runner(model, cache, device=weights.device, dtype=weights.dtype, weights=weights,
                  chunk_tokens=1024, max_running=batch, speculative_tokens=k, draft=draft,
                  graph_decode=True)  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(runner: Runner, prompts, new_tokens: int) -> tuple[float, int, int, list]:
    """One pass: prefill, then decode to completion timed; (seconds, steps, tokens, outputs)."""
    ids = [runner.submit(p, SamplingParams(max_new_tokens=new_tokens)) for p in prompts]
    while runner.num_prefilling or runner.stats.decode_tokens == 0:
        runner.step()
    before, steps, done = runner.stats.decode_tokens, 0, []
    sync(runner.device)
    t0 = time.perf_counter()
    while runner.num_pending:
        done += runner.step()
        steps += 1
    sync(runner.device)
    wall = time.perf_counter() - t0
    by_id = {r.request_id: r.output for r in done}
    return wall, steps, runner.stats.decode_tokens - before, [by_id[i] for i in ids]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = preset("tiny-trained")
    weights = load_shipped(model, device, dtype)
    out: dict = dict(meta=run_meta(), args=vars(args), rows=[])
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = [[BOS, *d] for d in heldout_docs(default_data(), batch, args.prompt_len)]
        variants: list[tuple[str, Runner, bool | None]] = []  # (name, runner, device_drafts)
        for source, k, _ in ROWS:
            if k is None:
                variants.append(
                    ("plain", make_runner(model, weights, args, batch, source, k), None)
                )
                continue
            for on in (False, True):
                r = make_runner(model, weights, args, batch, source, k)
                assert r.spec is not None
                r.spec.device_drafts = on
                variants.append((f"{source} k={k} {'new' if on else 'old'}", r, on))
        samples: dict[str, list[tuple[float, int, int]]] = {n: [] for n, _, _ in variants}
        plain_out = None
        for rep in range(args.reps + 1):  # rep 0 warms (captures graphs), not recorded
            for name, r, _ in variants:
                wall, steps, tokens, outs = timed(r, prompts, args.new_tokens)
                if plain_out is None:
                    plain_out = outs
                elif outs != plain_out:
                    print(f"FAIL: {name} batch {batch}: output differs from plain decoding")
                    return 1
                if rep:
                    samples[name].append((wall, steps, tokens))
        base = None
        for name, r, flag in variants:
            ms_step = [1e3 * w / max(1, s) for w, s, _ in samples[name]]
            ms_tok = [1e3 * w / max(1, t) for w, _, t in samples[name]]
            row: dict[str, Any] = dict(batch=batch, name=name, device_drafts=flag,
                       ms_per_step=statistics.median(ms_step),
                       ms_per_step_all=[round(x, 4) for x in ms_step],
                       tokens_per_step=statistics.median(t / max(1, s) for _, s, t in
                                                         samples[name]),
                       ms_per_token=statistics.median(ms_tok))  # fmt: skip
            if r.spec is not None:
                st = r.spec.stats
                row["device_step_share"] = st.device_steps / max(1, st.forwards)
                row["acceptance_length"] = st.mean_acceptance_length
            base = row["ms_per_token"] if name == "plain" else base
            row["speedup"] = base / row["ms_per_token"]
            out["rows"].append(row)
            print(f"batch {batch:2d}  {name:16s} {row['ms_per_step']:7.3f} ms/step  "
                  f"{row['tokens_per_step']:5.2f} tok/step  {row['ms_per_token']:7.3f} ms/tok  "
                  f"{row['speedup']:5.2f}x  device {row.get('device_step_share', 0):.2f}",
                  flush=True)  # fmt: skip
    print("outputs equal to plain decoding: yes")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
