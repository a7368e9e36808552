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


KERNELS = {"histogram": ("hist1", "hist2", "select"), "bound": ("colmax", "gather", "finish")}
PHASES = ("entry->ready", "ready->streamed", "streamed->5", "5->6", "6->end")


def phases(tk, x, k, algo: str, knobs: dict) -> None:
    """Per-CTA phase trace of one eager call (`lightning_topk(trace=...)`): for each kernel, when
    its first and last CTA start and when the last one ends (us after the first kernel's first
    CTA), then the median / max duration of each marked phase over its CTAs (SM clocks, in us).
    Slots: 2 entry, 3 inputs ready (after the wait for the previous kernel), 4 streaming done,
    5 / 6 kernel-specific (the tail: after the ticket / after the selection), 7 end."""
    b = x.shape[0]
    for _ in range(3):
        tk.lightning_topk(x, k, algorithm=algo, **knobs)
    tr = tk.topk_trace(b, "cuda")
    tk.lightning_topk(x, k, algorithm=algo, trace=tr, **knobs)
    torch.cuda.synchronize()
    t = tr.cpu()
    used = t[..., 0] != 0
    t0 = t[..., 0][used].min().item()
    ns_per_clk = []
    for j in range(3):
        rows = t[j][used[j]]
        full = rows[(rows[:, 1] != 0) & (rows[:, 7] != 0)]
        if len(full):
            ns_per_clk.append((full[:, 1] - full[:, 0]).double() / (full[:, 7] - full[:, 2]))
    scale = torch.cat(ns_per_clk).median().item() / 1e3 if ns_per_clk else 0.0  # us per clock
    for j, name in enumerate(KERNELS[algo]):
        rows = t[j][used[j]]
        if not len(rows):
            continue
        ends = rows[:, 1][rows[:, 1] != 0]
        line = (
            f"      {name:7} CTAs {len(rows):5}  first start {(rows[:, 0].min() - t0) / 1e3:6.2f}"
            f"  last start {(rows[:, 0].max() - t0) / 1e3:6.2f}"
            f"  last end {((ends.max() - t0) / 1e3) if len(ends) else float('nan'):6.2f} us |"
        )
        for a, (lo, hi) in enumerate(((2, 3), (3, 4), (4, 5), (5, 6), (6, 7))):
            ok = (rows[:, lo] != 0) & (rows[:, hi] != 0)
            if ok.any():
                d = (rows[ok, hi] - rows[ok, lo]).double() * scale
                line += f" {PHASES[a]} {d.median().item():5.2f}/{d.max().item():5.2f}"
        print(line)


def compiled(tk) -> None:
    """Registers and spills of every compiled top-k kernel (this Triton, this GPU)."""
    for name in sorted(dir(tk)):
        caches = getattr(getattr(tk, name), "device_caches", None)
        if not isinstance(caches, dict):
            continue
        for entry in caches.values():
            cache = entry[0] if isinstance(entry, tuple) else entry
            for kern in getattr(cache, "values", lambda: [])():
                try:
                    kern._init_handles()
                except Exception:  # noqa: BLE001 - older Triton: already initialised
                    pass
                meta = getattr(kern, "metadata", None)
                print(
                    f"    compiled {name:16} warps {getattr(meta, 'num_warps', '?')} "
                    f"regs {getattr(kern, 'n_regs', '?')} spills {getattr(kern, 'n_spills', '?')}"
                    f" shared {getattr(meta, 'shared', '?')}"
                )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="1x262144,32x262144")
    p.add_argument("--k", type=int, default=512)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--variants", default="histogram,bound")
    args = p.parse_args()
    tk = importlib.import_module("adapters.kernels.topk_lightning")
    for shape in args.shapes.split(","):
        b, n = (int(v) for v in shape.split("x"))
        x = torch.randn(b, n, device="cuda")
        ws = tk.topk_workspace(b, "cuda")
        for variant in args.variants.split(","):
            algo, *rest = variant.split(";")
            knobs = {
                a: tuple(int(w) for w in v.split("/")) if "/" in v else int(v)
                for a, v in (kv.split("=") for kv in rest)
            }
            call = functools.partial(
                tk.lightning_topk, x, args.k, algorithm=algo, workspace=ws, **knobs
            )
            times = profile(call, args.calls)
            print(f"{b}x{n} k={args.k} {variant}: wall {wall(call, args.calls):.1f} us/call")
            for name, t in sorted(times.items(), key=lambda kv: -kv[1]):
                print(f"    {t:8.2f} us  {name}")
            print(f"    {sum(times.values()):8.2f} us  (sum of kernels)")
            phases(tk, x, args.k, algo, knobs)
        t = profile(functools.partial(torch.topk, x, args.k), args.calls)
        print(f"{b}x{n} k={args.k} torch.topk: sum of kernels {sum(t.values()):.1f} us")
    compiled(tk)


if __name__ == "__main__":
    main()
