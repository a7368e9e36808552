"""Cache formats: how a pool row of ``d`` channels is stored, and the one quantiser and
dequantiser that every writer (compressor epilogue, SWA write) and reader (attention, indexer)
shares, so prefill and decode round identically (docs/formats.md)::

    format  values                                  scales (fp32)
    BF16    (S, d)       the pool's native dtype    (S, 0)        none
    FP8     (S, d)       float8_e4m3fn              (S,)          one per row
    FP4     (S, d // 2)  uint8, two e2m1 codes      (S, d // 32)  one per 32 channels
            byte j = code[2j] | code[2j + 1] << 4   (low nibble = even channel)

    FP8 row:  value[c] = fp8[c] * scale     (the indexer's keys.float() * key_scale[:, None])
    FP4 row:  value[c] = e2m1(code[c]) * scale[c // 32]

**Scales** are powers of two (UE8M0-style): ``2**k`` for the smallest integer ``k`` with
``amax <= fmt_max * 2**k`` (``ceil(log2(amax / fmt_max))``, exact from the exponent of amax),
amax over the row (FP8) or block (FP4), fmt_max 448 (e4m3) or 6 (e2m1); an all-zero row or block
gets 1; ``k >= -126`` (fp32 normals: rows under ``fmt_max * 2**-126`` just lose precision).

**Rounding.** ``x / scale`` is exact, so quantising is one rounding of ``v = x / scale`` onto
the grid: to nearest, ties to the even code, i.e. IEEE round-half-even with the format's
subnormals (step ``2**(max(floor(log2|v|), emin) - mbits)``; e4m3 emin -6, 3 bits; e2m1 emin 0,
1 bit). e2m1 magnitudes ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` are codes 0-7, bit 3 the sign; its ties::

    0.25 -> 0   0.75 -> 1   1.25 -> 1   1.75 -> 2   2.5 -> 2   3.5 -> 4   5 -> 4

``|v| <= fmt_max``, on the grid, so nothing saturates. FP8 rounds explicitly, then casts
(exactly): torch casts fp64 through fp32, rounding twice. The sign of zero is kept.

**Non-finite input.** `quantize` raises `ValueError`. `write_rows` checks nothing that needs a
host sync (it runs inside CUDA graphs, whose padding rows may hold anything): a row (FP8) or
block (FP4) holding nan/inf, or beyond ``fmt_max * 2**127`` (fp64 only), gets scale NaN and reads
back as NaN; BF16 rows are stored as they are. Arithmetic is fp64 for fp64 inputs and outputs,
fp32 otherwise; apart from `quantize`'s check nothing syncs or copies host data to the device.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0..7
FP4_BLOCK = 32  # channels per FP4 scale
NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float64)
_MIN_EXP, _MAX_EXP = -126, 127  # scale exponents: fp32 normal powers of two


class CacheFormat(enum.Enum):
    BF16 = "bf16"  # the native dtype, no scales
    FP8 = "fp8"  # float8_e4m3fn, one fp32 scale per row
    FP4 = "fp4"  # e2m1 codes packed two per byte, one fp32 scale per 32 channels


@dataclass(frozen=True)
class RowLayout:
    """How one row of ``d`` channels is stored in ``fmt``. ``native_dtype`` is BF16's values
    dtype (the model's: bf16, or fp32 / fp64 in exact tests); the scaled formats ignore it.
    Raises `ValueError` for ``d < 1``, an FP4 ``d`` that is not a multiple of 32, or a native
    dtype other than fp32 / bf16 / fp64."""

    fmt: CacheFormat
    d: int
    native_dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if self.d < 1:
            raise ValueError(f"row width must be positive, not {self.d}")
        if self.fmt is CacheFormat.FP4 and self.d % FP4_BLOCK:
            raise ValueError(f"FP4 rows need a multiple of {FP4_BLOCK} channels, not {self.d}")
        _check_native(self.native_dtype, "native_dtype")

    @property
    def value_dtype(self) -> torch.dtype:
        return {
            CacheFormat.BF16: self.native_dtype,
            CacheFormat.FP8: torch.float8_e4m3fn,
            CacheFormat.FP4: torch.uint8,
        }[self.fmt]

    @property
    def values_per_row(self) -> int:
        """Elements of the values tensor per row (FP4: two channels per byte)."""
        return self.d // 2 if self.fmt is CacheFormat.FP4 else self.d

    @property
    def scales_per_row(self) -> int:
        return {CacheFormat.BF16: 0, CacheFormat.FP8: 1, CacheFormat.FP4: self.d // FP4_BLOCK}[
            self.fmt
        ]

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def value_bytes(self) -> int:
        return self.values_per_row * self.value_dtype.itemsize

    @property
    def scale_bytes(self) -> int:
        return self.scales_per_row * self.scale_dtype.itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes per row, i.e. per token of a per-token pool (values and scales)."""
        return self.value_bytes + self.scale_bytes

    def values_shape(self, lead: tuple[int, ...]) -> tuple[int, ...]:
        return (*lead, self.values_per_row)

    def scales_shape(self, lead: tuple[int, ...]) -> tuple[int, ...]:
        """FP8: one scale per row, no trailing axis (``(S,)``); others ``(*lead, scales)``."""
        return lead if self.fmt is CacheFormat.FP8 else (*lead, self.scales_per_row)

    def zeros(self, num_rows: int, device: torch.device | str) -> QuantizedRows:
        """Pool storage of ``num_rows`` rows that read back as zeros (values 0, scales 1)."""
        values = torch.zeros(self.values_shape((num_rows,)), dtype=self.value_dtype, device=device)
        scales = torch.ones(self.scales_shape((num_rows,)), dtype=self.scale_dtype, device=device)
        return QuantizedRows(self.fmt, values, scales)


def bytes_per_row(fmt: CacheFormat, d: int, native_dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes one row of ``d`` channels costs in ``fmt`` (one token of a per-token pool)."""
    return RowLayout(fmt, d, native_dtype).row_bytes


@dataclass(frozen=True)
class QuantizedRows:
    """Rows ``(..., d)`` in ``fmt``: ``values`` and ``scales`` shaped as `RowLayout` says.
    Raises `ValueError` when the dtypes or shapes do not match the format."""

    fmt: CacheFormat
    values: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        if self.values.dim() < 1:
            raise ValueError("values need a channel axis")
        layout = self.layout
        if self.values.dtype != layout.value_dtype:
            raise ValueError(f"{self.fmt.name} values must be {layout.value_dtype}")
        shape = layout.scales_shape(tuple(self.values.shape[:-1]))
        if self.scales.dtype != layout.scale_dtype or self.scales.shape != shape:
            raise ValueError(f"{self.fmt.name} scales must be fp32 {shape}")

    @property
    def d(self) -> int:
        width = self.values.shape[-1]
        return 2 * width if self.fmt is CacheFormat.FP4 else width

    @property
    def layout(self) -> RowLayout:
        native = self.values.dtype if self.fmt is CacheFormat.BF16 else torch.bfloat16
        return RowLayout(self.fmt, self.d, native)


def quantize(x: torch.Tensor, fmt: CacheFormat) -> QuantizedRows:
    """``x`` ``(..., d)`` (fp32 / bf16 / fp64) in ``fmt``; BF16's values are ``x`` itself (no
    copy). Raises `ValueError` for another dtype, a bad ``d`` (see `RowLayout`), or non-finite
    values (or, fp64 only, a row / block beyond ``fmt_max * 2**127``); that check syncs the host,
    so graph-captured writers use `write_rows`."""
    q = _encode(x, fmt)
    if fmt is CacheFormat.BF16:
        unrepresentable = ~torch.isfinite(x)
    else:
        unrepresentable = torch.isnan(q.scales)
    if bool(unrepresentable.any()):
        raise ValueError(f"x has non-finite values or is out of {fmt.name}'s range")
    return q


def dequantize(q: QuantizedRows, dtype: torch.dtype) -> torch.Tensor:
    """``(..., d)`` rows in ``dtype`` (fp32 / bf16 / fp64, else `ValueError`). Exact: a grid
    value times a power of two fits every one of them."""
    _check_native(dtype, "dtype")
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    if q.fmt is CacheFormat.BF16:
        return q.values.to(dtype)
    if q.fmt is CacheFormat.FP8:
        return (q.values.to(compute) * q.scales.to(compute)[..., None]).to(dtype)
    codes = torch.stack((q.values & 0xF, q.values >> 4), -1).flatten(-2)
    blocks = _e2m1_value(codes, compute).unflatten(-1, (-1, FP4_BLOCK))
    return (blocks * q.scales.to(compute)[..., None]).flatten(-2).to(dtype)


def write_rows(
    storage_values: torch.Tensor,
    storage_scales: torch.Tensor,
    slots: torch.Tensor,
    x: torch.Tensor,
    fmt: CacheFormat,
) -> None:
    """Quantise ``x`` ``(*slots.shape, d)`` and store row ``i`` at ``slots[i]`` of the pool
    (``storage_values`` ``(S, ...)``, ``storage_scales`` ``(S, ...)``, as `RowLayout.zeros`
    makes them), in place. BF16: ``x`` must already be in the pool's dtype (so what is stored is
    what `quantize` gives). Rounds exactly as `quantize`; checks no values (see the module
    docstring on non-finite input). Slots should be distinct: where they repeat (a sentinel row)
    which row lands is unspecified, and on CUDA its values and scale may come from different
    rows. Raises `ValueError` for mismatched dtypes or shapes."""
    storage = _storage(storage_values, storage_scales, slots, fmt)
    if x.dim() < 1 or x.shape[:-1] != slots.shape or x.shape[-1] != storage.d:
        raise ValueError(f"x must be {(*slots.shape, storage.d)}, not {tuple(x.shape)}")
    if fmt is CacheFormat.BF16 and x.dtype != storage_values.dtype:
        raise ValueError(f"BF16 rows must already be in the pool's dtype {storage_values.dtype}")
    q = _encode(x, fmt)
    storage_values[slots] = q.values
    storage_scales[slots] = q.scales


def read_rows(
    storage_values: torch.Tensor,
    storage_scales: torch.Tensor,
    slots: torch.Tensor,
    fmt: CacheFormat,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Rows ``slots`` of the pool, dequantised: ``(*slots.shape, d)`` in ``dtype``. Raises
    `ValueError` for mismatched dtypes or shapes (an out-of-range slot: torch's IndexError)."""
    _storage(storage_values, storage_scales, slots, fmt)
    return dequantize(QuantizedRows(fmt, storage_values[slots], storage_scales[slots]), dtype)


# ----------------------------------------------------------------------------- internals


def _check_native(dtype: torch.dtype, what: str) -> None:
    if dtype not in NATIVE_DTYPES:
        raise ValueError(f"{what} must be fp32, bf16 or fp64, not {dtype}")


def _storage(
    values: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, fmt: CacheFormat
) -> QuantizedRows:
    if values.dim() != 2:
        raise ValueError("pool values must be (S, width)")
    if slots.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slots must be int64 or int32, not {slots.dtype}")
    return QuantizedRows(fmt, values, scales)


def _encode(x: torch.Tensor, fmt: CacheFormat) -> QuantizedRows:
    """`quantize` without the value check (shapes and dtypes are checked)."""
    _check_native(x.dtype, "x")
    if x.dim() < 1:
        raise ValueError("x needs a channel axis")
    RowLayout(fmt, x.shape[-1])
    if fmt is CacheFormat.BF16:
        return QuantizedRows(fmt, x, x.new_empty((*x.shape[:-1], 0), dtype=torch.float32))
    xc = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    if fmt is CacheFormat.FP8:
        scales = _scales(xc.abs().amax(-1), E4M3_MAX)
        fp8 = _round_to_grid(xc / scales[..., None], emin=-6, mbits=3)
        return QuantizedRows(fmt, fp8.to(torch.float8_e4m3fn), scales)
    blocks = xc.unflatten(-1, (-1, FP4_BLOCK))
    scales = _scales(blocks.abs().amax(-1), E2M1_MAX)
    # a block with a NaN scale is all NaN here; its codes are 0 and the scale carries the NaN
    v = torch.nan_to_num(blocks / scales[..., None], nan=0.0)
    codes = _e2m1_code(_round_to_grid(v, emin=0, mbits=1).flatten(-2))
    return QuantizedRows(fmt, (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8), scales)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """``2.0**exponent`` in fp32, built from its bits (exact; exponent in [-126, 127])."""
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


def _scales(amax: torch.Tensor, fmt_max: float) -> torch.Tensor:
    """Power-of-two scales (fp32) for these amaxes: NaN where amax is not finite or too big."""
    fmt_mant, fmt_exp = math.frexp(fmt_max)
    mant, exp = torch.frexp(amax)  # amax = mant * 2**exp, mant in [0.5, 1)
    k = exp - fmt_exp + (mant > fmt_mant).to(exp.dtype)  # smallest k: amax <= fmt_max * 2**k
    k = torch.where(amax == 0, 0, k).clamp(min=_MIN_EXP)
    unrepresentable = ~torch.isfinite(amax) | (k > _MAX_EXP)
    return torch.where(unrepresentable, math.nan, _pow2(k.clamp(max=_MAX_EXP)))


def _round_to_grid(v: torch.Tensor, emin: int, mbits: int) -> torch.Tensor:
    """``v`` rounded to nearest, ties to even, onto the grid of a float format with ``mbits``
    mantissa bits and smallest normal exponent ``emin`` (no saturation: ``v`` is in range)."""
    _, exp = torch.frexp(v)  # floor(log2|v|) = exp - 1
    step = _pow2((exp - 1).clamp(min=emin) - mbits).to(v.dtype)
    return torch.round(v / step) * step  # torch.round: half to even


def _e2m1_code(q: torch.Tensor) -> torch.Tensor:
    """The 4-bit code (int64) of each e2m1 grid value in ``q``: its grid index, bit 3 the sign."""
    magnitude = q.abs()
    index = sum(((magnitude > g).long() for g in E2M1_GRID[:-1]), torch.zeros_like(q).long())
    return index | torch.signbit(q).long() << 3


def _e2m1_value(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The value of each 4-bit code: exponent field ``e``, mantissa bit ``m`` (``e == 0``:
    subnormal ``m / 2``; otherwise ``(2 + m) * 2**(e - 2)``)."""
    codes = codes.long()
    e, m = (codes >> 1) & 3, (codes & 1).to(dtype)
    magnitude = torch.where(e == 0, m / 2, (2 + m) * _pow2(e - 2).to(dtype))
    return torch.where((codes & 8) != 0, -magnitude, magnitude)
