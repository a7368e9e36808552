"""No silent fallback: `Runner.paths` and the run summary say which code ran (fused kernels or
torch references, graph / eager / paged / speculative decode, HiSparse copy path)."""

from __future__ import annotations

import pytest
import torch
from small_models import CFG

from adapters import kernels
from adapters.cli.run_command import summary
from adapters.engine.runner import Runner
from adapters.engine.runner_stats import ExecutionPaths


def _runner(**kw) -> Runner:
    cc = CFG.cache_config(page_size=16, full_capacity=16 * 64, swa_capacity=16 * 24)
    return Runner(CFG, cc, device="cpu", dtype=torch.float32, chunk_tokens=37, **kw)


@pytest.mark.parametrize(
    "kw, want",
    [
        ({}, ExecutionPaths("torch", "paged")),
        ({"graph_decode": True}, ExecutionPaths("torch", "eager")),
        ({"hisparse_pages": 40}, ExecutionPaths("torch", "paged", "host")),
    ],
    ids=["paged", "graph", "hisparse"],
)
def test_paths_on_the_cpu(kw, want) -> None:
    runner = _runner(**kw)
    assert runner.paths == want
    res = runner.generate([[1, 2, 3, 4, 5]], None)
    line = next(x for x in summary(runner, res, 1.0).splitlines() if x.startswith("paths:"))
    assert "torch references" in line and f"decode {want.decode}" in line
    assert ("HiSparse copies host" in line) == (want.hisparse_copies == "host")


def test_fused_kernels_named_only_where_they_run(monkeypatch) -> None:
    """On a CPU device the references run even with Triton installed; switching the kernels
    off is visible too (the knob a CUDA run would flip)."""
    runner = _runner()
    monkeypatch.setattr(kernels, "TRITON_AVAILABLE", True)
    assert runner.paths.kernels == "torch"  # a CPU device
    monkeypatch.setattr(runner, "device", torch.device("cuda"))
    assert runner.paths.kernels == "triton"
    monkeypatch.setattr(kernels, "SPARSE_KERNELS", False)
    assert runner.paths.kernels == "torch"
