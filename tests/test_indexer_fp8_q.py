"""V4's FP8 indexer rounds its queries to e4m3 (`indexer_reference.round_q_e4m3`): the rule by
hand (the power-of-two scale into the top binade, ties to even, the subnormal steps), and the
dispatch that applies it when asked (`kernels.index_logits`)."""

from __future__ import annotations

import pytest
import torch

from adapters import kernels
from adapters.kernels.indexer_reference import index_logits_reference, round_q_e4m3
from adapters.kernels.rows import PoolRows


def _r(*values: float) -> list[float]:
    return round_q_e4m3(torch.tensor([[values]])).flatten().tolist()


def test_rounding_by_hand() -> None:
    # max 1.0 scales by 2**7: 0.3 -> 38.4 -> 40 (steps of 4 in [32, 64)) -> 0.3125
    assert _r(1.0, 0.3) == [1.0, 0.3125]
    # 34 lies halfway between 32 and 36: ties to the even significand, 32
    assert _r(1.0, 34 / 128) == [1.0, 0.25]
    # the scale follows the head's max: the same ratio, the same rounding, at any magnitude
    assert _r(2.0**-20, 0.3 * 2.0**-20) == [2.0**-20, 0.3125 * 2.0**-20]
    # below 2**-6 (scaled) e4m3 steps by 2**-9: 1.5 steps is a tie, to 2 steps
    assert _r(1.0, 3 * 2.0**-17) == [1.0, 2.0**-15]
    assert _r(1.0, 2.0**-14) == [1.0, 2.0**-14]  # exactly 4 subnormal steps
    assert _r(0.0, 0.0) == [0.0, 0.0]
    assert round_q_e4m3(torch.ones(1, 2, dtype=torch.float64)).dtype == torch.float64


def test_fp8_q_is_asked_for_and_only_with_fp8_keys() -> None:
    """The dispatch rounds q when asked (FP8 keys): it equals the reference with ``fp8_q`` and
    differs from the unrounded logits, which stay the default; other keys refuse it."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 32, generator=gen).bfloat16()
    w = torch.randn(3, 4, generator=gen).bfloat16()
    keys = torch.randn(64, 32, generator=gen)
    rows = PoolRows(torch.tensor([[0, 1], [2, 3], [1, 0]]), torch.tensor([16, 9, 0]), None, 8)
    k8, scale = keys.to(torch.float8_e4m3fn), torch.rand(64, generator=gen) + 0.5
    got = kernels.index_logits(q, w, k8, rows, key_scale=scale, fp8_q=True)
    rounded = index_logits_reference(q, w, k8, rows, key_scale=scale, fp8_q=True)
    exact = index_logits_reference(q, w, k8, rows, key_scale=scale)
    assert torch.equal(got, rounded) and not torch.equal(got, exact)
    assert torch.equal(kernels.index_logits(q, w, k8, rows, key_scale=scale), exact)
    with pytest.raises(ValueError, match="fp8_q"):  # as the kernel would refuse it
        kernels.index_logits(q, w, keys.bfloat16(), rows, fp8_q=True)
