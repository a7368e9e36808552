"""The sparse attention: its PyTorch reference against a literal per-query loop, and the Triton
kernel (`adapters/kernels/attention.py`) against the reference under Triton's CPU interpreter
at tiny shapes (fp32, and fp16 for the tensor-core path: the interpreter's bf16 arithmetic is
broken, so bf16 pools are only loaded and upcast). See `interpreted` for how the interpreter
is switched on.

Exactness: the kernel equals the fp32 reference within fp32 rounding (``2e-5``); a query with
nothing visible gives exactly 0. An FP8 window pool (`adapters.memory.formats.quantize`, one scale
per
row) is the same attention as its dequantised pool passed as an fp32 / bf16 / fp64 window.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from interpreted import interpreted_modules, run_check

from adapters.kernels import sparse_attention
from adapters.kernels.attention_reference import sparse_attention_reference as reference
from adapters.kernels.rows import PoolRows
from adapters.memory.formats import CacheFormat, dequantize, quantize

ENV_AT_IMPORT = os.environ.get("TRITON_INTERPRET")
FAR = 2**40  # a slot no pool has: read only if a mask is ignored


def _case(n, h, d, w, seed, *, s1=40, s2=60, dtype=torch.float32):
    """``(q, window_kv, window_slots, window_mask, sink, extra_kv)`` with random masks: query 0
    sees its whole window, query 1 none of it."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, h, d, generator=g, dtype=dtype)
    wkv = torch.randn(s1, d, generator=g, dtype=dtype)
    slots = torch.randint(0, s1, (n, w), generator=g)
    mask = torch.rand(n, w, generator=g) < 0.6
    mask[:1], mask[1:2] = True, False
    sink = torch.randn(h, generator=g, dtype=dtype)
    xkv = torch.randn(s2, d, generator=g, dtype=dtype)
    return q, wkv, slots, mask, sink, xkv


def _fp8_pool(s1, d, seed):
    """An FP8 window pool ``(values, scales)`` of rows spread over 2**-8 .. 2**8 (distinct
    scales), and its exact dequantisation in fp32."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(s1, d, generator=g) * torch.exp2(torch.randint(-8, 9, (s1, 1), generator=g))
    fp8 = quantize(rows, CacheFormat.FP8)
    return fp8.values, fp8.scales, dequantize(fp8, torch.float32)


def _scrub(slots, mask):
    """The window slots with every masked one pointing far out of the pool."""
    return torch.where(mask, slots, torch.full_like(slots, FAR))


def _scrub_table(table, lengths, spp, qrow=None):
    """The table with every entry no query reads set far out of the pool."""
    rows = torch.arange(table.shape[0]) if qrow is None else qrow
    need = torch.zeros(table.shape[0], dtype=torch.long)
    need = need.scatter_reduce(0, rows, (lengths + spp - 1) // spp, "amax")
    cols = torch.arange(table.shape[1])
    return torch.where(cols[None, :] < need[:, None], table, torch.full_like(table, FAR))


# ------------------------------------------------------------------------------ reference


def _literal(q, wkv, slots, mask, sink, scale, xkv=None, extra=None):
    """One query at a time, one key at a time, in fp64: the definition."""
    n, h, d = q.shape
    out = torch.zeros(n, h, d, dtype=torch.float64)
    for i in range(n):
        keys = [wkv[slots[i, j]] for j in range(slots.shape[1]) if mask[i, j]]
        if extra is not None:
            r = i if extra.qrow is None else int(extra.qrow[i])
            spp = extra.slots_per_page
            for e in range(min(int(extra.lengths[i]), extra.num_rows)):
                keys.append(xkv[int(extra.table[r, e // spp]) * spp + e % spp])
        for hh in range(h):
            logits = [float(q[i, hh].double() @ k.double()) * scale for k in keys]
            m = max([*logits, float(sink[hh])])
            weights = [torch.exp(torch.tensor(x - m, dtype=torch.float64)) for x in logits]
            denom = sum(weights) + torch.exp(torch.tensor(float(sink[hh]) - m, dtype=torch.float64))
            for wt, k in zip(weights, keys):
                out[i, hh] += wt / denom * k.double()
    return out


@pytest.mark.parametrize("layout", ["window", "slots", "pages", "shared"])
def test_reference_matches_literal_loop(layout):
    n, h, d, w = 5, 3, 8, 6
    q, wkv, slots, mask, sink, xkv = _case(n, h, d, w, 1, dtype=torch.float64)
    extra = None
    if layout == "slots":
        extra = PoolRows(torch.randint(0, 60, (n, 7)), torch.tensor([7, 0, 3, 9, 5]))
    elif layout == "pages":
        extra = PoolRows(torch.randint(0, 15, (n, 3)), torch.tensor([2, 0, 12, 5, 9]), None, 4)
    elif layout == "shared":
        qrow = torch.tensor([0, 0, 1, 1, 1])
        extra = PoolRows(torch.randint(0, 30, (2, 5)), torch.tensor([1, 4, 0, 6, 10]), qrow, 2, 9)
    want = _literal(q, wkv, slots, mask, sink, 0.4, xkv, extra)
    got = reference(q, wkv, slots, mask, sink, 0.4, xkv if extra else None, extra)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    tiled = reference(q, wkv, slots, mask, sink, 0.4, xkv if extra else None, extra, tile_bytes=1)
    assert torch.equal(tiled, got)  # one query per tile: the same arithmetic


def test_reference_nothing_visible_gives_zero():
    q, wkv, slots, mask, sink, xkv = _case(3, 2, 8, 4, 2)
    mask[:] = False
    extra = PoolRows(torch.zeros(3, 4, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    out = reference(q, wkv, slots, mask, sink, 0.5, xkv, extra)
    assert torch.equal(out, torch.zeros_like(out))
    with pytest.raises(ValueError, match="together"):
        reference(q, wkv, slots, mask, sink, 0.5, xkv, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_fp8_window_is_its_dequantised_pool(dtype):
    """FP8 rows times their scales, then the same arithmetic as the dequantised pool passed as
    the window (bit for bit: the dequantisation is exact in fp32, bf16 and fp64), with and
    without extra rows and tiles of one query; fp64 also against the literal loop."""
    n, h, d, w = 5, 3, 16, 6
    q, _, slots, mask, sink, xkv = _case(n, h, d, w, 11, dtype=dtype)
    values, scales, pool = _fp8_pool(40, d, 12)
    extra = PoolRows(torch.randint(0, 60, (n, 7)), torch.tensor([7, 0, 3, 9, 5]))
    for x, e in ((None, None), (xkv, extra)):
        got = reference(q, values, slots, mask, sink, 0.3, x, e, window_scale=scales)
        for window in (pool.to(dtype), pool.bfloat16()):
            assert torch.equal(got, reference(q, window, slots, mask, sink, 0.3, x, e))
        tiled = reference(
            q, values, slots, mask, sink, 0.3, x, e, window_scale=scales, tile_bytes=1
        )
        assert torch.equal(tiled, got) and got.dtype == dtype
        dispatched = sparse_attention(q, values, slots, mask, sink, 0.3, x, e, window_scale=scales)
        assert torch.equal(dispatched, got)  # CPU tensors: the reference
    if dtype == torch.float64:
        want = _literal(q, pool.double(), slots, mask, sink, 0.3, xkv, extra)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_reference_window_scale_errors():
    q, wkv, slots, mask, sink, _ = _case(3, 2, 16, 4, 13)
    values, scales, _ = _fp8_pool(40, 16, 14)
    for window, scale in ((values, None), (values, scales[:-1]), (values, scales.double()),
                          (values, scales.bfloat16()), (wkv, scales)):  # fmt: skip
        with pytest.raises(ValueError, match="window_scale"):
            reference(q, window, slots, mask, sink, 0.5, window_scale=scale)


# ------------------------------------------------------------- Triton, under the interpreter

KERNELS = ("attention",)


@pytest.fixture(scope="module")
def interp():
    """The interpreted attention module, or None: the checks run in a child process."""
    return interpreted_modules(KERNELS)


def _same(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def check_window_only(att):
    """Random window masks, a padded head dimension (d = 24), no extra rows; query 1 sees
    nothing; masked slots point out of the pool."""
    q, wkv, slots, mask, sink, _ = _case(6, 3, 24, 7, 3)
    want = reference(q, wkv, slots, mask, sink, 0.3)
    for knobs in ({}, {"splits": 2}):
        got = att.flash_sparse_attention(q, wkv, _scrub(slots, mask), mask, sink, 0.3, **knobs)
        _same(got, want)
        assert torch.equal(got[1], torch.zeros_like(got[1]))


def check_selection_slot_table(att):
    """C4-style: one table row of selected slots per query (qrow None), lengths 0..width; the
    split-K path (2 and 3 splits: some empty) equals the one-pass path."""
    n, h, d, w = 5, 4, 16, 5
    q, wkv, slots, mask, sink, xkv = _case(n, h, d, w, 4)
    table = torch.randint(0, 60, (n, 12), generator=torch.Generator().manual_seed(5))
    lengths = torch.tensor([12, 0, 7, 1, 30])  # past the width: clamped, as the reference does
    extra = PoolRows(table, lengths)
    want = reference(q, wkv, slots, mask, sink, 0.25, xkv, extra)
    far = PoolRows(_scrub_table(table, lengths.clamp(max=12), 1), lengths)
    for knobs in ({}, {"splits": 2}, {"splits": 3, "block_k": 32}):
        got = att.flash_sparse_attention(
            q, wkv, _scrub(slots, mask), mask, sink, 0.25, xkv, far, **knobs
        )
        _same(got, want)
    assert torch.equal(got[1], torch.zeros_like(got[1]))  # no window, length 0


def check_shared_page_table(att):
    """C128-style prefill: queries of two requests share their request's page table row
    (qrow), causal lengths, a logical width below the table's capacity; query 1 sees nothing
    at all (window fully masked, length 0) and gives exactly 0."""
    n, h, d, w, spp = 6, 2, 16, 4, 4
    q, wkv, slots, mask, sink, xkv = _case(n, h, d, w, 6, s2=80)
    table = torch.randperm(20, generator=torch.Generator().manual_seed(7))[:10].view(2, 5)
    qrow = torch.tensor([0, 0, 0, 1, 1, 1])
    lengths = torch.tensor([3, 0, 18, 5, 9, 17])
    extra = PoolRows(table, lengths, qrow, spp, 18)
    want = reference(q, wkv, slots, mask, sink, 0.5, xkv, extra)
    far = PoolRows(_scrub_table(table, lengths, spp, qrow), lengths, qrow, spp, 18)
    for knobs in ({}, {"splits": 4}):
        got = att.flash_sparse_attention(
            q, wkv, _scrub(slots, mask), mask, sink, 0.5, xkv, far, **knobs
        )
        _same(got, want)
        assert torch.equal(got[1], torch.zeros_like(got[1]))


def check_head_blocks_and_bf16_pools(att):
    """17 heads (two head blocks of 16), bf16 pools under fp32 queries (loaded, then upcast:
    the reference upcasts too), strided q and window mask, per-query page rows."""
    n, h, d, w = 3, 17, 32, 6
    q, wkv, slots, mask, sink, xkv = _case(n, h, d, w, 8)
    wkv, xkv = wkv.bfloat16(), xkv.bfloat16()
    q = torch.randn(h, n, d).transpose(0, 1)  # (N, H, d), not contiguous
    wide = torch.zeros(n, 2 * w, dtype=torch.bool)
    wide[:, ::2] = mask
    mask = wide[:, ::2]  # a strided view
    extra = PoolRows(torch.randint(0, 15, (n, 4)), torch.tensor([16, 2, 9]), None, 4)
    want = reference(q, wkv, slots, mask, sink, 0.2, xkv, extra)
    got = att.flash_sparse_attention(q, wkv, slots, mask, sink, 0.2, xkv, extra, block_h=16)
    _same(got, want)
    assert got.dtype == torch.float32


def check_half_inputs(att):
    """fp16 throughout (numpy's fp16 is sound, unlike the interpreter's bf16): the tensor-core
    path, operands as they are and ``P`` rounded to fp16, within a few fp16 steps."""
    n, h, d, w = 3, 4, 32, 6
    q, wkv, slots, mask, sink, xkv = _case(n, h, d, w, 10, dtype=torch.float16)
    extra = PoolRows(torch.randint(0, 60, (n, 8)), torch.tensor([3, 0, 8]))
    want = reference(q, wkv, slots, mask, sink, 0.3, xkv, extra)
    got = att.flash_sparse_attention(q, wkv, slots, mask, sink, 0.3, xkv, extra)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want.float(), rtol=4e-3, atol=4e-3)


def check_fp8_window(att):
    """An FP8 window pool (bytes + one scale per row, masked slots and their scales never
    read) under fp32 queries with fp32 extra rows, split-K too, and under fp16 queries with
    bf16 extra rows (the exact fp32 path: a dequantised row need not fit fp16); the scales'
    checks."""
    n, h, d, w = 5, 3, 24, 6
    q, _, slots, mask, sink, xkv = _case(n, h, d, w, 15)
    values, scales, _ = _fp8_pool(40, d, 16)
    extra = PoolRows(torch.randint(0, 60, (n, 8)), torch.tensor([8, 0, 3, 5, 1]))
    want = reference(q, values, slots, mask, sink, 0.3, xkv, extra, window_scale=scales)
    far = _scrub(slots, mask)
    for knobs in ({}, {"splits": 3}):
        got = att.flash_sparse_attention(
            q, values, far, mask, sink, 0.3, xkv, extra, window_scale=scales, **knobs
        )
        _same(got, want)
    q16, x16 = q.half(), xkv.bfloat16()
    want = reference(q16, values, slots, mask, sink, 0.3, x16, extra, window_scale=scales)
    got = att.flash_sparse_attention(
        q16, values, far, mask, sink, 0.3, x16, extra, window_scale=scales
    )
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-3, atol=1e-3)
    for window, scale in ((values, None), (values, scales[:3]), (xkv[:40], scales)):
        with pytest.raises(ValueError, match="window_scale"):
            att.flash_sparse_attention(q, window, slots, mask, sink, 0.3, window_scale=scale)


def check_empty_and_errors(att):
    q, wkv, slots, mask, sink, xkv = _case(2, 2, 16, 3, 9)
    extra = PoolRows(torch.zeros(2, 4, dtype=torch.long), torch.tensor([4, 1]))
    got = att.flash_sparse_attention(q[:0], wkv, slots[:0], mask[:0], sink, 1.0)
    assert got.shape == (0, 2, 16) and got.dtype == q.dtype
    none = PoolRows(torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    got = att.flash_sparse_attention(q[:0], wkv, slots[:0], mask[:0], sink, 1.0, xkv, none)
    assert got.shape == (0, 2, 16)
    zero = att.flash_sparse_attention(q, wkv, slots[:, :0], mask[:, :0], sink, 1.0)
    assert torch.equal(zero, torch.zeros_like(zero))  # no window, no extra: the sink only
    lone = PoolRows(extra.table[:1], extra.lengths[:1])
    bad = [
        ((q, wkv, slots, mask, sink, 1.0, xkv, None), "together"),
        ((q[0], wkv, slots, mask, sink, 1.0), "must be"),
        ((q, wkv[:, :8], slots, mask, sink, 1.0), "pools"),
        ((q, wkv, slots[:1], mask, sink, 1.0), "window_slots"),
        ((q, wkv, slots, mask[:, :1], sink, 1.0), "window_mask"),
        ((q, wkv, slots, mask, sink[:1], 1.0), "sink"),
        ((q, wkv, slots, mask, sink, 1.0, xkv, lone), "queries"),
        ((q.double(), wkv.double(), slots, mask, sink, 1.0), "fp64"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            att.flash_sparse_attention(*args)
    for knobs, match in (({"block_h": 8}, "block_h"), ({"block_k": 24}, "block_k"),
                         ({"splits": 0}, "splits")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            att.flash_sparse_attention(q, wkv, slots, mask, sink, 1.0, xkv, extra, **knobs)


def check_launch_config(att):
    cpu = torch.device("cpu")
    cfg = att.launch_config(32, 64, 512, 640, cpu)
    assert cfg == dict(BLOCK_H=64, BLOCK_K=32, BLOCK_D=512, splits=1, num_warps=8, num_stages=3)
    fp32 = att.launch_config(32, 64, 512, 640, cpu, True)
    assert (fp32["BLOCK_H"], fp32["BLOCK_K"], fp32["num_warps"], fp32["num_stages"]) == (
        16, 16, 8, 2,
    )  # fmt: skip
    small = att.launch_config(4, 3, 16, 20, cpu, True, num_warps=2, num_stages=3, splits=5)
    assert (small["BLOCK_H"], small["num_warps"], small["num_stages"], small["splits"]) == (
        16, 2, 3, 5,
    )  # fmt: skip
    # split-K: as many splits as fill the device, at most one per SPLIT_MIN_ROWS rows
    target = att._program_target
    try:
        att._program_target = lambda device: 132
        assert att.launch_config(1, 64, 512, 640, cpu)["splits"] == 10
        assert att.launch_config(32, 64, 512, 640, cpu)["splits"] == 4
        assert att.launch_config(32, 64, 512, 8320, cpu)["splits"] == 4
        assert att.launch_config(4096, 64, 512, 640, cpu)["splits"] == 1
    finally:
        att._program_target = target


CHECKS = [
    "check_window_only",
    "check_selection_slot_table",
    "check_shared_page_table",
    "check_head_blocks_and_bf16_pools",
    "check_half_inputs",
    "check_fp8_window",
    "check_empty_and_errors",
    "check_launch_config",
]


@pytest.mark.parametrize("name", CHECKS)
def test_attention_kernel_under_interpreter(interp, name):
    run_check(interp, globals()[name], KERNELS, CHECKS, __file__)


def test_interpreter_does_not_leak(interp):
    assert os.environ.get("TRITON_INTERPRET") == ENV_AT_IMPORT
    if interp is not None:  # a private copy: the package's own module stays untouched
        assert interp[0].__name__ == "adapters.kernels._interpreted_attention"
        assert sys.modules.get("adapters.kernels.attention") is None
