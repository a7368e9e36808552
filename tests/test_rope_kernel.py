"""The RoPE and RMSNorm kernels (`adapters/kernels/rope.py`) against their torch references
(`adapters.model.ops.rope_reference`, `rms_norm_reference`) under Triton's CPU interpreter at
tiny shapes: in place and copying, inverse, multi-head rows, rows of a block past the end, a
rotated part not a power of two wide, fp16 inputs, layouts the kernels refuse."""

from __future__ import annotations

import pytest
import torch
from interpreted import interpreted_modules, run_check

from adapters.model import ops

KERNELS = ("rope",)


@pytest.fixture(scope="module")
def interp():
    return interpreted_modules(KERNELS)


def _x(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def check_rope_fp32(rope):
    """Copying and in place, forward and inverse, (N, H, dim) and (N, dim) rows, 5 tokens
    (block 4: a block past the end), positions far apart (large angles)."""
    pos = torch.tensor([0, 3, 17, 1000, 123457])
    for shape, rope_dim in (((5, 3, 24), 8), ((5, 40), 16), ((5, 2, 12), 12)):
        x = _x(shape, seed=rope_dim)
        for inverse in (False, True):
            want = ops.rope_reference(x, pos, rope_dim, 10000.0, inverse)
            got = rope.flash_rope(x, pos, rope_dim, 10000.0, inverse, False, block_r=4)
            assert got is not x and got.shape == x.shape
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
            y = x.clone()
            assert rope.flash_rope(y, pos, rope_dim, 10000.0, inverse, True, block_r=4) is y
            torch.testing.assert_close(y, want, rtol=2e-5, atol=2e-5)
    half = _x((4, 20), seed=9)  # rope_dim 12: half = 6, not a power of two
    torch.testing.assert_close(rope.flash_rope(half, pos[:4], 12, 500.0, False, False),
                               ops.rope_reference(half, pos[:4], 12, 500.0), rtol=2e-5,
                               atol=2e-5)  # fmt: skip


def check_rope_fp16_and_refusals(rope):
    """fp16 rounds once (within one fp16 step of the fp32 result); a strided last dimension and
    an odd rotated width are refused (None: the caller runs the reference)."""
    pos = torch.arange(6) * 5
    x = _x((6, 32), torch.float16, seed=4)
    got = rope.flash_rope(x, pos, 16, 10000.0, False, False)
    exact = ops.rope_reference(x.float(), pos, 16, 10000.0)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), exact, rtol=0, atol=4e-3)
    assert rope.flash_rope(_x((6, 32)).t(), pos, 4, 1e4, False, False) is None
    assert rope.flash_rope(_x((6, 32)), pos, 7, 1e4, False, False) is None
    assert rope.flash_rope(_x((0, 32)), pos[:0], 8, 1e4, False, False).shape == (0, 32)


def check_rms_norm(rope):
    """fp32 rows (a width not a power of two), (N, H, D) inputs, fp16; refusals."""
    for shape in ((7, 40), (3, 2, 64)):
        x, w = _x(shape, seed=1), _x(shape[-1:], seed=2)
        got = rope.flash_rms_norm(x, w, 1e-6)
        torch.testing.assert_close(got, ops.rms_norm_reference(x, w, 1e-6), rtol=2e-5, atol=2e-5)
    x16, w = _x((5, 48), torch.float16, seed=3), _x((48,), seed=5)
    exact = ops.rms_norm_reference(x16.float(), w, 1e-6)
    torch.testing.assert_close(rope.flash_rms_norm(x16, w, 1e-6).float(), exact, rtol=0,
                               atol=8e-3)  # fmt: skip
    assert rope.flash_rms_norm(_x((6, 32)).t(), _x((6,)), 1e-6) is None
    assert rope.flash_rms_norm(_x((6, 32)), _x((31,)), 1e-6) is None


CHECKS = ["check_rope_fp32", "check_rope_fp16_and_refusals", "check_rms_norm"]


@pytest.mark.parametrize("name", CHECKS)
def test_rope_kernel_under_interpreter(interp, name):
    run_check(interp, globals()[name], KERNELS, CHECKS, __file__)


def test_dispatch_keeps_the_references_off_cuda_and_under_autograd():
    """On CPU tensors (and whatever autograd differentiates) the ops run their references: the
    paged == reference equality in fp64 and training rest on it."""
    x = torch.randn(4, 2, 16, dtype=torch.float64)
    pos = torch.arange(4)
    assert torch.equal(ops.rope(x, pos, 8, 1e4), ops.rope_reference(x, pos, 8, 1e4))
    w = torch.randn(16, dtype=torch.float64)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), ops.rms_norm_reference(x, w, 1e-6))
    assert not ops._fused(x.float())  # a CPU tensor
