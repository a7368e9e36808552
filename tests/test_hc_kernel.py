"""The mHC kernels (`adapters/kernels/hc.py`) against their torch references
(`adapters.model.ops.hc_merge_reference`, `adapters.model.ops.sinkhorn_reference`) under Triton's
CPU
interpreter at tiny shapes: fp32 (one rounding in the kernel, several in the reference: within
fp32 rounding), fp16 streams (within one fp16 step of the fp32 result), channel counts that
are not a multiple of the block, and the refusals."""

from __future__ import annotations

import pytest
import torch
from interpreted import interpreted_modules, run_check

from adapters.model import ops

KERNELS = ("hc",)


@pytest.fixture(scope="module")
def interp():
    return interpreted_modules(KERNELS)


def _merge_case(n, s, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    streams = torch.randn(n, s, d, generator=g).to(dtype)
    y = torch.randn(n, d, generator=g).to(dtype)
    post = (2 * torch.rand(n, s, generator=g)).to(dtype)
    res = ops.sinkhorn_reference(torch.randn(n, s, s, generator=g), 3).to(dtype)
    return streams, y, post, res


def check_merge_fp32(hc):
    """fp32, channels not a multiple of the block (d = 40, block 16), and one token."""
    for n, d in ((5, 40), (1, 7)):
        streams, y, post, res = _merge_case(n, 4, d, torch.float32, seed=d)
        got = hc.flash_hc_merge(streams, y, post, res, block_d=16)
        want = ops.hc_merge_reference(streams, y, post, res)
        assert got.shape == want.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def check_merge_fp16_and_strided(hc):
    """fp16 streams round once, to the nearest fp16 of the fp32 result; a strided ``y`` (a view
    into a wider tensor) is read through its stride."""
    streams, y, post, res = _merge_case(6, 4, 24, torch.float16, seed=3)
    wide = torch.zeros(6, 48, dtype=torch.float16)
    wide[:, :24] = y
    got = hc.flash_hc_merge(streams, wide[:, :24], post, res, block_d=16)
    exact = ops.hc_merge_reference(streams.float(), y.float(), post.float(), res.float())
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), exact.half().float(), rtol=0, atol=2e-3)


def check_merge_refusals(hc):
    streams, y, post, res = _merge_case(2, 4, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match="hc_merge shapes"):
        hc.flash_hc_merge(streams, y[:1], post, res)
    s3 = torch.zeros(2, 3, 8)
    with pytest.raises(ValueError, match="power-of-two"):
        hc.flash_hc_merge(s3, y, post[:, :3], res[:, :3, :3])
    empty = hc.flash_hc_merge(streams[:0], y[:0], post[:0], res[:0])
    assert empty.shape == (0, 4, 8)


def check_sinkhorn(hc):
    """Rows of a block that hold no token (n = 70, block 64) stay out of the output; every
    matrix is doubly stochastic as the reference's is."""
    g = torch.Generator().manual_seed(1)
    logits = 3 * torch.randn(70, 4, 4, generator=g)
    got = hc.flash_sinkhorn(logits, 12)
    want = ops.sinkhorn_reference(logits, 12)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.sum(-2), torch.ones(70, 4), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="square"):
        hc.flash_sinkhorn(torch.zeros(2, 4, 3), 1)
    assert hc.flash_sinkhorn(logits[:0], 12).shape == (0, 4, 4)


CHECKS = [
    "check_merge_fp32",
    "check_merge_fp16_and_strided",
    "check_merge_refusals",
    "check_sinkhorn",
]


@pytest.mark.parametrize("name", CHECKS)
def test_hc_kernel_under_interpreter(interp, name):
    run_check(interp, globals()[name], KERNELS, CHECKS, __file__)


def test_dispatch_keeps_the_reference_off_cuda():
    """On CPU tensors the ops run their references (the paged == reference equality in fp64
    rests on it); the kernels are CUDA-only."""
    streams, y, post, res = _merge_case(3, 4, 8, torch.float64, seed=2)
    assert torch.equal(ops.hc_merge(streams, y, post, res),
                       ops.hc_merge_reference(streams, y, post, res))  # fmt: skip
    logits = torch.randn(3, 4, 4, dtype=torch.float64)
    assert torch.equal(ops.sinkhorn(logits, 5), ops.sinkhorn_reference(logits, 5))


def test_rope_inplace_equals_the_copy():
    """``inplace=True`` gives the same values as the copying rotation, in the input tensor."""
    x = torch.randn(5, 3, 16, dtype=torch.float64)
    pos = torch.arange(5) * 7
    want = ops.rope(x, pos, 8, 10000.0, inverse=True)
    got = ops.rope(x.clone(), pos, 8, 10000.0, inverse=True, inplace=True)
    assert torch.equal(got, want)
    y = x.clone()
    assert ops.rope(y, pos, 8, 10000.0, inplace=True) is y
    assert not torch.equal(y, x)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.bfloat16, 2e-2)])
def test_hc_mix_folds_the_norm_into_its_projections(dtype, tol) -> None:
    """`ops.hc_mix` scales ``flat @ diag(norm) W`` by the rms instead of normalising the wide
    streams: the same coefficients as the textbook chain (normalise, then three projections),
    to fp64 rounding, and within bf16 rounding of the fp64 chain in bf16."""
    from adapters.model.model_config import preset
    from adapters.model.weights import init_weights

    cfg = preset("tiny")
    hc = init_weights(cfg, dtype=torch.float64).layers[0].hc_attn
    g = torch.Generator().manual_seed(3)
    streams = torch.randn(6, cfg.hc_streams, cfg.hidden, generator=g, dtype=torch.float64)
    n, s, d = streams.shape
    flat = ops.rms_norm(streams.reshape(n, s * d), hc.norm, cfg.norm_eps)
    pre = torch.sigmoid(flat @ hc.w_pre + hc.b_pre)
    post = 2.0 * torch.sigmoid(flat @ hc.w_post + hc.b_post)
    res = ops.sinkhorn_reference((flat @ hc.w_res + hc.b_res).view(n, s, s), cfg.sinkhorn_iters)
    x = torch.einsum("ns,nsd->nd", pre, streams)
    low = init_weights(cfg, dtype=dtype).layers[0].hc_attn
    got = ops.hc_mix(streams.to(dtype), low, cfg.sinkhorn_iters, cfg.norm_eps)
    for g_, w_ in zip(got, (x, post, res)):
        assert g_.dtype == dtype
        torch.testing.assert_close(g_.double(), w_, rtol=tol, atol=tol)
