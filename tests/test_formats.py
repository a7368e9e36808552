"""adapters.memory.formats: scale rule, rounding rule (every e4m3 and e2m1 midpoint), FP4 packing
against literal bytes, round trips within each format's error bound, exact representability,
pool writes and reads equal to quantize / dequantize (a chunk written at once equals the same
rows written one by one), non-finite input, errors and byte counts."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.memory.formats import (
    E2M1_GRID,
    CacheFormat,
    QuantizedRows,
    RowLayout,
    bytes_per_row,
    dequantize,
    quantize,
    read_rows,
    write_rows,
)

BF16, FP8, FP4 = CacheFormat.BF16, CacheFormat.FP8, CacheFormat.FP4
F32, F64, B16 = torch.float32, torch.float64, torch.bfloat16
DTYPES = (F32, B16, F64)
_profile = settings.default  # the profile tests/conftest.py or --hypothesis-profile loaded
FEW = settings(_profile, max_examples=300 if _profile.max_examples > 150 else 25)


def _e4m3_grid() -> torch.Tensor:
    """Every finite non-negative e4m3 value, ascending: bit patterns 0x00..0x7E (0x7F is NaN)."""
    return torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double()


def _round_trip(x: torch.Tensor, fmt: CacheFormat, dtype: torch.dtype = F64) -> torch.Tensor:
    return dequantize(quantize(x, fmt), dtype)


def _with_fmt_max(values: list[float], fmt_max: float, width: int) -> torch.Tensor:
    """``[fmt_max, *values]`` padded with zeros to ``width``: a row (block) whose scale is 1."""
    return torch.tensor([fmt_max, *values] + [0.0] * (width - 1 - len(values)), dtype=F64)


# ----------------------------------------------------------------------------- rounding


@pytest.mark.parametrize("dtype", [F32, F64])
def test_every_e4m3_midpoint_rounds_to_the_even_code(dtype):
    grid = _e4m3_grid()
    mid = (grid[:-1] + grid[1:]) / 2
    even_low = torch.arange(mid.numel()) % 2 == 0  # bits of grid[i] = i: even code below
    expected = torch.where(even_low, grid[:-1], grid[1:])
    for sign in (1.0, -1.0):
        x = torch.cat((torch.tensor([448.0], dtype=F64), sign * mid)).to(dtype)
        q = quantize(x, FP8)
        assert q.scales.item() == 1.0
        assert torch.equal(q.values.double()[1:], sign * expected)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_just_off_an_e4m3_midpoint_rounds_to_the_nearer_neighbour(dtype):
    grid = _e4m3_grid()
    mid = ((grid[:-1] + grid[1:]) / 2).to(dtype)
    for toward, expected in ((math.inf, grid[1:]), (0.0, grid[:-1])):
        off = torch.nextafter(mid, torch.full_like(mid, toward))
        values = quantize(torch.cat((torch.tensor([448.0], dtype=dtype), off)), FP8).values
        assert torch.equal(values.double()[1:], expected)


def test_fp64_rounds_once():
    """Torch casts fp64 to e4m3 through fp32, rounding twice; the format rounds once."""
    x = torch.tensor([448.0, 1.0625 + 2**-40], dtype=F64)
    assert x.to(torch.float8_e4m3fn).double()[1] == 1.0  # torch's double rounding
    assert _round_trip(x, FP8)[1] == 1.125


def test_e4m3_rounding_equals_torchs_fp32_cast():
    torch.manual_seed(0)
    grid = _e4m3_grid().float()
    mids = (grid[:-1] + grid[1:]) / 2
    x = torch.cat((torch.tensor([448.0]), torch.rand(4000) * 896 - 448, mids, -mids, -grid))
    assert quantize(x, FP8).scales.item() == 1.0
    assert torch.equal(
        quantize(x, FP8).values.view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8)
    )


E2M1_TIES = [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_e2m1_midpoint_rounds_to_the_even_code(dtype):
    mids, expected = zip(*E2M1_TIES)
    assert list(mids) == [(a + b) / 2 for a, b in zip(E2M1_GRID, E2M1_GRID[1:])]
    for sign in (1.0, -1.0):
        x = _with_fmt_max([sign * m for m in mids], 6.0, 32).to(dtype)
        assert quantize(x, FP4).scales.item() == 1.0
        assert _round_trip(x, FP4)[1:8].tolist() == [sign * e for e in expected]


def test_just_off_an_e2m1_midpoint_rounds_to_the_nearer_neighbour():
    mids = torch.tensor([m for m, _ in E2M1_TIES], dtype=F64)
    for toward, expected in ((math.inf, E2M1_GRID[1:]), (0.0, E2M1_GRID[:-1])):
        off = torch.nextafter(mids, torch.full_like(mids, toward)).tolist()
        assert _round_trip(_with_fmt_max(off, 6.0, 32), FP4)[1:8].tolist() == list(expected)


# ----------------------------------------------------------------------------- FP4 packing


def test_fp4_packing_matches_a_literal_encoding():
    """Codes: grid index of the magnitude, bit 3 the sign; byte j = code[2j] | code[2j+1] << 4."""
    first = [0.5, -1.0, 6.0, 0.0, -0.5, 3.0, -6.0, 1.5, -0.2, 4.0]  # codes 1 A 7 0 9 5 F 3 8 6
    second = [12.0, -1.0]  # scale 2: codes 7, 9
    x = torch.tensor(first + [0.0] * 22 + second + [0.0] * 30)
    q = quantize(x, FP4)
    literal = [0xA1, 0x07, 0x59, 0x3F, 0x68] + [0] * 11 + [0x97] + [0] * 15
    assert q.values.tolist() == literal
    assert q.scales.tolist() == [1.0, 2.0]
    back = dequantize(q, F32)
    assert back[8] == 0.0 and torch.signbit(back[8])  # -0.2 -> code 8, -0.0
    assert back[:10].tolist() == [0.5, -1.0, 6.0, 0.0, -0.5, 3.0, -6.0, 1.5, 0.0, 4.0]


# ----------------------------------------------------------------------------- scales


def _amax(x: torch.Tensor, fmt: CacheFormat) -> torch.Tensor:
    x = x.double().abs()
    return x.amax(-1) if fmt is FP8 else x.unflatten(-1, (-1, 32)).amax(-1)


@FEW
@given(
    seed=st.integers(0, 2**31 - 1), exponent=st.integers(-40, 40), fmt=st.sampled_from([FP8, FP4])
)
def test_scales_are_the_smallest_power_of_two_that_fits(seed, exponent, fmt):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 64, generator=g, dtype=F64) * 2.0**exponent
    x[0, :32] = 0  # an all-zero block (FP4) / a partly zero row (FP8)
    q = quantize(x, fmt)
    s, amax, fmt_max = q.scales.double(), _amax(x, fmt), 448.0 if fmt is FP8 else 6.0
    assert torch.all(torch.frexp(s).mantissa == 0.5)
    nonzero = amax > 0
    assert torch.all(amax <= fmt_max * s)
    assert torch.all(amax[nonzero] > fmt_max * s[nonzero] / 2)
    assert torch.all(s[~nonzero] == 1.0)


@pytest.mark.parametrize("fmt,fmt_max", [(FP8, 448.0), (FP4, 6.0)])
def test_scale_at_and_just_past_the_format_max(fmt, fmt_max):
    at = torch.tensor([fmt_max] + [0.0] * 31)
    assert quantize(at, fmt).scales.flatten().tolist() == [1.0]
    assert torch.equal(_round_trip(at, fmt, F32), at)
    past = at.clone()
    past[0] = torch.nextafter(torch.tensor(fmt_max), torch.tensor(math.inf))
    assert quantize(past, fmt).scales.flatten().tolist() == [2.0]
    assert _round_trip(past, fmt, F32)[0] == fmt_max  # rounds down within the doubled range
    shifted = at * 2.0**-20
    assert quantize(shifted, fmt).scales.flatten().tolist() == [2.0**-20]


@pytest.mark.parametrize("fmt", [FP8, FP4])
def test_all_zero_rows_and_blocks_get_scale_one(fmt):
    q = quantize(torch.zeros(2, 64, dtype=B16), fmt)
    assert torch.all(q.scales == 1.0)
    assert torch.equal(dequantize(q, F32), torch.zeros(2, 64))


@pytest.mark.parametrize("fmt", [FP8, FP4])
def test_scale_exponents_are_clamped_to_fp32_normals(fmt):
    tiny32 = torch.full((32,), 1e-40)  # fp32 subnormal
    assert quantize(tiny32, fmt).scales.flatten().tolist() == [2.0**-126]
    assert torch.all((_round_trip(tiny32, fmt) - tiny32.double()).abs() <= 2.0**-127)
    tiny64 = torch.full((32,), 1e-300, dtype=F64)
    assert torch.equal(_round_trip(tiny64, fmt), torch.zeros(32, dtype=F64))
    fmt_max = 448.0 if fmt is FP8 else 6.0
    top = torch.tensor([fmt_max * 2.0**127] + [0.0] * 31, dtype=F64)  # the largest scale
    assert torch.equal(_round_trip(top, fmt), top)
    with pytest.raises(ValueError, match="non-finite values or is out of"):
        quantize(top * 2, fmt)


# ----------------------------------------------------------------------------- round trips


def _fp8_bound(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Half a step: 2**-4 relative (normals), 2**-10 * scale (subnormals)."""
    return torch.maximum(x.abs() * 2.0**-4, scales[..., None] * 2.0**-10)


def _fp4_bound(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Half the e2m1 step at ``|x| / scale``: 0.25 below 2, 0.5 in [2, 4), 1 in [4, 6]."""
    s = scales.repeat_interleave(32, -1)
    v = x.abs() / s
    return s * torch.where(v < 2, 0.25, torch.where(v < 4, 0.5, 1.0))


@FEW
@given(
    seed=st.integers(0, 2**31 - 1),
    exponent=st.integers(-30, 30),
    dtype=st.sampled_from(DTYPES),
    fmt=st.sampled_from([FP8, FP4]),
)
def test_round_trip_is_within_half_a_step(seed, exponent, dtype, fmt):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 3, 64, generator=g, dtype=F64) * 2.0**exponent).to(dtype)
    q = quantize(x, fmt)
    back, xd, s = dequantize(q, F64), x.double(), q.scales.double()
    bound = _fp8_bound(xd, s) if fmt is FP8 else _fp4_bound(xd, s)
    assert torch.all((back - xd).abs() <= bound)
    assert torch.equal(dequantize(q, dtype), back.to(dtype))  # exact in every output dtype


@FEW
@given(
    codes=st.lists(st.integers(0, 0xFE).filter(lambda b: b & 0x7F != 0x7F), min_size=8, max_size=8),
    exponent=st.integers(-100, 100),
    dtype=st.sampled_from(DTYPES),
)
def test_e4m3_values_times_a_power_of_two_round_trip_exactly(codes, exponent, dtype):
    grid = torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    x = (grid * 2.0**exponent).to(dtype)
    assert torch.equal(_round_trip(x, FP8, dtype), x)


@FEW
@given(
    codes=st.lists(st.integers(0, 15), min_size=64, max_size=64),
    exponents=st.tuples(st.integers(-100, 100), st.integers(-100, 100)),
    dtype=st.sampled_from(DTYPES),
)
def test_e2m1_values_times_a_power_of_two_round_trip_exactly(codes, exponents, dtype):
    value = [(-1.0 if c & 8 else 1.0) * E2M1_GRID[c & 7] for c in codes]
    scale = torch.tensor(exponents, dtype=F64).exp2().repeat_interleave(32)
    x = (torch.tensor(value, dtype=F64) * scale).to(dtype)
    assert torch.equal(_round_trip(x, FP4, dtype), x)


def test_bf16_format_stores_rows_as_they_are():
    x = torch.randn(3, 8, dtype=B16)
    q = quantize(x, BF16)
    assert q.values is x and q.scales.shape == (3, 0)
    assert torch.equal(dequantize(q, F32), x.float())


# ----------------------------------------------------------------------------- pool storage


def _pool(fmt: CacheFormat, d: int, dtype: torch.dtype, num_rows: int = 8) -> QuantizedRows:
    return RowLayout(fmt, d, dtype).zeros(num_rows, "cpu")


@pytest.mark.parametrize("fmt", list(CacheFormat))
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_and_read_rows_equal_quantize_and_dequantize(fmt, dtype):
    torch.manual_seed(1)
    pool = _pool(fmt, 64, dtype)
    slots = torch.tensor([[6, 1], [3, 0]])
    x = (torch.randn(2, 2, 64, dtype=F64) * 5).to(dtype)
    write_rows(pool.values, pool.scales, slots, x, fmt)
    q = quantize(x, fmt)
    assert torch.equal(pool.values[slots].view(torch.uint8), q.values.view(torch.uint8))
    assert torch.equal(pool.scales[slots], q.scales)
    for out in DTYPES:
        assert torch.equal(read_rows(pool.values, pool.scales, slots, fmt, out), dequantize(q, out))
    untouched = torch.tensor([2, 4, 5, 7])
    assert torch.equal(read_rows(pool.values, pool.scales, untouched, fmt, F32), torch.zeros(4, 64))


@pytest.mark.parametrize("fmt", list(CacheFormat))
def test_a_prefill_chunk_and_decode_steps_store_the_same_bytes(fmt):
    torch.manual_seed(2)
    x, slots = torch.randn(5, 64, dtype=B16), torch.tensor([4, 0, 7, 2, 5], dtype=torch.int32)
    chunk, steps = _pool(fmt, 64, B16), _pool(fmt, 64, B16)
    write_rows(chunk.values, chunk.scales, slots, x, fmt)
    for i in range(5):
        write_rows(steps.values, steps.scales, slots[i : i + 1], x[i : i + 1], fmt)
    assert torch.equal(chunk.values.view(torch.uint8), steps.values.view(torch.uint8))
    assert torch.equal(chunk.scales, steps.scales)


def test_write_rows_poisons_non_finite_rows_and_blocks_without_raising():
    x = torch.ones(3, 64)
    x[1, 5], x[2, 40] = math.nan, -math.inf
    fp8 = _pool(FP8, 64, F32)
    write_rows(fp8.values, fp8.scales, torch.arange(3), x, FP8)
    back = read_rows(fp8.values, fp8.scales, torch.arange(3), FP8, F32)
    assert torch.equal(back[0], x[0]) and torch.all(back[1:].isnan())
    fp4 = _pool(FP4, 64, F32)
    write_rows(fp4.values, fp4.scales, torch.arange(3), x, FP4)
    back = read_rows(fp4.values, fp4.scales, torch.arange(3), FP4, F32)
    assert torch.all(back[1, :32].isnan()) and torch.equal(back[1, 32:], x[1, 32:])
    assert torch.equal(back[2, :32], x[2, :32]) and torch.all(back[2, 32:].isnan())
    native = _pool(BF16, 64, F32)
    write_rows(native.values, native.scales, torch.arange(3), x, BF16)
    assert torch.equal(native.values[:3].nan_to_num(), x.nan_to_num())
    assert native.values[1, 5].isnan()


@pytest.mark.parametrize("fmt", list(CacheFormat))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_quantize_raises_for_non_finite_input(fmt, bad):
    x = torch.ones(2, 32)
    x[1, 3] = bad
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x, fmt)


# ----------------------------------------------------------------------------- errors


def test_layout_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        RowLayout(FP4, 48)
    with pytest.raises(ValueError, match="positive"):
        RowLayout(FP8, 0)
    with pytest.raises(ValueError, match="native_dtype must be"):
        RowLayout(BF16, 8, torch.float16)


def test_quantize_and_dequantize_errors():
    with pytest.raises(ValueError, match="x must be fp32, bf16 or fp64"):
        quantize(torch.ones(4, 32, dtype=torch.float16), FP8)
    with pytest.raises(ValueError, match="x must be"):
        quantize(torch.ones(4, 32, dtype=torch.int64), BF16)
    with pytest.raises(ValueError, match="channel axis"):
        quantize(torch.tensor(1.0), FP8)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.ones(4, 40), FP4)
    with pytest.raises(ValueError, match="dtype must be"):
        dequantize(quantize(torch.ones(4, 32), FP8), torch.int32)


def test_quantized_rows_errors():
    fp8, scales = torch.zeros(4, 8, dtype=torch.float8_e4m3fn), torch.ones(4)
    QuantizedRows(FP8, fp8, scales)
    with pytest.raises(ValueError, match="values must be"):
        QuantizedRows(FP4, torch.zeros(4, 16, dtype=torch.int8), torch.ones(4, 1))
    with pytest.raises(ValueError, match="scales must be fp32"):
        QuantizedRows(FP8, fp8, torch.ones(4, 1))
    with pytest.raises(ValueError, match="scales must be fp32"):
        QuantizedRows(FP8, fp8, scales.double())
    with pytest.raises(ValueError, match="channel axis"):
        QuantizedRows(FP8, fp8[0, 0], scales[0])
    with pytest.raises(ValueError, match="native_dtype must be"):
        QuantizedRows(BF16, fp8, torch.ones(4, 0))


def test_pool_write_and_read_errors():
    pool, x, slots = _pool(FP8, 32, F32), torch.ones(2, 32), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="pool values must be"):
        write_rows(pool.values.flatten(), pool.scales, slots, x, FP8)
    with pytest.raises(ValueError, match="slots must be int64"):
        write_rows(pool.values, pool.scales, slots.float(), x, FP8)
    with pytest.raises(ValueError, match="scales must be"):
        write_rows(pool.values, pool.scales[:4], slots, x, FP8)
    for wrong in (torch.ones(2, 64), torch.ones(3, 32), torch.tensor(1.0)):
        with pytest.raises(ValueError, match="x must be"):
            write_rows(pool.values, pool.scales, slots, wrong, FP8)
    native = _pool(BF16, 32, B16)
    with pytest.raises(ValueError, match="already be in the pool's dtype"):
        write_rows(native.values, native.scales, slots, x, BF16)
    with pytest.raises(ValueError, match="values must be"):
        read_rows(pool.values, pool.scales, slots, FP4, F32)


# ----------------------------------------------------------------------------- bytes


@pytest.mark.parametrize(
    "fmt,d,native,row_bytes",
    [
        (BF16, 512, B16, 1024),
        (FP8, 512, B16, 516),
        (FP4, 512, B16, 320),
        (BF16, 128, B16, 256),
        (FP8, 128, B16, 132),
        (FP4, 128, B16, 80),
        (BF16, 128, F32, 512),
        (FP8, 128, F64, 132),
    ],
)
def test_bytes_per_row(fmt, d, native, row_bytes):
    assert bytes_per_row(fmt, d, native) == row_bytes
    pool = RowLayout(fmt, d, native).zeros(1, "cpu")
    stored = sum(t.numel() * t.element_size() for t in (pool.values, pool.scales))
    assert stored == row_bytes


def test_layout_properties():
    fp4 = RowLayout(FP4, 64)
    assert (fp4.value_dtype, fp4.values_per_row, fp4.scales_per_row) == (torch.uint8, 32, 2)
    assert (fp4.value_bytes, fp4.scale_bytes, fp4.scale_dtype) == (32, 8, F32)
    assert fp4.scales_shape((5,)) == (5, 2) and fp4.values_shape((5,)) == (5, 32)
    fp8 = RowLayout(FP8, 64)
    assert fp8.scales_shape((5,)) == (5,) and fp8.value_dtype == torch.float8_e4m3fn
    assert RowLayout(BF16, 64, F64).value_dtype == F64 and RowLayout(BF16, 64).scales_per_row == 0
    assert bytes_per_row(FP8, 64) == 68


def test_fp8_pool_rows_read_as_the_indexer_reads_them():
    """The indexer kernel's contract: ``keys.float() * key_scale[:, None]``, key_scale ``(S,)``."""
    torch.manual_seed(3)
    pool = _pool(FP8, 128, B16)
    write_rows(pool.values, pool.scales, torch.arange(8), torch.randn(8, 128) * 30, FP8)
    assert pool.scales.shape == (8,)
    slots = torch.tensor([5, 2, 7])
    expected = pool.values[slots].float() * pool.scales[slots][:, None]
    assert torch.equal(read_rows(pool.values, pool.scales, slots, FP8, F32), expected)
