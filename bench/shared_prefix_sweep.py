"""Launch settings of the shared-prefix indexer decode (GPU): ``B`` requests over one document,
the shared half (every query through row set 0: a prefill tile) timed in a CUDA graph for a
few block sizes, warps, stages and programs per SM, each checked against the reference first.

    python bench/shared_prefix_sweep.py --json out.json

The knobs go to both halves of the split (the own half drops ``block_q``); its rows are 16 per
request here, so the shared half is what the times measure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapters.kernels.indexer import flash_index_logits  # noqa: E402
from adapters.kernels.indexer_reference import index_logits_reference  # noqa: E402
from adapters.kernels.rows import PoolRows  # noqa: E402
from bench.meta import run_meta  # noqa: E402
from bench.timing import graph_us  # noqa: E402

CANDIDATES = [
    {},  # the defaults (ONE_DOT_LAUNCH's prefill tile)
    dict(block_q=2),
    dict(block_q=2, num_warps=4, per_sm=4),
    dict(num_stages=4),
    dict(num_stages=2),
    dict(per_sm=1),
    dict(block_e=128, num_warps=8, per_sm=1),
    dict(num_warps=4, per_sm=2),
    dict(block_q=8, num_warps=8, per_sm=1),
]


def case(b: int, rows: int, kdt, seed: int = 7):
    """``b`` requests whose page tables are one table but for the last page."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    spp, d, h = 16, 128, 64
    pages = rows // spp
    pool = (pages + b) * spp
    table = torch.randperm(pool // spp, generator=gen, device="cuda")[:pages].repeat(b, 1)
    table[:, -1] = torch.arange(pages, pages + b, device="cuda")  # each its own last page
    q = (torch.randn(b, h, d, generator=gen, device="cuda") * 0.5).bfloat16()
    w = torch.randn(b, h, generator=gen, device="cuda").bfloat16()
    keys = torch.randn(pool, d, generator=gen, device="cuda")
    scale = None
    if kdt == torch.float8_e4m3fn:
        scale = torch.rand(pool, generator=gen, device="cuda") + 0.5
        keys = keys.to(kdt)
    else:
        keys = keys.to(kdt)
    lengths = torch.full((b,), rows, device="cuda")
    return q, w, keys, scale, PoolRows(table, lengths, None, spp)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rows", type=int, default=294912)  # a 1,048,640-token batch's bucket / 4
    ap.add_argument("--json")
    args = ap.parse_args()
    out = dict(meta=run_meta(), rows=[])
    print(json.dumps(out["meta"]), flush=True)
    for kdt in (torch.bfloat16, torch.float8_e4m3fn):
        q, w, keys, scale, rows = case(args.batch, args.rows, kdt)
        want = index_logits_reference(q, w, keys, rows, key_scale=scale)
        flops = 2 * q.shape[1] * q.shape[2] * args.batch * args.rows
        for knobs in CANDIDATES:
            row = dict(keys=str(kdt), knobs=knobs)
            try:
                got = flash_index_logits(q, w, keys, rows, key_scale=scale, shared_prefix=True,
                                         **knobs)  # fmt: skip
                fin = torch.isfinite(want)
                rel = float((got[fin] - want[fin]).norm() / want[fin].norm())
                row["rel_l2"] = rel
                if rel > 1e-5:
                    raise AssertionError(f"rel L2 {rel:.2e}")
                call = dict(key_scale=scale, shared_prefix=True, out=torch.empty_like(got), **knobs)
                args_ = (q, w, keys, rows)
                us = graph_us(lambda a=args_, c=call: flash_index_logits(*a, **c))
                row.update(graph_us=us, tflops=flops / us / 1e6)
            except Exception as exc:  # noqa: BLE001 - one failing setting must not stop the rest
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
