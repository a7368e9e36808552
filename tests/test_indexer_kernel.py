"""The fused Lightning indexer: its PyTorch reference against a literal loop over ``(n, h, g)``,
and the Triton kernel (`adapters.kernels.indexer`) against the reference under Triton's CPU
interpreter at tiny shapes (see `interpreted`).

The interpreter dots in fp32 (its 16-bit arithmetic is unreliable), so 16-bit and FP8 keys are
checked through their loads and casts, FP4 keys through their unpacking and block scales (the
fp32 values the GPU casts to bf16, exactly), and every FP8 path (`Fp8Mode`) through its operand
layout, staging and q format; the 16-bit dot plans and the FP8 dots run on the GPU only
(``bench/indexer.py`` checks them there, ``--fp8-candidates`` every FP8 path). Agreement:
within fp32 rounding of the reference, and the same -inf positions exactly.
"""

from __future__ import annotations

import sys

import pytest
import torch
from interpreted import interpreted_modules, run_check

from adapters.kernels.indexer_reference import dequantize_keys, index_logits_reference
from adapters.kernels.rows import PoolRows
from adapters.memory.formats import CacheFormat, quantize

FP8 = torch.float8_e4m3fn
U8 = torch.uint8  # FP4 keys: two e2m1 codes a byte


def _literal(q, w, keys, rows: PoolRows, key_scale=None) -> torch.Tensor:
    """``logits[n, g] = sum_h w[n, h] relu(q[n, h] . key(slot(n, g)))`` in fp64, one entry at a
    time, with the slot read from the table by hand."""
    n_q, heads, _ = q.shape
    g_rows, spp = rows.num_rows, rows.slots_per_page
    out = torch.full((n_q, g_rows), float("-inf"), dtype=torch.float64)
    for n in range(n_q):
        r = n if rows.qrow is None else int(rows.qrow[n])
        for g in range(min(int(rows.lengths[n]), g_rows)):
            slot = int(rows.table[r, g // spp]) * spp + g % spp
            key = keys[slot].double()
            if key_scale is not None:
                key = key * float(key_scale[slot])
            out[n, g] = sum(
                float(w[n, h]) * max(0.0, float(q[n, h].double() @ key)) for h in range(heads)
            )
    return out


def _case(gen, n, heads, d, spp, pages, *, sets=None, width=None, lengths=None, pool=None):
    """Random ``q``, ``w``, ``keys`` and rows: ``sets`` row sets shared through ``qrow`` (None:
    one per query), tables of distinct random pages of a pool of ``pool`` rows."""
    pool = pool or 4 * pages * spp * (sets or n)
    r = sets or n
    table = torch.stack([torch.randperm(pool // spp, generator=gen)[:pages] for _ in range(r)])
    g_rows = pages * spp if width is None else width
    if lengths is None:
        lengths = torch.randint(0, g_rows + 1, (n,), generator=gen)
    qrow = None if sets is None else torch.randint(0, sets, (n,), generator=gen)
    rows = PoolRows(table, torch.as_tensor(lengths), qrow, spp, width)
    q = torch.randn(n, heads, d, generator=gen, dtype=torch.float64)
    w = torch.randn(n, heads, generator=gen, dtype=torch.float64)
    keys = torch.randn(pool, d, generator=gen, dtype=torch.float64)
    return q, w, keys, rows


# ----------------------------------------------------------------------------- the reference


@pytest.mark.parametrize(
    "spp,sets,width", [(1, None, None), (4, None, 10), (16, None, None), (4, 1, None), (1, 2, 5)]
)
def test_reference_matches_literal_loop(spp, sets, width):
    gen = torch.Generator().manual_seed(spp * 10 + (sets or 0))
    n, pages = 5, (8 if spp == 1 else 3)
    g_rows = pages * spp if width is None else width
    lengths = [0, g_rows, 1, g_rows // 2, g_rows + 3]  # empty, full, partial, past the width
    q, w, keys, rows = _case(gen, n, 3, 8, spp, pages, sets=sets, width=width, lengths=lengths)
    want = _literal(q, w, keys, rows)
    got = index_logits_reference(q, w, keys, rows)
    assert got.dtype == torch.float64 and got.shape == (n, g_rows)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    tiled = index_logits_reference(q, w, keys, rows, tile_bytes=1)  # one query per tile
    torch.testing.assert_close(tiled, want, rtol=1e-12, atol=1e-12)


def test_reference_fp8_and_16_bit_keys():
    gen = torch.Generator().manual_seed(3)
    q, w, keys, rows = _case(gen, 4, 2, 16, 4, 4)
    scale = torch.rand(keys.shape[0], generator=gen, dtype=torch.float64) + 0.5
    k8 = keys.to(FP8)
    want = _literal(q, w, k8, rows, scale)
    got = index_logits_reference(q.float(), w.float(), k8, rows, key_scale=scale.float())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    kb = keys.bfloat16()
    got = index_logits_reference(q.bfloat16(), w.bfloat16(), kb, rows)
    want = _literal(q.bfloat16(), w.bfloat16(), kb, rows)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        index_logits_reference(q, w, k8, rows)
    assert torch.equal(dequantize_keys(kb, scale, torch.float32), kb.float())  # scale unused


def test_reference_empty():
    q, w = torch.zeros(0, 2, 8), torch.zeros(0, 2)
    rows = PoolRows(torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    assert index_logits_reference(q, w, torch.zeros(4, 8), rows).shape == (0, 3)
    q, w = torch.zeros(2, 2, 8), torch.zeros(2, 2)
    rows = PoolRows(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, dtype=torch.long), width=0)
    assert index_logits_reference(q, w, torch.zeros(4, 8), rows).shape == (2, 0)


# ------------------------------------------------------------- Triton, under the interpreter

KERNELS = ("indexer",)


@pytest.fixture(scope="module")
def interp():
    """The interpreted ``indexer`` module, or None: run the checks in a child process."""
    return interpreted_modules(KERNELS)


def _close(got, want):
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)


def _as(dtype, q, w, keys):
    return q.to(dtype), w.to(dtype), keys.to(dtype)


def check_decode_rows(ix):
    """One row set per query: slot and page tables, lengths 0 / partial / full, a width under
    the capacity, rows split over several programs, d and H padded to the dot's 16."""
    gen = torch.Generator().manual_seed(20)
    for spp, pages, width, knobs in [
        (1, 40, None, dict(block_e=16, span=16)),  # 3 programs per query, the last partial
        (4, 9, 30, dict(block_e=16)),
        (16, 3, None, {}),
    ]:
        g_rows = pages * spp if width is None else width
        lengths = [0, g_rows, 1, g_rows - 5]
        q, w, keys, rows = _case(gen, 4, 4, 32, spp, pages, width=width, lengths=lengths)
        q, w, keys = _as(torch.float32, q, w, keys)
        want = index_logits_reference(q, w, keys, rows)
        _close(ix.flash_index_logits(q, w, keys, rows, **knobs), want)
    q, w, keys, rows = _case(gen, 3, 5, 24, 4, 4)  # H = 5, d = 24: padded heads and channels
    q, w, keys = _as(torch.float32, q, w, keys)
    _close(ix.flash_index_logits(q, w, keys, rows), index_logits_reference(q, w, keys, rows))


def check_shared_rows(ix):
    """Queries sharing one table row (prefill: causal lengths, blocks of queries share a key
    tile, tiles past a block's longest length only written -inf), and mixed row sets (blocks
    computed query by query)."""
    gen = torch.Generator().manual_seed(21)
    n = 7  # a partial last block
    pos = torch.arange(n) * 9 + 3
    q, w, keys, rows = _case(gen, n, 4, 16, 4, 20, sets=1, lengths=(pos + 1) // 4)
    q, w, keys = _as(torch.float32, q, w, keys)
    want = index_logits_reference(q, w, keys, rows)
    for knobs in (dict(block_q=4, block_e=16), dict(block_q=2, block_e=32, span=32)):
        _close(ix.flash_index_logits(q, w, keys, rows, **knobs), want)
    q, w, keys, rows = _case(gen, 6, 4, 16, 1, 24, sets=3)
    q, w, keys = _as(torch.float32, q, w, keys)
    rows = PoolRows(rows.table, rows.lengths, torch.tensor([0, 0, 2, 1, 1, 1]), 1)
    _close(ix.flash_index_logits(q, w, keys, rows), index_logits_reference(q, w, keys, rows))


def _shared_tables(gen, n, pages, lead, pool_pages):
    """``n`` page tables of distinct random pages whose first ``lead`` entries are row 0's."""
    table = torch.stack([torch.randperm(pool_pages, generator=gen)[:pages] for _ in range(n)])
    table[:, :lead] = table[0, :lead]
    return table


def check_shared_prefix_decode(ix):
    """Decode over tables that begin alike (a batch over one document): the shared rows are
    read once for all and each request's own rows after them; the same logits as the reference
    (and as without the split) for no, a partial and a whole shared prefix, for requests shorter
    than the shared part, and for a tile-unaligned split (16 rows a page, 32-row tiles)."""
    gen = torch.Generator().manual_seed(24)
    spp, pages, d = 16, 6, 16
    keys = torch.randn(4 * pages * spp * 4, d, generator=gen)
    for lead in (0, 3, pages):
        table = _shared_tables(gen, 4, pages, lead, keys.shape[0] // spp)
        lengths = torch.tensor([pages * spp, 5, lead * spp + 7, pages * spp - 1])
        rows = PoolRows(table, lengths, None, spp)
        q = torch.randn(4, 4, d, generator=gen)
        w = torch.randn(4, 4, generator=gen)
        want = index_logits_reference(q, w, keys, rows)
        assert int(ix.shared_prefix_rows(table, spp)) == lead * spp
        for knobs in (dict(block_e=32, span=32), dict(block_e=16, block_q=2)):
            _close(ix.flash_index_logits(q, w, keys, rows, shared_prefix=True, **knobs), want)
        _close(ix.flash_index_logits(q, w, keys, rows, shared_prefix=False), want)


def check_key_dtypes(ix):
    """16-bit q and keys, FP8 keys with one scale per pool row, fp32 q over bf16 keys."""
    gen = torch.Generator().manual_seed(22)
    q, w, keys, rows = _case(gen, 3, 4, 32, 16, 2)
    for qd, kd in [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                   (torch.float32, torch.bfloat16)]:  # fmt: skip
        qq, ww, kk = q.to(qd), w.to(qd), keys.to(kd)
        _close(ix.flash_index_logits(qq, ww, kk, rows), index_logits_reference(qq, ww, kk, rows))
    scale = torch.rand(keys.shape[0], generator=gen) + 0.25
    k8, qb, wf = keys.to(FP8), q.bfloat16(), w.float()
    want = index_logits_reference(qb, wf, k8, rows, key_scale=scale)
    _close(ix.flash_index_logits(qb, wf, k8, rows, key_scale=scale), want)


def check_fp8_modes(ix):
    """Every `Fp8Mode` (the interpreter runs each one's operand layout, staging and q format
    with fp32 dots): decode over several programs with lengths 0 / partial / full, a prefill
    block sharing its tiles, a block computed query by query, fp16 q."""
    gen = torch.Generator().manual_seed(25)
    q, w, keys, rows = _case(gen, 4, 4, 32, 4, 10, lengths=[0, 40, 1, 33])
    scale = torch.rand(keys.shape[0], generator=gen) + 0.25
    k8, qb, wb = keys.to(FP8), q.bfloat16(), w.bfloat16()
    dec = index_logits_reference(qb, wb, k8, rows, key_scale=scale)
    n = 6
    pos = torch.arange(n) * 9 + 3
    sq, sw, skeys, srows = _case(gen, n, 4, 32, 4, 16, sets=1, lengths=(pos + 1) // 4)
    ss = torch.rand(skeys.shape[0], generator=gen) + 0.25
    sk8, sqb, swb = skeys.to(FP8), sq.bfloat16(), sw.bfloat16()
    pre = index_logits_reference(sqb, swb, sk8, srows, key_scale=ss)
    mixed = PoolRows(srows.table.repeat(2, 1), srows.lengths, torch.tensor([0, 0, 1, 0, 1, 1]), 4)
    mix = index_logits_reference(sqb, swb, sk8, mixed, key_scale=ss)
    # FP8_Q rounds q to e4m3 (another function): against the reference's fp8_q
    q8 = dict(fp8_q=True)
    dec_q8 = index_logits_reference(qb, wb, k8, rows, key_scale=scale, **q8)
    pre_q8 = index_logits_reference(sqb, swb, sk8, srows, key_scale=ss, **q8)
    mix_q8 = index_logits_reference(sqb, swb, sk8, mixed, key_scale=ss, **q8)
    assert not torch.equal(dec_q8, dec)  # the rounding shows
    for mode in ix.Fp8Mode:
        q_rounded = mode == ix.Fp8Mode.FP8_Q
        got = ix.flash_index_logits(qb, wb, k8, rows, key_scale=scale, fp8_mode=mode,
                                    block_e=16, span=32)  # fmt: skip
        _close(got, dec_q8 if q_rounded else dec)
        wants = ((srows, pre_q8), (mixed, mix_q8)) if q_rounded else ((srows, pre), (mixed, mix))
        for r, want in wants:
            got = ix.flash_index_logits(sqb, swb, sk8, r, key_scale=ss, fp8_mode=mode,
                                        block_q=4, block_e=16)  # fmt: skip
            _close(got, want)
    # one huge channel (that no key reads): the others fall to e4m3's subnormal steps, where
    # the top binade the scale aims at (2**7) decides the rounding
    wide, k0 = qb.clone(), k8.clone()
    wide[:, :, 0], k0[:, 0] = 1e5, 0.0
    got = ix.flash_index_logits(wide, wb, k0, rows, key_scale=scale, fp8_mode=ix.Fp8Mode.FP8_Q,
                                block_e=16, span=32)  # fmt: skip
    _close(got, index_logits_reference(wide, wb, k0, rows, key_scale=scale, fp8_q=True))
    qh, wh = q.half(), w.half()
    want = index_logits_reference(qh, wh, k8, rows, key_scale=scale)
    got = ix.flash_index_logits(qh, wh, k8, rows, key_scale=scale,
                                fp8_mode=ix.Fp8Mode.STAGED_F16, maxnreg=96)  # fmt: skip
    _close(got, want)


def _fp4(gen, keys):
    """FP4 codes and block scales (`formats.quantize`) of ``keys`` times a power of two per
    32-channel block (2**-4 .. 2**4: the block scales differ along each row)."""
    s, d = keys.shape
    blocks = torch.exp2(torch.randint(-4, 5, (s, d // 32), generator=gen).double())
    fp4 = quantize((keys * blocks.repeat_interleave(32, 1)).float(), CacheFormat.FP4)
    return fp4.values, fp4.scales


def check_fp4_keys(ix):
    """FP4 keys unpacked in the kernel against the reference's `dequantize_keys`: decode rows
    through a page table (d = 32 over two programs per query, d = 64, d = 96 padded to 128;
    every one of the 16 codes; lengths 0 / partial / full; fp32, bf16 and fp16 q), and queries
    sharing one row set (causal lengths, blocks of four sharing each key tile)."""
    gen = torch.Generator().manual_seed(26)
    q_dtypes = {32: (torch.float32, torch.bfloat16), 64: (torch.float16,), 96: (torch.float32,)}
    for d, knobs in ((32, dict(block_e=16, span=16)), (64, {}), (96, {})):
        q, w, keys, rows = _case(gen, 3, 4, d, 4, 6, lengths=[0, 24, 13])
        k4, s4 = _fp4(gen, keys)
        assert k4.dtype == U8 and k4.shape == (keys.shape[0], d // 2)
        assert torch.cat((k4 & 15, k4 >> 4)).unique().numel() == 16
        for qd in q_dtypes[d]:
            qq, ww = q.to(qd), w.to(qd)
            want = index_logits_reference(qq, ww, k4, rows, key_scale=s4)
            _close(ix.flash_index_logits(qq, ww, k4, rows, key_scale=s4, **knobs), want)
    n = 6
    pos = torch.arange(n) * 9 + 3
    q, w, keys, rows = _case(gen, n, 4, 32, 4, 4, sets=1, lengths=(pos + 1) // 4)
    k4, s4 = _fp4(gen, keys)
    q, w = q.float(), w.float()
    want = index_logits_reference(q, w, k4, rows, key_scale=s4)
    got = ix.flash_index_logits(q, w, k4, rows, key_scale=s4, block_q=4, block_e=16)
    _close(got, want)


def check_fp4_errors(ix):
    """FP4 keys without scales, with scales of the wrong shape, of the wrong width, with d not
    a multiple of 32, uint8 q, or an FP8 mode."""
    gen = torch.Generator().manual_seed(27)
    q, w, keys, rows = _case(gen, 2, 4, 32, 4, 2)
    q, w = q.float(), w.float()
    k4, s4 = _fp4(gen, keys)
    q48 = torch.zeros(2, 4, 48)
    bad = [
        lambda: ix.flash_index_logits(q, w, k4, rows),
        lambda: ix.flash_index_logits(q, w, k4, rows, key_scale=s4[:, 0]),
        lambda: ix.flash_index_logits(q, w, k4, rows, key_scale=s4.repeat(1, 2)),
        lambda: ix.flash_index_logits(q, w, k4.repeat(1, 2), rows, key_scale=s4),
        lambda: ix.flash_index_logits(q48, w, k4[:, :24], rows, key_scale=s4),
        lambda: ix.flash_index_logits(q.to(U8), w, k4, rows, key_scale=s4),
        lambda: ix.flash_index_logits(q, w, k4, rows, key_scale=s4, fp8_mode=ix.Fp8Mode.STAGED),
    ]
    for call in bad:
        with pytest.raises(ValueError):
            call()


def check_empty_and_out(ix):
    gen = torch.Generator().manual_seed(23)
    q, w, keys, rows = _case(gen, 2, 4, 16, 4, 2)
    q, w, keys = _as(torch.float32, q, w, keys)
    out = torch.full((2, 8), 7.0)
    assert ix.flash_index_logits(q, w, keys, rows, out=out) is out
    _close(out, index_logits_reference(q, w, keys, rows))
    empty = PoolRows(rows.table[:0], rows.lengths[:0], None, 4)
    assert ix.flash_index_logits(q[:0], w[:0], keys, empty).shape == (0, 8)
    narrow = PoolRows(rows.table, rows.lengths, None, 4, width=0)
    assert ix.flash_index_logits(q, w, keys, narrow).shape == (2, 0)
    zero = PoolRows(rows.table, torch.zeros(2, dtype=torch.long), None, 4)
    assert bool(torch.isneginf(ix.flash_index_logits(q, w, keys, zero)).all())


def check_errors(ix):
    gen = torch.Generator().manual_seed(24)
    q, w, keys, rows = _case(gen, 2, 4, 16, 4, 2)
    q, w, keys = _as(torch.float32, q, w, keys)
    shared = PoolRows(rows.table, rows.lengths, torch.zeros(2, dtype=torch.long), 4)
    bad = [
        lambda: ix.flash_index_logits(q, w[:, :3], keys, rows),
        lambda: ix.flash_index_logits(q.double(), w, keys, rows),
        lambda: ix.flash_index_logits(q, w, keys.to(torch.int8), rows),
        lambda: ix.flash_index_logits(q[:1], w[:1], keys, rows),
        lambda: ix.flash_index_logits(q, w, keys.to(FP8), rows),
        lambda: ix.flash_index_logits(q, w, keys.t().contiguous().t(), rows),
        lambda: ix.flash_index_logits(q, w, keys, rows, out=torch.empty(2, 8).double()),
        lambda: ix.flash_index_logits(q, w, keys, rows, block_q=2),  # no qrow: one query
        lambda: ix.flash_index_logits(q, w, keys, shared, block_e=24),
        lambda: ix.flash_index_logits(q, w, keys, shared, block_e=16, span=24),
        lambda: ix.flash_index_logits(q, w, keys, rows, fp8_mode=ix.Fp8Mode.STAGED),  # not FP8
    ]
    for call in bad:
        with pytest.raises(ValueError):
            call()


def check_plans_and_config(ix):
    """The GPU dot plans (the interpreter always takes fp32 operands) and launch defaults."""
    f32, bf, f16 = torch.float32, torch.bfloat16, torch.float16
    plan = ix.dot_plan
    assert plan(bf, bf) == (1, 1, bf) and plan(f16, FP8) == (1, 1, f16) and plan(f16, f16)[0] == 1
    assert plan(f32, bf) == (3, 1, bf) and plan(f32, FP8)[:2] == (3, 1)
    assert plan(f32, f32)[:2] == (3, 3) and plan(bf, f16)[:2] == (1, 2)
    assert plan(bf, U8) == (1, 1, bf) and plan(f16, U8) == (2, 1, bf)  # FP4: exact in bf16
    assert plan(f32, U8)[:2] == (3, 1)
    cpu = torch.device("cpu")
    dec = ix.launch_config(1, 1 << 18, False, 2, plan(bf, bf), cpu)
    assert (dec["BLOCK_Q"], dec["BLOCK_E"], dec["span"]) == (1, 64, 1 << 16)  # 4 programs / SM
    fp8 = ix.launch_config(32, 1 << 18, False, 1, plan(bf, FP8), cpu, per_sm=64)
    assert (fp8["BLOCK_E"], fp8["num_warps"], fp8["span"]) == (128, 8, 1 << 17)  # 2 per query
    pre = ix.launch_config(2048, 1 << 15, True, 2, plan(bf, bf), cpu)
    assert pre["BLOCK_Q"] * 64 >= 256 and pre["span"] == 1 << 15
    for shared in (False, True):  # FP4 keys: their own defaults
        fp4 = ix.launch_config(32, 1 << 18, shared, 1, plan(bf, U8), cpu, fp4=True)
        assert (fp4["BLOCK_Q"], fp4["BLOCK_E"], fp4["num_warps"]) == ix.FP4_LAUNCH[shared][:3]
    split = ix.launch_config(64, 4096, True, 2, plan(f32, f32), cpu)
    assert split["BLOCK_Q"] == 1 and split["num_stages"] == 2 and split["maxnreg"] is None


def check_fp8_mode_choice(ix):
    """Which FP8 path a launch takes, and each mode's launch defaults."""
    f32, bf, f16, mode = torch.float32, torch.bfloat16, torch.float16, ix.Fp8Mode
    assert ix.fp8_mode_for(bf, FP8, False) == ix.FP8_DECODE_MODE
    assert ix.fp8_mode_for(bf, FP8, True) == ix.FP8_PREFILL_MODE
    assert ix.fp8_mode_for(f32, FP8, False) == mode.DOT_A  # split operands: no choice
    assert ix.fp8_mode_for(bf, bf, True) == mode.DOT_A
    assert ix.fp8_mode_for(bf, U8, False) == mode.DOT_A  # FP4 keys: one path
    assert ix.fp8_mode_for(bf, FP8, True, mode.FP8_DOT) == mode.FP8_DOT
    assert ix.fp8_mode_for(f32, bf, False, mode.DOT_A) == mode.DOT_A
    for q_dtype, k_dtype, m in ((f32, FP8, mode.KEYS_B), (bf, bf, mode.STAGED),
                                (f16, FP8, mode.FP8_DOT)):  # fmt: skip
        with pytest.raises(ValueError):
            ix.fp8_mode_for(q_dtype, k_dtype, False, m)
    plans = sys.modules[ix.fp8_mode_for.__module__]  # the launch plans' module holds the default
    before = plans.FP8_DECODE_MODE
    try:  # an FP8_DOT default: fp16 q (8 of its 11 bits in two e4m3 parts) keeps DOT_A
        plans.FP8_DECODE_MODE = mode.FP8_DOT
        assert ix.fp8_mode_for(f16, FP8, False) == mode.DOT_A
        assert ix.fp8_mode_for(bf, FP8, False) == mode.FP8_DOT
    finally:
        plans.FP8_DECODE_MODE = before
    assert [m.key_operand for m in mode] == [0, 1, 2, 2, 0, 0]
    assert [m.q_format for m in mode] == [0, 0, 0, 1, 2, 3]
    # FP8_Q (q rounded to e4m3) takes any float q but needs FP8 keys
    assert all(ix.fp8_mode_for(t, FP8, False, mode.FP8_Q) == mode.FP8_Q for t in (f32, bf, f16))
    with pytest.raises(ValueError, match="FP8_Q"):
        ix.fp8_mode_for(bf, bf, False, mode.FP8_Q)
    cpu, plan = torch.device("cpu"), ix.dot_plan(bf, FP8)
    for shared in (False, True):
        for m in mode:
            cfg = ix.launch_config(2048, 1 << 15, shared, 1, plan, cpu, fp8_mode=m)
            dft = ix.ONE_DOT_LAUNCH[(shared, m)]
            assert cfg["fp8_mode"] == m and cfg["maxnreg"] == dft.maxnreg
            assert (cfg["BLOCK_Q"], cfg["BLOCK_E"], cfg["num_warps"]) == dft[:3]
    cfg = ix.launch_config(1, 4096, False, 1, plan, cpu, fp8_mode=mode.STAGED, maxnreg=80)
    assert cfg["maxnreg"] == 80
    bf16_keys = ix.launch_config(1, 4096, False, 2, plan, cpu, fp8_mode=mode.STAGED)
    assert bf16_keys["BLOCK_E"] == ix.ONE_DOT_LAUNCH[(False, None)].block_e  # 16-bit keys


CHECKS = [
    "check_decode_rows",
    "check_shared_rows",
    "check_key_dtypes",
    "check_fp8_modes",
    "check_fp4_keys",
    "check_fp4_errors",
    "check_empty_and_out",
    "check_errors",
    "check_shared_prefix_decode",
    "check_plans_and_config",
    "check_fp8_mode_choice",
]


@pytest.mark.parametrize("name", CHECKS)
def test_indexer_kernel_interpreted(interp, name):
    run_check(interp, globals()[name], KERNELS, CHECKS, __file__)
