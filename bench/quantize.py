"""The fused FP8 quantise-and-store (`adapters.kernels.quantize.fp8_store`) against the torch
chain it replaces (`formats.write_rows`), GPU, one process: the bytes and scales compared
(they must be equal), then µs per call eager and in a CUDA graph, side by side, for decode
(1 and 32 rows) and prefill (8,192 rows) writes of the SWA latent (512 channels) and the
indexer keys (128).

    python bench/quantize.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapters.kernels.quantize import fp8_store  # noqa: E402
from adapters.memory.formats import CacheFormat, RowLayout, write_rows  # noqa: E402
from bench.meta import run_meta  # noqa: E402
from bench.timing import eager_us, graph_us  # noqa: E402


def row(n: int, d: int, pool_rows: int = 1 << 20) -> dict:
    g = torch.Generator(device="cuda").manual_seed(n + d)
    x = torch.randn(n, d, device="cuda", generator=g)
    x *= torch.exp2(torch.randint(-20, 20, (n, 1), device="cuda", generator=g).float())
    slots = torch.randperm(pool_rows, device="cuda", generator=g)[:n]
    a = RowLayout(CacheFormat.FP8, d).zeros(pool_rows, "cuda")
    b = RowLayout(CacheFormat.FP8, d).zeros(pool_rows, "cuda")
    fp8_store(a.values, a.scales, slots, x)
    write_rows(b.values, b.scales, slots, x, CacheFormat.FP8)
    bad_values = a.values.view(torch.uint8)[slots] != b.values.view(torch.uint8)[slots]
    bad_scales = a.scales[slots] != b.scales[slots]
    same = not bool(bad_values.any() or bad_scales.any())

    def fused():
        fp8_store(a.values, a.scales, slots, x)

    def chain():
        write_rows(b.values, b.scales, slots, x, CacheFormat.FP8)

    differing = int((bad_values.any(1) | bad_scales).sum())
    out = dict(rows=n, d=d, same_bytes=same, rows_differing=differing,
               scales_differing=int(bad_scales.sum()))  # fmt: skip
    for name, fn in (("fused", fused), ("torch_chain", chain)):
        out[f"{name}_eager_us"] = eager_us(fn)
        out[f"{name}_graph_us"] = graph_us(fn)
    out["graph_ratio"] = out["torch_chain_graph_us"] / out["fused_graph_us"]
    out["eager_ratio"] = out["torch_chain_eager_us"] / out["fused_eager_us"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: the CPU check is tests/test_quantize_kernel.py")
        return 2
    result = dict(meta=run_meta(), rows=[])
    print(json.dumps(result["meta"]), flush=True)
    for n in (1, 32, 8192):
        for d in (512, 128):
            r = row(n, d)
            result["rows"].append(r)
            print(json.dumps(r), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if all(r["same_bytes"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
