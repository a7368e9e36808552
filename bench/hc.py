"""The mHC kernels (`adapters.kernels.hc`) against the torch ops they replace (GPU), one process.

For prefill (8,192 tokens) and decode (1 and 32 tokens) shapes of the flash-shaped model
(4 streams x 4,096 channels, bf16; Sinkhorn over fp32 4 x 4 logits, 12 iterations): the
kernel's result against the reference's (bf16: within one bf16 step of the fp32 result), then
µs per call eager and in a CUDA graph, kernel and reference side by side.

    python bench/hc.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapters.kernels.hc import flash_hc_merge, flash_sinkhorn  # noqa: E402
from adapters.model import ops  # noqa: E402
from bench.meta import run_meta  # noqa: E402
from bench.timing import eager_us, graph_us  # noqa: E402


def merge_row(n: int, d: int = 4096, s: int = 4) -> dict:
    g = torch.Generator(device="cuda").manual_seed(n)
    streams = torch.randn(n, s, d, device="cuda", generator=g).bfloat16()
    y = torch.randn(n, d, device="cuda", generator=g).bfloat16()
    post = (2 * torch.rand(n, s, device="cuda", generator=g)).bfloat16()
    res = ops.sinkhorn_reference(torch.randn(n, s, s, device="cuda", generator=g), 12).bfloat16()
    got = flash_hc_merge(streams, y, post, res)
    exact = ops.hc_merge_reference(streams.double(), y.double(), post.double(), res.double())
    ref = ops.hc_merge_reference(streams, y, post, res)
    step = exact.abs() * 2**-8 + 1e-6  # one bf16 step (and fp32 accumulation near zero)

    def steps(t: torch.Tensor) -> float:
        return float(((t.double() - exact).abs() / step).max())

    row = dict(op="hc_merge", tokens=n, kernel_err_steps=steps(got), reference_err_steps=steps(ref))
    k = lambda: flash_hc_merge(streams, y, post, res)  # noqa: E731
    r = lambda: ops.hc_merge_reference(streams, y, post, res)  # noqa: E731
    row.update(kernel_eager_us=eager_us(k), reference_eager_us=eager_us(r),
               kernel_graph_us=graph_us(k), reference_graph_us=graph_us(r))  # fmt: skip
    gb = (2 * streams.numel() + y.numel()) * 2 / 1e9
    row["kernel_tb_s"] = gb / row["kernel_graph_us"] * 1e3  # GB per µs = 1e3 TB/s
    if n >= 1024:  # the launch sweep: µs in a graph per (block_d, num_warps)
        row["sweep_graph_us"] = {
            f"{bd}x{w}": graph_us(lambda bd=bd, w=w: flash_hc_merge(streams, y, post, res,
                                                                    block_d=bd, num_warps=w))
            for bd, w in ((256, 2), (512, 4), (1024, 4), (1024, 8), (2048, 8), (4096, 8))
        }  # fmt: skip
    return row


def sinkhorn_row(n: int, iters: int = 12, s: int = 4) -> dict:
    x = 3 * torch.randn(n, s, s, device="cuda")
    got, want = flash_sinkhorn(x, iters), ops.sinkhorn_reference(x, iters)
    row = dict(op="sinkhorn", tokens=n, max_abs_diff=float((got - want).abs().max()))
    k = lambda: flash_sinkhorn(x, iters)  # noqa: E731
    r = lambda: ops.sinkhorn_reference(x, iters)  # noqa: E731
    row.update(kernel_eager_us=eager_us(k), reference_eager_us=eager_us(r),
               kernel_graph_us=graph_us(k), reference_graph_us=graph_us(r))  # fmt: skip
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: the kernels' CPU checks are tests/test_hc_kernel.py")
        return 2
    out = dict(meta=run_meta(), rows=[])
    print(json.dumps(out["meta"]), flush=True)
    ok = True
    for row in [merge_row(n) for n in (8192, 32, 1)] + [sinkhorn_row(n) for n in (8192, 32, 1)]:
        good = row.get("kernel_err_steps", 0) <= 1.0 and row.get("max_abs_diff", 0) <= 1e-5
        ok &= good
        row["ok"] = good
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
