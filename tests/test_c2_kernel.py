"""The fused ratio-2 decode pooling (issue #17 item 2): the Flash Compressor's gathered path at
``ratio = 2`` (no overlap) merges each completed pair from the in-flight ring and applies RMSNorm
+ RoPE in one kernel. Under Triton's CPU interpreter at tiny shapes it must match the torch
reference (`adapters.kernels.reference.compress_gathered_reference`) within fp32 rounding."""

from __future__ import annotations

import pytest
import torch
from interpreted import interpreted_modules, run_check

from adapters.kernels import reference as ref

KERNELS = ("compressor",)


def _pairs(b: int, d: int, seed: int):
    """A ring of ``[kv | score]`` rows in shuffled slots; request ``q``'s pair ``group[q]``."""
    g = torch.Generator().manual_seed(seed)
    t = 6
    kv = torch.randn(b, t, d, generator=g)
    score = torch.randn(b, t, d, generator=g) * 2
    tok = torch.cat((kv, score), -1).reshape(b * t, -1)
    perm = torch.randperm(b * t, generator=g)
    ring = torch.empty_like(tok)
    ring[perm] = tok
    group = torch.randint(0, t // 2, (b,), generator=g)
    rows = perm.view(b, t).gather(1, (2 * group)[:, None] + torch.arange(2))
    return ring, rows, group


def check_pair_decode(comp):
    for b, d, rope_dim in ((5, 16, 8), (3, 48, 16), (1, 32, 0)):
        ring, rows, group = _pairs(b, d, seed=b)
        norm = torch.rand(d) + 0.5
        kw = dict(groups=group, norm=norm, rope_dim=rope_dim, theta=10000.0, eps=1e-6)
        want = ref.compress_gathered_reference(ring, rows, 2, False, **kw)
        for knobs in ({}, dict(block_g=2)):
            got = comp.flash_compress_gathered(ring, rows, 2, False, **kw, **knobs)
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)
        plain = comp.flash_compress_gathered(ring, rows, 2, False)
        torch.testing.assert_close(plain, ref.compress_gathered_reference(ring, rows, 2, False))
    cfg = comp.launch_config(2, False, 512, 4, True, 8, True)  # decode: fp32 ring, epilogue
    assert cfg["RT"] == 2 and cfg["RW"] == 1 and cfg["UNROLL"]  # one chunk: the pair


CHECKS = ["check_pair_decode"]


@pytest.fixture(scope="module")
def interp():
    return interpreted_modules(KERNELS)


def test_pair_decode_under_interpreter(interp) -> None:
    run_check(interp, check_pair_decode, KERNELS, CHECKS, __file__)
