"""Launch-knob sweep of `lightning_topk` against `torch.topk`, in one process (CUDA).

    python bench/topk_sweep.py --shape 32x262144 --k 512 \\
        --variants "algorithm=bound;ctas=8" "algorithm=bound;gather_regs=64"

Each variant (``;``-separated ``knob=value``, ``a/b`` for a tuple) is first checked exact
against `reference.topk_reference` (as a set: the unsorted order is the kernel's), then timed
like `bench/kernels.py` does (CUDA-graph replays of back-to-back calls, median of 20).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.kernels import Timer, _index_order  # noqa: E402


def knobs(text: str) -> dict:
    out: dict = {}
    for kv in filter(None, text.split(";")):
        name, value = kv.split("=")
        if "/" in value:
            out[name] = tuple(int(w) for w in value.split("/"))
        elif value.lstrip("-").isdigit():
            out[name] = int(value)
        else:
            out[name] = value
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", action="append", required=True, help="BxN, repeatable")
    p.add_argument("--k", type=int, default=512)
    p.add_argument("--variants", nargs="+", default=[""])
    args = p.parse_args()
    tk = importlib.import_module("adapters.kernels.topk_lightning")
    ref = importlib.import_module("adapters.kernels.reference")
    timer = Timer(torch.device("cuda"))
    for shape in args.shape:
        b, n = (int(v) for v in shape.split("x"))
        x = torch.randn(b, n, device="cuda", generator=torch.Generator("cuda").manual_seed(7))
        base, _ = timer(functools.partial(torch.topk, x, args.k), graph_ms=2.0)
        print(f"{shape} k={args.k}: torch.topk {base:.1f} us")
        want = ref.topk_reference(x, args.k)
        for text in args.variants:
            call = functools.partial(tk.lightning_topk, x, args.k, **knobs(text))
            got = _index_order(*call())
            exact = all(torch.equal(a, w) for a, w in zip(got, want))
            us, how = timer(call, graph_ms=2.0)
            print(
                f"  {text or 'default':50} {us:7.1f} us  {base / us:5.2f}x  "
                f"{'exact' if exact else 'WRONG'}  ({how})",
                flush=True,
            )


if __name__ == "__main__":
    main()
