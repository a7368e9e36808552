"""Context-parallel prefill (cp = 1 vs cp = N) or tensor-parallel attention (tp = 1 vs tp = N):
prefill time and the final-token logits' equality, for one prompt, under `torchrun`
(docs/distributed.md). Rank 0 times the one-rank dense forward, then every rank runs the
parallel one; rank 0 writes ``{meta, rows}``.

    torchrun --standalone --nproc-per-node 2 bench/cp_prefill.py --backend gloo    # CPU
    bash bench/launch/cp_nccl.sh        # N GPUs, NCCL        bash bench/launch/tp_nccl.sh
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
from adapters.distributed.tp import TPLayout, shard_weights, tp_forward, tp_keys  # noqa: E402
from adapters.model.model import forward  # noqa: E402
from adapters.model.model_config import preset  # noqa: E402
from adapters.model.reference import DenseKeys  # noqa: E402
from adapters.model.weights import init_weights  # noqa: E402
from bench.meta import run_meta  # noqa: E402

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def _timed(fn, device):  # type: ignore[no-untyped-def]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mode", choices=("cp", "tp"), default="cp")
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--length", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--chunk-len", type=int, default=128, help="CP: tokens per round-robin chunk")
    ap.add_argument("--head-multiple", type=int, default=4, help="TP: the kernel's head multiple")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float64")
    ap.add_argument("--repeats", type=int, default=2, help="best of, after one warm-up")
    ap.add_argument("--json", help="rank 0 writes the results here")
    args = ap.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    cfg = preset(args.preset, mtp=False)
    w = init_weights(cfg, device, DTYPES[args.dtype])
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (args.length,), generator=gen).to(device)
    positions = torch.arange(args.length, device=device)
    last = torch.tensor([args.length - 1], device=device)

    def one_rank() -> torch.Tensor:
        return forward(w, tokens, positions, DenseKeys(cfg, args.length), last)[0]

    comm = DistComm()
    layout = TPLayout(world, args.head_multiple)
    shard = shard_weights(w, layout, rank) if args.mode == "tp" else w

    def parallel() -> torch.Tensor:
        if args.mode == "cp":
            return cp_prefill(w, tokens, args.chunk_len, comm).logits
        keys, _ = tp_keys(DenseKeys(cfg, args.length), layout)
        return tp_forward(shard, tokens, positions, keys, comm, last)[0]

    ref, one_s = None, float("inf")
    for _ in range(args.repeats + 1):
        if rank == 0:
            ref, t = _timed(one_rank, device)
            one_s = min(one_s, t)
        dist.barrier()
    par_s = float("inf")
    for _ in range(args.repeats + 1):
        dist.barrier()
        out, t = _timed(parallel, device)
        par_s = min(par_s, t)
    if rank != 0:
        dist.destroy_process_group()
        return
    assert ref is not None
    row = dict(
        mode=args.mode, preset=args.preset, length=args.length, world=world,
        chunk_len=args.chunk_len if args.mode == "cp" else None,
        head_multiple=args.head_multiple if args.mode == "tp" else None,
        padded_heads=layout.padded_heads(cfg) if args.mode == "tp" else None,
        dtype=args.dtype, backend=args.backend, one_rank_s=round(one_s, 4),
        parallel_s=round(par_s, 4), speedup=round(one_s / par_s, 3),
        max_abs_logit_diff=float((out.float() - ref.float()).abs().max()),
    )  # fmt: skip
    result = dict(meta=run_meta(), rows=[row])
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
