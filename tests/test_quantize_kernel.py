"""The fused FP8 quantise-and-store (`adapters/kernels/quantize.py`) against
`formats.write_rows` under Triton's CPU interpreter: the same bytes and scales for random rows
of every magnitude (subnormal e4m3 values, grid ties, rows far below and above one), zero rows,
bf16 input, a row with a non-finite value (NaN scale), and the refusals."""

from __future__ import annotations

import pytest
import torch
from interpreted import interpreted_modules, run_check

from adapters.memory.formats import CacheFormat, RowLayout, write_rows

KERNELS = ("quantize",)
FP8 = CacheFormat.FP8


@pytest.fixture(scope="module")
def interp():
    return interpreted_modules(KERNELS)


def _pools(rows: int, d: int):
    a = RowLayout(FP8, d).zeros(rows, "cpu")
    b = RowLayout(FP8, d).zeros(rows, "cpu")
    return (a.values, a.scales), (b.values, b.scales)


def _rows(n: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    x *= torch.exp2(torch.randint(-40, 40, (n, 1), generator=g).float())  # many scales
    x[0] = 0.0  # an all-zero row: scale 1
    x[1, : d // 2] = 0.0
    x[2] = torch.linspace(-448.0, 448.0, d)  # amax exactly on the format's max
    x[3] = 448.0 * 2.0**-12 * torch.arange(d) / d  # tiny values: e4m3 subnormals after scaling
    # grid ties: midpoints between neighbouring e4m3 values at one scale
    x[4] = (torch.arange(d) % 16 + 8.5) * 2.0 ** (torch.arange(d) % 9 - 9).float()
    x[5, 1:] = -(2.0 ** -torch.arange(12.0, 12.0 + d - 1) / 3)  # negatives rounding to -0
    x[5, 0] = 448.0
    return x


def _bytes(values: torch.Tensor) -> torch.Tensor:
    return values.view(torch.uint8)


def check_same_bytes_as_write_rows(q):
    for d, n in ((128, 9), (40, 6), (512, 6)):
        x = _rows(n, d, seed=d)
        (va, sa), (vb, sb) = _pools(2 * n, d)
        slots = torch.randperm(2 * n)[:n]
        q.fp8_store(va, sa, slots, x)
        write_rows(vb, sb, slots, x, FP8)
        assert torch.equal(_bytes(va), _bytes(vb)), f"d {d}: bytes differ"
        assert torch.equal(sa, sb), f"d {d}: scales differ"
    x = _rows(6, 64, seed=1).bfloat16()
    (va, sa), (vb, sb) = _pools(6, 64)
    slots = torch.arange(6)
    q.fp8_store(va, sa, slots, x)
    write_rows(vb, sb, slots, x, FP8)
    assert torch.equal(_bytes(va), _bytes(vb)) and torch.equal(sa, sb)


def check_non_finite_row_gets_a_nan_scale(q):
    x = torch.ones(3, 32)
    x[1, 5] = float("inf")
    x[2, 0] = float("nan")
    (va, sa), _ = _pools(3, 32)
    q.fp8_store(va, sa, torch.arange(3), x)
    assert sa[0] == 2.0**-8 and torch.isnan(sa[1:]).all()


def check_refusals(q):
    (va, sa), _ = _pools(4, 32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        q.fp8_store(va.float(), sa, torch.arange(1), torch.ones(1, 32))
    with pytest.raises(ValueError, match="must be"):
        q.fp8_store(va, sa, torch.arange(2), torch.ones(1, 32))
    with pytest.raises(ValueError, match="fp32 or bf16"):
        q.fp8_store(va, sa, torch.arange(1), torch.ones(1, 32, dtype=torch.float64))
    q.fp8_store(va, sa, torch.arange(0), torch.ones(0, 32))  # nothing to store
    assert not _bytes(va).any()


CHECKS = [
    "check_same_bytes_as_write_rows",
    "check_non_finite_row_gets_a_nan_scale",
    "check_refusals",
]


@pytest.mark.parametrize("name", CHECKS)
def test_quantize_kernel_under_interpreter(interp, name):
    run_check(interp, globals()[name], KERNELS, CHECKS, __file__)


def test_pools_keep_the_torch_chain_off_cuda():
    """`KVPools.store` takes the fused path only for CUDA pools: on the CPU, write_rows."""
    from adapters.memory import pools

    x = torch.ones(2, 16)
    assert not pools._fused_fp8(FP8, torch.zeros(4, 16), torch.arange(2), x)
