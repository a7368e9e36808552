"""adapters.kernels: the PyTorch references against straightforward maths and against the
model's own ops (``pool_groups``, ``finish_entries``, ``compressor_rows``,
``topk_lowest_index``), and the Triton kernels under Triton's CPU interpreter at tiny shapes.

The interpreter must be on (``TRITON_INTERPRET=1``) before Triton is first imported and before
the ``@triton.jit`` decorators run. On a machine without CUDA where nothing has imported Triton
yet, the `interp` fixture sets the variable, imports Triton, loads private copies of the kernel
modules, and restores the variable (so the kernel lines count for coverage). Otherwise (a CUDA
machine, or Triton already imported for real) every interpreter check runs in one child
process. Without Triton those tests are skipped.

Exactness: the top-k kernel must return exactly the reference's indices, values and counts
(``torch.equal``); the compressor must match the fp32 reference within fp32 rounding (bf16
outputs within one bf16 step).
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch
from interpreted import interpreted_modules, run_check, thorough

import adapters.kernels as kernels
from adapters.kernels import reference as ref

ENV_AT_IMPORT = os.environ.get("TRITON_INTERPRET")


# ----------------------------------------------------------------------------- references


def _model_rows(kv, score, ape, ratio, overlap):
    """Gathered rows ``(G, R, 2W)`` as the model builds them: ``[kv | score + ape[pos % r]]`` per
    token, previous group first with overlap, group -1 padded (kv 0, score -inf)."""
    t, w = kv.shape
    g = t // ratio
    pos = torch.arange(g * ratio)
    tok = torch.cat((kv[: g * ratio], score[: g * ratio] + ape[pos % ratio]), -1)
    grp = tok.view(g, ratio, 2 * w)
    if not overlap:
        return grp
    pad = torch.zeros((1, ratio, 2 * w), dtype=kv.dtype)
    pad[..., w:] = float("-inf")
    return torch.cat((torch.cat((pad, grp[:-1]), 0), grp), dim=1)


@pytest.mark.parametrize("ratio,overlap", [(4, True), (4, False), (8, True), (16, False)])
def test_compress_reference_matches_model_ops(ratio, overlap):
    from adapters.model import ops

    torch.manual_seed(ratio)
    c, d = (2 if overlap else 1), 24
    t = 5 * ratio + ratio // 2  # an incomplete group at the end is ignored
    kv, score = torch.randn(t, c * d, dtype=torch.float64), torch.randn(t, c * d).double() * 3
    ape = torch.randn(ratio, c * d, dtype=torch.float64)
    rows = _model_rows(kv, score, ape, ratio, overlap)
    pooled = ops.pool_groups(rows, overlap, ratio)
    torch.testing.assert_close(ref.compress_reference(kv, score, ape, ratio, overlap), pooled)
    torch.testing.assert_close(ref.naive_torch_chain(kv, score, ape, ratio, overlap), pooled)
    norm = torch.rand(d, dtype=torch.float64) + 0.5
    groups = torch.arange(pooled.shape[0]) + 7
    want = ops.finish_entries(pooled, norm, groups, ratio, 8, 10000.0, 1e-6)
    got = ref.compress_reference(
        kv, score, ape, ratio, overlap, norm=norm, rope_dim=8, eps=1e-6, group_offset=7
    )
    torch.testing.assert_close(got, want)


def test_compress_reference_rows_follow_compressor_rows():
    """The bias convention (``ape[pos % ratio]``, token 0 opens group 0) is the model's."""
    from adapters.model import ops
    from adapters.model.weights import Compressor

    torch.manual_seed(1)
    ratio, d, dm = 4, 16, 12
    comp = Compressor(
        w_kv=torch.randn(dm, 2 * d).double(),
        w_gate=torch.randn(dm, 2 * d).double(),
        ape=torch.randn(ratio, 2 * d).double(),
        norm=torch.ones(d).double(),
    )
    x = torch.randn(4 * ratio, dm, dtype=torch.float64)
    rows = ops.compressor_rows(x, comp, torch.arange(x.shape[0]))
    w = 2 * d
    kv, score = x @ comp.w_kv, x @ comp.w_gate
    torch.testing.assert_close(rows[:, :w], kv)
    torch.testing.assert_close(
        ref.compress_reference(kv, score, comp.ape, ratio, True),
        ref.compress_reference(rows[:, :w], rows[:, w:], None, ratio, True),
    )


def test_compress_reference_by_hand():
    """Entry 1 of a C4 overlap stream, channel by channel, written out."""
    torch.manual_seed(2)
    r, d = 4, 3
    kv, score = torch.randn(12, 2 * d).double(), torch.randn(12, 2 * d).double()
    ape = torch.randn(r, 2 * d).double()
    out = ref.compress_reference(kv, score, ape, r, True)
    for j in range(d):
        s = [score[t, j] + ape[t % r, j] for t in range(0, 4)]  # group 0, first half
        s += [score[t, d + j] + ape[t % r, d + j] for t in range(4, 8)]  # group 1, second
        v = [kv[t, j] for t in range(0, 4)] + [kv[t, d + j] for t in range(4, 8)]
        e = [torch.exp(x - max(s)) for x in s]
        want = sum(a * b for a, b in zip(e, v)) / sum(e)
        assert abs(float(out[1, j] - want)) < 1e-12
    # entry 0: the padding group contributes nothing
    s0 = score[:4, d:] + ape[:, d:]
    torch.testing.assert_close(out[0], (torch.softmax(s0, 0) * kv[:4, d:]).sum(0))
    assert ref.compress_reference(kv[:3], score[:3], ape, r, True).shape == (0, d)
    with pytest.raises(ValueError):
        ref.compress_reference(kv, score[:, :d], ape, r, True)


def test_ordered_keys_preserve_fp32_order():
    inf = float("inf")
    x = torch.tensor([-inf, -3.5, -1e-38, -0.0, 0.0, 1e-45, 2.0, 3e38, inf])
    keys = ref.ordered_keys(x)
    assert keys[0] == 0x007FFFFF and keys[3] == keys[4] == 0x80000000
    assert bool((keys[1:] >= keys[:-1]).all()) and int(keys.max()) < 2**32
    y = torch.randn(1000) * 10.0 ** torch.randint(-30, 30, (1000,))
    order = torch.argsort(y, stable=True)
    assert bool((ref.ordered_keys(y[order]).diff() >= 0).all())


def _ring_case(ratio, overlap, b, d, seed, dtype=torch.float32):
    """A ring of rows ``[kv | score + ape]`` in shuffled slots, one group per request."""
    g = torch.Generator().manual_seed(seed)
    c = 2 if overlap else 1
    t = 3 * ratio
    kv = torch.randn(b, t, c * d, generator=g, dtype=dtype)
    score = torch.randn(b, t, c * d, generator=g, dtype=dtype) * 2
    ape = torch.randn(ratio, c * d, generator=g, dtype=dtype)
    pos = torch.arange(t)
    tok = torch.cat((kv, score + ape[pos % ratio]), -1).reshape(b * t, -1)
    perm = torch.randperm(b * t, generator=g)
    ring = torch.empty_like(tok)
    ring[perm] = tok  # token i of request q lives in ring row perm[q*t + i]
    group = torch.randint(0, 3, (b,), generator=g)
    group[0] = 0
    width = 2 * ratio if overlap else ratio
    rpos = (group * ratio - (ratio if overlap else 0))[:, None] + torch.arange(width)
    pad = rpos < 0
    rows = perm.view(b, t).gather(1, rpos.clamp(min=0))
    want = torch.stack(
        [ref.compress_reference(kv[q], score[q], ape, ratio, overlap)[group[q]] for q in range(b)]
    )
    return ring, rows, pad, group, want


@pytest.mark.parametrize("ratio,overlap", [(4, True), (8, False)])
def test_gathered_reference_matches_prefill(ratio, overlap):
    ring, rows, pad, group, want = _ring_case(ratio, overlap, 5, 8, 3, torch.float64)
    got = ref.compress_gathered_reference(ring, rows, ratio, overlap, pad=pad)
    torch.testing.assert_close(got, want)
    norm = torch.rand(8).double() + 0.5
    got = ref.compress_gathered_reference(
        ring, rows, ratio, overlap, pad=pad, groups=group, norm=norm, rope_dim=4
    )
    pos = group * ratio
    torch.testing.assert_close(got, ref._epilogue(want, pos, norm, 4, 10000.0, 1e-6))
    with pytest.raises(ValueError):
        ref.compress_gathered_reference(ring, rows[:, :3], ratio, overlap)
    with pytest.raises(ValueError):
        ref.compress_gathered_reference(ring, rows, ratio, overlap, norm=norm)


def test_topk_reference_by_hand():
    inf = float("inf")
    x = torch.tensor(
        [
            [3.0, 1.0, 3.0, 2.0, 3.0, 0.0],
            [-0.0, 0.0, -1.0, 0.0, -inf, 5.0],
            [-inf, -inf, -inf, -inf, -inf, -inf],
        ]
    )
    v, i, c = ref.topk_reference(x, 2, torch.tensor([6, 4, 6]))
    assert i.tolist() == [[0, 2], [0, 1], [0, 1]]
    assert c.tolist() == [2, 2, 2]
    v, i, c = ref.topk_reference(x, 4, torch.tensor([6, 4, 3]), sorted=True)
    assert i.tolist() == [[0, 2, 4, 3], [0, 1, 3, 2], [0, 1, 2, 0]]
    assert c.tolist() == [4, 4, 3]
    assert v[2].tolist() == [-inf, -inf, -inf, -inf] and v[0].tolist() == [3, 3, 3, 2]
    v, i, c = ref.topk_reference(x, 8, torch.tensor([0, 9, -1]))
    assert (
        c.tolist() == [0, 6, 0] and i[0].tolist() == [0] * 8 and i[1, :6].tolist() == list(range(6))
    )
    assert v[0].tolist() == [-inf] * 8
    with pytest.raises(ValueError):
        ref.topk_reference(x[0], 2, None)


@pytest.mark.parametrize("kind", ["normal", "ties"])
def test_topk_reference_matches_topk_lowest_index(kind):
    from adapters.model import ops

    torch.manual_seed(4)
    x = torch.randn(3, 700) if kind == "normal" else torch.randint(0, 3, (3, 700)).float()
    x[1, ::3] = -0.0 if kind == "ties" else x[1, ::3]
    v, i, c = ref.topk_reference(x, 64, sorted=True)
    wv, wi = ops.topk_lowest_index(x, 64)
    assert torch.equal(i, wi) and torch.equal(v, wv) and c.tolist() == [64] * 3
    # unsorted: the same set, by index
    v2, i2, _ = ref.topk_reference(x, 64)
    assert torch.equal(i2, torch.sort(wi, dim=1).values)
    assert torch.equal(v2, x.gather(1, i2))


def test_dispatch_on_cpu_uses_the_references():
    assert isinstance(kernels.TRITON_AVAILABLE, bool)
    torch.manual_seed(5)
    kv, score, ape = torch.randn(17, 16), torch.randn(17, 16), torch.randn(4, 16)
    assert not kernels.use_triton(kv)
    torch.testing.assert_close(
        kernels.compress(kv, score, ape, 4, True), ref.compress_reference(kv, score, ape, 4, True)
    )
    ring, rows, pad, group, want = _ring_case(4, True, 3, 8, 6)
    torch.testing.assert_close(kernels.compress_gathered(ring, rows, 4, True, pad=pad), want)
    x = torch.randn(2, 50)
    got = kernels.topk(x, 5, torch.tensor([50, 3]), sorted=True)
    for a, b in zip(got, ref.topk_reference(x, 5, torch.tensor([50, 3]), sorted=True)):
        assert torch.equal(a, b)


def test_package_topk_is_the_dispatch_function():
    """``kernels.topk`` is the dispatch function, and no kernel module is named ``topk`` (an
    import of it would set the package attribute to the module)."""
    import pkgutil

    assert "topk" not in {info.name for info in pkgutil.iter_modules(kernels.__path__)}
    assert callable(kernels.topk) and kernels.topk.__module__ == "adapters.kernels"


# ------------------------------------------------------------- Triton, under the interpreter


KERNELS = ("compressor", "topk_lightning")


@pytest.fixture(scope="module")
def interp():
    """(compressor, topk_lightning) interpreted modules, or None: the checks run in a child."""
    return interpreted_modules(KERNELS)


def _run(interp, check) -> None:
    run_check(interp, check, KERNELS, INTERP_CHECKS, __file__)


def _close(got, want, bf16=False):
    want = want.to(got.dtype)
    assert got.shape == want.shape and got.dtype == want.dtype
    if bf16:  # one bf16 step at the value's magnitude
        tol = want.float().abs() * 2.0**-7 + 1e-6
        assert bool(((got.float() - want.float()).abs() <= tol).all())
    else:
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


def check_compress_prefill(comp, _topk):
    g = torch.Generator().manual_seed(10)
    cases = [  # ratio, overlap, d, tokens, launch knobs
        (4, True, 32, 4 * 7 + 3, {}),
        (4, True, 48, 4 * 9, dict(block_g=4, block_d=16)),  # tails in both block axes
        (4, False, 32, 4 * 5 + 1, dict(block_g=2)),
        (16, False, 16, 16 * 3 + 5, dict(rows_chunk=4)),  # online softmax over 4 chunks
        (8, True, 16, 8 * 3, dict(rows_chunk=2, block_g=2)),
        (2, False, 16, 7, {}),
    ]
    for ratio, overlap, d, t, knobs in cases:
        c = 2 if overlap else 1
        kv = torch.randn(t, c * d, generator=g)
        score = torch.randn(t, c * d, generator=g) * 3
        ape = torch.randn(ratio, c * d, generator=g)
        want = ref.compress_reference(kv, score, ape, ratio, overlap)
        _close(comp.flash_compress(kv, score, ape, ratio, overlap, **knobs), want)
        # strided inputs (kv and score as halves of one row buffer), bias already added
        both = torch.cat((kv, score + ape.repeat(t // ratio + 1, 1)[:t]), 1)
        got = comp.flash_compress(both[:, : c * d], both[:, c * d :], None, ratio, overlap)
        _close(got, want)
    # bf16 in, bf16 or fp32 out
    kv, score = torch.randn(4 * 6 + 2, 64, generator=g), torch.randn(4 * 6 + 2, 64, generator=g)
    ape = torch.randn(4, 64, generator=g)
    kb, sb, ab = kv.bfloat16(), score.bfloat16(), ape.bfloat16()
    want = ref.compress_reference(kb, sb, ab, 4, True, out_dtype=torch.float32)
    _close(comp.flash_compress(kb, sb, ab, 4, True, out_dtype=torch.float32), want)
    _close(comp.flash_compress(kb, sb, ab, 4, True), want, bf16=True)
    out = torch.empty(6, 32)
    assert comp.flash_compress(kv, score, ape, 4, True, out=out) is out
    _close(out, ref.compress_reference(kv, score, ape, 4, True))
    assert comp.flash_compress(kv[:3], score[:3], ape, 4, True).shape == (0, 32)


def check_compress_epilogue(comp, _topk):
    g = torch.Generator().manual_seed(11)
    cases = [  # ratio, overlap, d, rope_dim, group_offset
        (4, True, 32, 8, 0),
        (4, True, 56, 16, 250_000),  # 40 no-RoPE channels (not a power of two); angles ~1e6
        (8, False, 32, 0, 3),  # RMSNorm only
        (16, False, 32, 32, 1),  # RoPE on every channel
    ]
    for ratio, overlap, d, rope_dim, off in cases:
        c = 2 if overlap else 1
        t = ratio * 5 + 1
        kv, score = torch.randn(t, c * d, generator=g), torch.randn(t, c * d, generator=g)
        ape, norm = torch.randn(ratio, c * d, generator=g), torch.rand(d, generator=g) + 0.5
        kw = dict(norm=norm, rope_dim=rope_dim, theta=10000.0, eps=1e-6, group_offset=off)
        want = ref.compress_reference(kv, score, ape, ratio, overlap, **kw)
        _close(comp.flash_compress(kv, score, ape, ratio, overlap, **kw), want)
        _close(comp.flash_compress(kv, score, ape, ratio, overlap, block_g=2, **kw), want)


def check_compress_gathered(comp, _topk):
    for ratio, overlap, epi in [(4, True, False), (4, True, True), (8, False, True)]:
        ring, rows, pad, group, want = _ring_case(ratio, overlap, 5, 16, ratio)
        kw = {}
        if epi:
            norm = torch.rand(16) + 0.5
            kw = dict(groups=group, norm=norm, rope_dim=8)
            want = ref._epilogue(want, group * ratio, norm, 8, 10000.0, 1e-6)
        got = comp.flash_compress_gathered(ring, rows, ratio, overlap, pad=pad, **kw)
        _close(got, want)
        got = comp.flash_compress_gathered(
            ring, rows.int(), ratio, overlap, pad=pad.to(torch.uint8), block_g=2, **kw
        )
        _close(got, want)
    # rows over two warps and a loop of four chunks (the decode layout of C128, scaled down)
    ring, rows, pad, group, want = _ring_case(16, False, 3, 16, 7)
    for knobs in (dict(row_warps=2, rows_chunk=2), {}):
        _close(comp.flash_compress_gathered(ring, rows, 16, False, pad=pad, **knobs), want)
    # the bias added in the kernel; no padding (all groups complete)
    ring, rows, pad, group, _ = _ring_case(4, False, 3, 16, 9)
    ape = torch.randn(4, 16)
    want = ref.compress_gathered_reference(ring, rows, 4, False, ape=ape, out_dtype=torch.float32)
    _close(comp.flash_compress_gathered(ring, rows, 4, False, ape=ape), want)


def check_launch_config(comp, _topk):
    """The default launch shapes: the threads of a program cover its (entries x channels) plane
    exactly, 16 bytes each (the row axis stays in registers); whole rows of 512 channels; decode
    (few entries, many rows) spreads rows over extra warps; C4 is straight-line code."""
    cfg = comp.launch_config
    c4 = cfg(4, True, 512, 2, False, 1 << 18, False)
    assert c4 == dict(RT=4, RW=1, BLOCK_G=2, BLOCK_D=512, UNROLL=True, num_warps=4)
    c128 = cfg(128, False, 512, 2, False, 1 << 13, False)
    assert c128["RW"] == 1 and not c128["UNROLL"] and c128["BLOCK_D"] == 512
    for ratio, overlap, n in ((4, True, 32), (128, False, 32), (128, False, 128)):
        dec = cfg(ratio, overlap, 512, 4, True, n, True)  # fp32 ring, epilogue
        plane = dec["BLOCK_G"] * dec["BLOCK_D"] // (32 * 4)
        assert dec["BLOCK_D"] == 512 and dec["RW"] > 1 and dec["num_warps"] == plane * dec["RW"]
        assert dec["num_warps"] <= 16 and (2 * ratio if overlap else ratio) % (4 * dec["RW"]) == 0
    assert cfg(4, False, 56, 4, True, 10, False)["BLOCK_D"] == 64  # whole entries, padded
    for bad in (dict(block_d=256), dict(rows_chunk=3), dict(row_warps=3)):
        try:
            cfg(4, True, 512, 2, True, 100, False, **bad)
        except ValueError:
            continue
        raise AssertionError(f"expected ValueError for {bad}")


def check_compress_errors(comp, _topk):
    kv = torch.zeros(8, 32)
    bad = [
        lambda: comp.flash_compress(kv, kv[:, :16], None, 4, True),
        lambda: comp.flash_compress(torch.zeros(8, 33), torch.zeros(8, 33), None, 4, True),
        lambda: comp.flash_compress(kv, kv, torch.zeros(3, 32), 4, True),
        lambda: comp.flash_compress(kv, kv, None, 4, True, rows_chunk=3),
        lambda: comp.flash_compress(kv, kv, None, 4, True, norm=torch.ones(16), rope_dim=6),
        lambda: comp.flash_compress(kv, kv, None, 4, True, norm=torch.ones(8), rope_dim=4),
        lambda: comp.flash_compress_gathered(kv, torch.zeros(2, 5, dtype=torch.long), 4, True),
        lambda: comp.flash_compress_gathered(
            torch.zeros(8, 30), torch.zeros(2, 8, dtype=torch.long), 4, True
        ),
        lambda: comp.flash_compress_gathered(
            kv, torch.zeros(2, 8, dtype=torch.long), 4, True, norm=torch.ones(8)
        ),
        lambda: comp.flash_compress_gathered(
            kv, torch.zeros(2, 8, dtype=torch.long), 4, True, pad=torch.zeros(2, 4, dtype=bool)
        ),
    ]
    for call in bad:
        try:
            call()
        except ValueError:
            continue
        raise AssertionError("expected ValueError")


def _index_order(values, indices, counts):
    """Each row's real entries by index ascending (the reference's unsorted order)."""
    values, indices = values.clone(), indices.clone()
    for r, c in enumerate(counts.tolist()):
        order = torch.argsort(indices[r, :c])
        values[r, :c], indices[r, :c] = values[r, :c][order], indices[r, :c][order]
    return values, indices, counts


def _same_topk(topk_mod, x, k, lengths=None, algorithms=("histogram", "bound"), sort=(), **knobs):
    """Every algorithm equals the reference: the same set (any deterministic order); those in
    ``sort`` also with ``sorted=True``, in the same order. The sort stage (`topk_sort`) does not
    depend on the algorithm: each check sorts behind the algorithms its case needs, the
    thorough run behind every one (`interpreted.thorough`). Returns each algorithm's unsorted
    output."""
    sort = algorithms if thorough() else sort
    out = {}
    for algorithm in algorithms:
        for srt in (False, True) if algorithm in sort else (False,):
            got = topk_mod.lightning_topk(x, k, lengths, sorted=srt, algorithm=algorithm, **knobs)
            want = ref.topk_reference(x, k, lengths, sorted=srt)
            for a, b, what in zip(got if srt else _index_order(*got), want, "vic"):
                assert a.dtype == b.dtype and torch.equal(a, b), (
                    what, algorithm, x.shape, k, knobs, srt,
                )  # fmt: skip
            if not srt:
                out[algorithm] = got
    return out


def _same_again(topk_mod, x, k, first, **knobs):
    """The same call once more gives the same output, order included (deterministic)."""
    for algorithm, want in first.items():
        got = topk_mod.lightning_topk(x, k, algorithm=algorithm, **knobs)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), algorithm


def check_topk_random(_comp, topk_mod):
    g = torch.Generator().manual_seed(20)
    x = torch.randn(3, 3000, generator=g)
    # 6 CTAs per row (CPU: 12 CTAs in all), two blocks each, the last CTA's span ragged; the
    # sorted output of both algorithms
    first = _same_topk(topk_mod, x[:2, :1400], 64, block=128, sort=("histogram", "bound"))
    _same_again(topk_mod, x[:2, :1400], 64, first, block=128)  # the unsorted order is fixed
    _same_topk(topk_mod, x[:1, :1700], 100, block=128, ctas=7)  # 7 CTAs, ragged last span
    # bound: columns of 1 entry (the entries themselves), of 128; column loads of 128 entries
    for knobs in (dict(chunk=1), dict(chunk=128), dict(chunk=8, tile=128)):
        got = topk_mod.lightning_topk(x[:1, :1000], 64, algorithm="bound", block=128, **knobs)
        want = ref.topk_reference(x[:1, :1000], 64)
        assert all(torch.equal(a, b) for a, b in zip(_index_order(*got), want)), knobs
    bad_knobs = (dict(chunk=3), dict(algorithm="sort"), dict(trace=torch.zeros(3, 1, 2, 8)))
    for bad in bad_knobs + (dict(block=384), dict(block=32768), dict(block=8)):
        try:
            topk_mod.lightning_topk(x, 8, **{"block": 128, **bad})
        except ValueError:
            continue
        raise AssertionError(f"expected ValueError for {bad}")
    assert topk_mod.topk_trace(2, "cpu").shape == (3, 2, topk_mod._MAX_CTAS, 8)
    # "auto": the histogram algorithm below AUTO_BOUND_ROWS rows, the bound one from there
    rows = torch.randn(topk_mod.AUTO_BOUND_ROWS, 256, generator=g)
    _same_topk(topk_mod, rows, 40, algorithms=("auto",), block=128)
    _same_topk(topk_mod, x[:2, :1000].double() * 1e30, 50, block=512, num_warps=2)  # fp64 in
    xs = x[:1, ::2]  # strided rows
    _same_topk(topk_mod, xs, 33, block=256)
    # a reused workspace is left zeroed by the kernels
    ws = topk_mod.topk_workspace(4, "cpu")
    ints = torch.randint(0, 3, (4, 900), generator=g).float()
    for rows, k in ((x[:, :1000], 64), (ints, 300)):
        _same_topk(
            topk_mod, rows, k, torch.tensor([900, 5, 0, 700])[: len(rows)], block=128, workspace=ws
        )
        assert not ws.any()
    try:
        topk_mod.lightning_topk(x, 8, workspace=ws[:2])
    except ValueError:
        pass
    else:
        raise AssertionError("expected ValueError")


def check_topk_ties(_comp, topk_mod):
    g = torch.Generator().manual_seed(21)
    x = torch.randint(0, 3, (4, 1000), generator=g).float()  # 4 CTAs per row, 2 blocks each
    x[1] = 7.0  # all equal: the k lowest indices
    x[2, ::2] = -0.0  # -0.0 ties +0.0
    x[2, 1::2] = 0.0
    x[3, 450:] = float("-inf")  # -inf padding, selected last and by index
    # sorted: ties by index (the histogram algorithm's output is not in index order)
    _same_topk(topk_mod, x, 120, block=128, sort=("histogram",))
    # the older-Triton histogram path (`_histogram` without a mask; the bound algorithm's in
    # check_topk_lengths and check_topk_tail)
    _same_topk(topk_mod, x, 120, algorithms=("histogram",), block=128, hist_mask=False)
    y = torch.full((2, 300), float("-inf"))
    y[0, 5] = 1.0
    _same_topk(topk_mod, y, 64, block=128, sort=("bound",))
    # the k-th value straddles CTAs: ties across CTA boundaries, taken lowest index first
    z = torch.zeros(1, 1024)
    z[0, ::5] = 1.0
    _same_topk(topk_mod, z, 250, block=128, ctas=8)


def check_topk_lengths(_comp, topk_mod):
    g = torch.Generator().manual_seed(22)
    x = torch.randn(5, 1000, generator=g)
    x[4] = torch.randint(0, 2, (1000,), generator=g).float()
    lengths = torch.tensor([1000, 40, 0, 2000, 700])  # fewer than k, none, past N, ties
    # sorted: the padding after short and empty rows
    _same_topk(topk_mod, x, 64, lengths, block=128, sort=("bound",))
    _same_topk(topk_mod, x, 64, lengths.int(), block=128, hist_mask=False)
    _same_topk(topk_mod, x[:2, :50], 100)  # k > N: every row takes all
    # int64 lengths past 2**31 clamp to the row (they must not wrap to a small length)
    _same_topk(topk_mod, x[:2, :600], 64, torch.tensor([2**32 + 3, 2**40]), block=256)
    # bound: 32 columns < k (no bound: every entry a candidate) beside short and empty rows
    _same_topk(
        topk_mod, x[:3], 64, torch.tensor([1000, 40, 0]), algorithms=("bound",),
        block=128, chunk=64,
    )  # fmt: skip
    v, i, c = topk_mod.lightning_topk(x[:0], 8)
    assert v.shape == (0, 8) and i.shape == (0, 8) and c.shape == (0,)
    for bad in (lambda: topk_mod.lightning_topk(x[0], 4), lambda: topk_mod.lightning_topk(x, 0)):
        try:
            bad()
        except ValueError:
            continue
        raise AssertionError("expected ValueError")


def check_topk_tail(_comp, topk_mod):
    """The last CTA's finish on long candidate lists (more than one 1024-chunk): a dense 16-bit
    bin refined over several chunks, threshold ties with larger entries far behind them, every
    selected entry in the last CTA's range; and a reused workspace left zeroed throughout.
    (The sort stage behind it: check_topk_random and the others.)"""
    g = torch.Generator().manual_seed(23)
    n = 1400
    dense = 1.0 + torch.rand(1, n, generator=g) * 2**-8  # one 16-bit bin, distinct keys
    ties = torch.full((1, n), 5.0)
    ties[0, -40:] = 7.0  # T = 5.0: its lowest-index ties, then the 7.0s at the end
    ascending = torch.arange(n, dtype=torch.float32)[None]
    ws = topk_mod.topk_workspace(1, "cpu")
    first = {}
    for x, k in ((dense, 100), (ties, 300), (ascending, 200)):
        first[k] = _same_topk(topk_mod, x, k, block=256, workspace=ws)
        assert not ws.any()
    # a threshold bin of 33..128 entries (the larger pairwise tile): 100 keys in one 16-bit bin
    mid = torch.randn(1, n, generator=g)
    mid[0, 7::13][:100] = 3.0 + torch.rand(100, generator=g) * 2**-8
    _same_topk(topk_mod, mid, 60, block=256, workspace=ws)
    # the top entries all in 4 of 64 columns (period 64): the bound lies far below the
    # threshold, whose prefix then takes two histogram rounds
    packed = torch.randn(1, 1024, generator=g)
    packed[0].view(16, 64)[:, :4] = 1e6 + torch.arange(64.0).view(16, 4)
    for hist_mask in (True, False):
        _same_topk(
            topk_mod, packed, 64, algorithms=("bound",), block=128, chunk=16, workspace=ws,
            hist_mask=hist_mask,
        )  # fmt: skip
    assert not ws.any()
    # a crowded bin of two keys (one ulp apart) whose lower key is only partly taken: the
    # select tail refines, then ranks the ties
    two = torch.where(torch.rand(1, 600, generator=g) < 0.5, 1.0, torch.nextafter(
        torch.tensor(1.0), torch.tensor(2.0)))  # fmt: skip
    _same_topk(topk_mod, two, 400, algorithms=("histogram",), block=128, workspace=ws)
    # an all-equal bin taken by index over more than one tail chunk (want > 2048)
    _same_topk(topk_mod, torch.full((1, 2200), 0.5), 2100, block=256, workspace=ws)
    # the same call again on one workspace: the same output, the workspace zeroed each time
    _same_again(topk_mod, ties, 300, first[300], block=256, workspace=ws)
    assert not ws.any()


def check_topk_failed_launch(_comp, topk_mod):
    """A launch that fails part-way drops the cached workspace it may have left dirty."""
    ws, other = topk_mod.topk_workspace(1, "cpu"), topk_mod.topk_workspace(1, "cpu")
    topk_mod._STREAM_WORKSPACES[(-2, -2)] = [other]
    topk_mod._STREAM_WORKSPACES[(-1, -1)] = [ws]

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("launch failed")

            return launch

    real = topk_mod._hist2_kernel
    topk_mod._hist2_kernel = Broken()
    real_ws = topk_mod._stream_workspace
    topk_mod._stream_workspace = lambda batch, device: ws
    try:
        for given in (None, other):  # a caller's own workspace is the caller's to drop
            try:
                topk_mod.lightning_topk(torch.randn(1, 300), 8, block=128, workspace=given)
            except RuntimeError:
                continue
            raise AssertionError("expected the launch error")
    finally:
        topk_mod._hist2_kernel = real
        topk_mod._stream_workspace = real_ws
    assert topk_mod._STREAM_WORKSPACES.pop((-1, -1)) == []
    assert topk_mod._STREAM_WORKSPACES.pop((-2, -2)) == [other]


INTERP_CHECKS = [
    "check_compress_prefill",
    "check_compress_epilogue",
    "check_compress_gathered",
    "check_compress_errors",
    "check_launch_config",
    "check_topk_random",
    "check_topk_ties",
    "check_topk_lengths",
    "check_topk_tail",
    "check_topk_failed_launch",
]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # tail rows
@pytest.mark.parametrize("name", INTERP_CHECKS)
def test_triton_kernel_under_interpreter(interp, name):
    _run(interp, globals()[name])


def test_interpreter_does_not_leak(interp):
    assert os.environ.get("TRITON_INTERPRET") == ENV_AT_IMPORT
    if interp is not None:  # private copies: the package's own modules stay untouched
        assert interp[0].__name__ == "adapters.kernels._interpreted_compressor"
        assert sys.modules.get(interp[1].__name__) is None


@pytest.mark.skipif(
    not (torch.cuda.is_available() and kernels.TRITON_AVAILABLE), reason="needs CUDA and Triton"
)
def test_topk_on_cuda_graphs_streams_and_long_lengths():  # pragma: no cover - needs a GPU
    """Both algorithms on the GPU: two graphs captured on torch's shared capture stream and
    replayed in the other order (each has its own workspace), eager calls on two streams, and
    int64 lengths past 2**31."""
    tk = importlib.import_module("adapters.kernels.topk_lightning")
    g = torch.Generator("cuda").manual_seed(3)
    for b, algorithm in ((2, "histogram"), (tk.AUTO_BOUND_ROWS + 1, "bound")):
        x = torch.randn(b, 20_000, device="cuda", generator=g)
        want = ref.topk_reference(x.cpu(), 64)
        tk.lightning_topk(x, 64, algorithm=algorithm)  # compiled outside the capture
        graphs, outs = [], []
        for _ in range(2):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs.append(tk.lightning_topk(x, 64, algorithm=algorithm))
            graphs.append(graph)
        for graph, out in zip(graphs[::-1], outs[::-1]):
            graph.replay()
            torch.cuda.synchronize()
            got = _index_order(*(t.cpu() for t in out))
            assert all(torch.equal(a, w) for a, w in zip(got, want)), algorithm
        lengths = torch.tensor([2**32 + 3] + [5_000] * (b - 1), device="cuda")
        want = ref.topk_reference(x.cpu(), 64, lengths.cpu())
        for stream in (torch.cuda.Stream(), torch.cuda.current_stream()):
            with torch.cuda.stream(stream):
                out = tk.lightning_topk(x, 64, lengths, algorithm=algorithm)
            torch.cuda.synchronize()
            got = _index_order(*(t.cpu() for t in out))
            assert all(torch.equal(a, w) for a, w in zip(got, want)), (algorithm, "lengths")


def check_topk_plans(_comp, topk_mod):
    """Launch plans (`adapters.kernels.launch`): one per shape, flags and pointer alignment,
    reused with the same results; none kept with the cache switched off; `sort_topk`'s own."""
    from adapters.kernels import launch

    plans, sorts = topk_mod._PLANS, topk_mod._SORTS
    plans.clear()
    sorts.clear()
    x = torch.randn(2, 701, generator=torch.Generator().manual_seed(24))
    y = x[:, :700].contiguous()
    first = topk_mod.lightning_topk(y, 16, block=128)
    again = topk_mod.lightning_topk(y.clone(), 16, block=128)
    assert all(torch.equal(a, b) for a, b in zip(first, again)) and len(plans) == 1
    # rows 4 bytes off 16-byte alignment, with lengths, unsorted and sorted: a plan each
    _same_topk(
        topk_mod, x[:, 1:], 16, torch.tensor([700, 9]), algorithms=("histogram",),
        sort=("histogram",), block=128,
    )  # fmt: skip
    assert len(plans) == 3
    launch.CACHE_LAUNCHES = False
    try:
        _same_topk(topk_mod, x, 20, algorithms=("bound",), block=128)
    finally:
        launch.CACHE_LAUNCHES = True
    assert len(plans) == 3
    v, i, c = (t.clone() for t in first)
    for _ in range(2):
        topk_mod.sort_topk(y, v, i, c)
    want = ref.topk_reference(y, 16, sorted=True)
    assert all(torch.equal(a, b) for a, b in zip((v, i, c), want)) and len(sorts) == 1


PLAN_CHECKS = ["check_topk_plans"]


def test_topk_launch_plans_under_interpreter(interp):
    run_check(interp, check_topk_plans, KERNELS, PLAN_CHECKS, __file__)
