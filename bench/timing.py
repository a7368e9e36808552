"""GPU timing for the benches: eager calls back to back, and replays of a captured CUDA graph."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def eager_us(fn: Callable[[], object], calls: int = 50, rounds: int = 5) -> float:
    """Median over ``rounds`` of the mean µs per call of ``calls`` back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        per.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(per)


def graph_us(fn: Callable[[], object], calls: int = 20, replays: int = 10, warm: int = 1) -> float:
    """Median µs per call over ``replays`` replays (CUDA events) of ``calls`` calls captured in
    one graph, after ``warm`` eager calls on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warm):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    per = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        per.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(per)
