"""FP8 pools through the runner — the indexer keys and the window KV: what the pools store,
that prefill and decode round alike (byte for byte), the accuracy cost against native pools,
and the byte arithmetic."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from small_models import SHORT

from adapters.engine.runner import Runner
from adapters.engine.sampling import SamplingParams
from adapters.memory.formats import CacheFormat, QuantizedRows, dequantize
from adapters.memory.pools import KVPools, bytes_per_token
from adapters.model.model_config import FLASH_SHAPED
from adapters.model.weights import init_weights

PROMPT = [(11 * i + 3) % 250 for i in range(45)]
BF16, FP8 = CacheFormat.BF16, CacheFormat.FP8
#: (index_format, swa_format) of each case
CASES = {"index": (FP8, BF16), "swa": (BF16, FP8), "both": (FP8, FP8)}


def _runner(formats, dtype=torch.float64, graph: bool = False, chunk: int = 64) -> Runner:
    cc = SHORT.cache_config(page_size=4, full_capacity=512, swa_capacity=256)
    return Runner(SHORT, cc, device="cpu", dtype=dtype, weights=init_weights(SHORT, "cpu", dtype),
                  chunk_tokens=chunk, graph_decode=graph, index_format=formats[0],
                  swa_format=formats[1])  # fmt: skip


def _stored(r: Runner, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Bytes and scales of every quantised row ``tokens`` reads: its C4 entries' indexer keys
    and its live window's latents, in position order."""
    req = r.cache.admit(tokens, r.cache.match_prefix(tokens))
    plan = r.cache.read_plan(req)
    entries = torch.as_tensor(plan.stream(4).entry_slots.copy())  # the plan's arrays are read-only
    window = torch.as_tensor(plan.swa_slots[-SHORT.window :].copy())
    out = []
    pools = [(k, entries) for k in r.pools.index_keys.values()]
    pools += [(s, window) for s in r.pools.swa[: SHORT.num_layers]]
    for pool, slots in pools:
        scale = r.pools.scale_of(pool)
        if scale is not None:
            out.append((pool[slots].view(torch.uint8).clone(), scale[slots].clone()))
    r.cache.abort(req)
    return out


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("graph", [False, True])
def test_prefill_and_decode_store_the_same_fp8_bytes(graph: bool, case: str) -> None:
    """Rows written one decode token at a time (paged decode, or graph decode) are the same
    bytes and scales as those a single prefill of the whole sequence writes."""
    decoded = _runner(CASES[case], graph=graph)
    out = decoded.generate([PROMPT], SamplingParams(max_new_tokens=12))[0].output
    seq = PROMPT + out
    once = _runner(CASES[case], chunk=64)
    once.generate([seq], SamplingParams(max_new_tokens=1))
    a, b = _stored(decoded, seq[:-1]), _stored(once, seq[:-1])
    assert len(a) == len(b) > 0
    for (va, sa), (vb, sb) in zip(a, b):
        assert torch.equal(va, vb) and torch.equal(sa, sb)
        assert bool((sa > 0).all()) and bool((torch.log2(sa) % 1 == 0).all())


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp8_pools_stay_close_to_native_pools(case: str) -> None:
    """The same prompt with FP8 and with native pools: the logits differ (FP8 is really
    used), by little."""
    seen: dict[str, torch.Tensor] = {}
    for name, formats in (("native", (BF16, BF16)), ("fp8", CASES[case])):
        r = _runner(formats, dtype=torch.float32)
        r.on_logits = lambda results, logits, name=name: seen.setdefault(name, logits.clone())
        r.generate([PROMPT], SamplingParams(max_new_tokens=1))
    diff = (seen["fp8"] - seen["native"]).abs().max().item()
    assert 0 < diff < 0.1 * seen["native"].abs().max().item()


def test_stored_rows_dequantise_to_finite_values() -> None:
    r = _runner(CASES["both"])
    r.generate([PROMPT], SamplingParams(max_new_tokens=1))
    for pool in [*r.pools.index_keys.values(), r.pools.swa[0]]:
        rows = dequantize(QuantizedRows(FP8, pool, r.pools.scale_of(pool)), torch.float64)
        assert bool(torch.isfinite(rows).all()) and rows.abs().sum() > 0


def test_fp8_halves_the_window_and_indexer_bytes() -> None:
    cc = FLASH_SHAPED.cache_config(page_size=64, full_capacity=64 * 64, swa_capacity=64 * 64)
    bf16 = bytes_per_token(FLASH_SHAPED, cc, torch.bfloat16)
    fp8 = bytes_per_token(FLASH_SHAPED, cc, torch.bfloat16, FP8, FP8)
    assert fp8.index == pytest.approx(bf16.index * (128 + 4) / 256)
    assert fp8.swa == pytest.approx(bf16.swa * (512 + 4) / 1024)
    assert fp8.compressed == bf16.compressed and fp8.rings == bf16.rings
    cc = SHORT.cache_config(page_size=4, full_capacity=64, swa_capacity=64)
    pools = KVPools(SHORT, cc, "cpu", torch.float32, index_format=FP8, swa_format=FP8)
    quantised = list(pools.index_keys.values()), pools.swa[: SHORT.num_layers]
    for got, tensors in zip((pools.nbytes().index, pools.nbytes().swa), quantised):
        assert got == sum(t.numel() + 4 * pools.scale_of(t).numel() for t in tensors)
    assert pools.scale_of(pools.ring[next(iter(pools.ring))]) is None


def test_fp4_window_kv_is_refused() -> None:
    cc = SHORT.cache_config(page_size=4, full_capacity=64, swa_capacity=64)
    with pytest.raises(ValueError, match="FP4 window KV"):
        KVPools(SHORT, cc, "cpu", torch.float32, swa_format=CacheFormat.FP4)


FP4_MODEL = replace(SHORT, index_dim=32, name="short-fp4")  # FP4 blocks are 32 channels


def test_fp4_indexer_keys_through_the_runner() -> None:
    """V4.1's FP4 indexer keys (e2m1 packed two per byte, a scale per 32 channels): prefill and
    decode store the same bytes, the logits stay close to native keys', and the pool costs
    16 + 4 bytes per 32-channel key."""
    cc = FP4_MODEL.cache_config(page_size=4, full_capacity=512, swa_capacity=256)
    weights = init_weights(FP4_MODEL, "cpu", torch.float64)

    def runner(fmt: CacheFormat, chunk: int = 64) -> Runner:
        return Runner(FP4_MODEL, cc, device="cpu", dtype=torch.float64, weights=weights,
                      chunk_tokens=chunk, graph_decode=True, index_format=fmt)  # fmt: skip

    decoded = runner(CacheFormat.FP4)
    out = decoded.generate([PROMPT], SamplingParams(max_new_tokens=10))[0].output
    once = runner(CacheFormat.FP4)
    once.generate([PROMPT + out], SamplingParams(max_new_tokens=1))
    a, b = _stored(decoded, (PROMPT + out)[:-1]), _stored(once, (PROMPT + out)[:-1])
    assert len(a) == len(b) == len(decoded.pools.index_keys) > 0
    for (va, sa), (vb, sb) in zip(a, b):
        assert va.shape[-1] == 16 and sa.shape[-1] == 1  # 32 channels: 16 bytes, one scale
        assert torch.equal(va, vb) and torch.equal(sa, sb)
    seen: dict[CacheFormat, torch.Tensor] = {}
    for fmt in (CacheFormat.BF16, CacheFormat.FP4):
        r = runner(fmt)
        r.on_logits = lambda results, logits, fmt=fmt: seen.setdefault(fmt, logits.clone())
        r.generate([PROMPT], SamplingParams(max_new_tokens=1))
    diff = (seen[CacheFormat.FP4] - seen[CacheFormat.BF16]).abs().max().item()
    assert 0 < diff < 0.2 * seen[CacheFormat.BF16].abs().max().item()
    pools = decoded.pools
    assert pools.nbytes().index == sum(k.numel() + 4 * pools.scale_of(k).numel()
                                       for k in pools.index_keys.values())  # fmt: skip
