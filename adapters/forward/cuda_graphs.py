"""`CudaGraphs`: the CUDA graphs of one step function, captured per (batch, context) bucket."""

from __future__ import annotations

from collections.abc import Callable

import torch

from adapters.memory.pools import KVPools


class CudaGraphs:
    """CUDA graphs of one step function ``run(batch, context) -> output``, one captured per
    (batch bucket, context bucket) and replayed; held by composition by every object whose step
    is a graph (`GraphDecoder`, `mtp.MTPDrafter`). A re-balance that resized the pools (their
    ``generation`` moved) drops every graph: they captured the old tensors. CUDA only."""

    def __init__(self, run: Callable[[int, int], torch.Tensor], pools: KVPools) -> None:
        self.run, self.pools = run, pools
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pools_generation = pools.generation

    # CUDA only (CI has no GPU): bench/gpu_equivalence.py checks graph decode against the
    # reference on the H200, bench/decode_context.py times it (docs/benchmarks.md).

    def replay(  # pragma: no cover
        self, batch: int, context: int, valid: torch.Tensor
    ) -> torch.Tensor:
        """The output of ``run(batch, context)`` (its graph's buffer, reused by the next
        replay); ``valid``: the batch slots' validity buffer, zeroed while capturing."""
        key = (batch, context)
        if self._pools_generation != self.pools.generation:  # captured the old tensors
            self._graphs.clear()
            self._pools_generation = self.pools.generation
        if key not in self._graphs:
            self._graphs[key] = self._capture(batch, context, valid)
        graph, out = self._graphs[key]
        graph.replay()
        return out

    def _capture(self, batch: int, context: int, valid: torch.Tensor):  # pragma: no cover
        # Warm up on a side stream (allocator pools, lazy inits), then capture. Warm-up and
        # capture write only sentinel rows: padding rows are invalid. The live rows are
        # rewritten identically by the replay that follows.
        saved = valid.clone()
        valid.zero_()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.run(batch, context)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.run(batch, context)
        valid.copy_(saved)
        return graph, out
