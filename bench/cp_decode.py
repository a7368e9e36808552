"""Context-parallel prefill into a decode engine (docs/distributed.md, "From a CP prefill to
decode"), under `torchrun`: every rank runs `cp_prefill(keep=...)` of one prompt, rank 0's
`Runner` imports it (`cp_handoff.import_cp_prefill`) and decodes ``--new-tokens`` greedy
tokens. Against one engine that prefills the prompt itself: time to first token (CP prefill
+ import + the engine's first step, vs the engine's own prefill), and the tokens, which must
be equal (exit 1 otherwise). Rank 0 writes ``{meta, rows}``. Random weights (the ``tiny``
preset by default): the figure is about time and equality, not text.

    torchrun --standalone --nproc-per-node 2 bench/cp_decode.py --backend gloo   # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapters.distributed.cp import cp_prefill  # noqa: E402
from adapters.distributed.cp_comm import DistComm  # noqa: E402
from adapters.distributed.cp_handoff import handoff_range, import_cp_prefill  # noqa: E402
from adapters.engine.runner import Runner  # noqa: E402
from adapters.engine.sampling import SamplingParams  # noqa: E402
from adapters.model.model_config import preset  # noqa: E402
from adapters.model.weights import init_weights  # noqa: E402
from bench.meta import run_meta  # noqa: E402

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cache_config(cfg, args):  # type: ignore[no-untyped-def]
    full = -(-(args.length + args.new_tokens + args.chunk + 256) // args.page) * args.page
    return cfg.cache_config(page_size=args.page, full_capacity=full, swa_capacity=full)


def _engine(cfg, w, args, device) -> Runner:  # type: ignore[no-untyped-def]
    cc = _cache_config(cfg, args)
    return Runner(cfg, cc, device=device, dtype=w.dtype, weights=w, chunk_tokens=args.chunk,
                  max_running=1, graph_decode=False)  # fmt: skip


def _decode(runner: Runner, tokens: list[int], new: int) -> tuple[list[int], float, int]:
    """Greedy ``new`` tokens; (tokens, seconds to the first, cached tokens at admission)."""
    _sync(runner.device)
    t0 = time.perf_counter()
    runner.submit(tokens, SamplingParams(max_new_tokens=new))
    first, done = None, []
    while runner.num_pending:
        done += runner.step()
        if first is None and not runner.num_prefilling:  # the prefill's step emitted one
            _sync(runner.device)
            first = time.perf_counter() - t0
    (r,) = done
    return r.output, first or 0.0, r.cached_tokens


@torch.no_grad()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--length", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--cp-chunk", type=int, default=128, help="tokens per round-robin chunk")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=512, help="the engine's prefill chunk")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float64")
    ap.add_argument("--json", help="rank 0 writes the results here")
    args = ap.parse_args()
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    cfg = preset(args.preset, mtp=False)
    w = init_weights(cfg, device, DTYPES[args.dtype])
    tokens = torch.randint(0, 256, (args.length,), generator=torch.Generator().manual_seed(0))
    prompt = tokens.tolist()
    keep = handoff_range(len(prompt), _cache_config(cfg, args))
    single = None
    if rank == 0:  # one engine alone, prefill included (warm once: kernels, allocator)
        _decode(_engine(cfg, w, args, device), prompt[: args.page * 2], 2)
        single = _decode(_engine(cfg, w, args, device), prompt, args.new_tokens)
    dist.barrier()
    engine = _engine(cfg, w, args, device) if rank == 0 else None
    _sync(device)
    t0 = time.perf_counter()
    pre = cp_prefill(w, tokens.to(device), args.cp_chunk, DistComm(), keep=keep)
    _sync(device)
    t_cp = time.perf_counter() - t0
    if rank != 0:
        dist.destroy_process_group()
        return 0
    assert engine is not None and single is not None
    t1 = time.perf_counter()
    receipt = import_cp_prefill(engine, prompt, pre)
    _sync(device)
    t_import = time.perf_counter() - t1
    out, first, hit = _decode(engine, prompt, args.new_tokens)
    row = dict(
        preset=args.preset, length=args.length, world=world, cp_chunk=args.cp_chunk,
        page=args.page, dtype=args.dtype, backend=args.backend, imported_tokens=receipt.num_tokens,
        admission_hit=hit, cp_prefill_s=round(t_cp, 4), import_s=round(t_import, 4),
        first_token_after_import_s=round(first, 4),
        ttft_cp_s=round(t_cp + t_import + first, 4), ttft_single_s=round(single[1], 4),
        tokens_equal=out == single[0],
    )  # fmt: skip
    row["ttft_speedup"] = round(row["ttft_single_s"] / row["ttft_cp_s"], 3)
    result = dict(meta=run_meta(), rows=[row])
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    dist.destroy_process_group()
    return 0 if row["tokens_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
