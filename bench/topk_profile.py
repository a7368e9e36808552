"""Per-kernel device time of `lightning_topk` (torch.profiler), to see where a call's time goes.

    python bench/topk_profile.py [--shapes 1x262144,32x262144] [--k 512] [--calls 50]

For each shape and algorithm: the mean device time of each kernel per call, their sum, and the
wall time per call of back-to-back calls (launch gaps included). Needs CUDA.
"""

from __future__ import annotations

import argparse
import functools
import importlib
from collections import defaultdict

import torch


def profile(fn, calls: int) -> dict[str, float]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = defaultdict(float)
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name[:60]] += e.device_time / calls
    return dict(times)


def wall(fn, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="1x262144,32x262144")
    p.add_argument("--k", type=int, default=512)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--variants", default="histogram,bound")
    args = p.parse_args()
    tk = importlib.import_module("adapters.kernels.topk")
    for shape in args.shapes.split(","):
        b, n = (int(v) for v in shape.split("x"))
        x = torch.randn(b, n, device="cuda")
        ws = tk.topk_workspace(b, "cuda")
        for variant in args.variants.split(","):
            algo, *rest = variant.split(";")
            knobs = {a: int(v) for a, v in (kv.split("=") for kv in rest)}
            call = functools.partial(
                tk.lightning_topk, x, args.k, algorithm=algo, workspace=ws, **knobs
            )
            times = profile(call, args.calls)
            print(f"{b}x{n} k={args.k} {variant}: wall {wall(call, args.calls):.1f} us/call")
            for name, t in sorted(times.items(), key=lambda kv: -kv[1]):
                print(f"    {t:8.2f} us  {name}")
            print(f"    {sum(times.values()):8.2f} us  (sum of kernels)")
        t = profile(functools.partial(torch.topk, x, args.k), args.calls)
        print(f"{b}x{n} k={args.k} torch.topk: sum of kernels {sum(t.values()):.1f} us")


if __name__ == "__main__":
    main()
