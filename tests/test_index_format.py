"""FP8 indexer keys through the runner: what the pools store, that prefill and decode round
alike, the accuracy cost against BF16 keys, and the byte arithmetic."""

from __future__ import annotations

import pytest
import torch
from small_models import SHORT

from adapters.formats import CacheFormat, QuantizedRows, dequantize
from adapters.model_config import FLASH_SHAPED
from adapters.pools import KVPools, bytes_per_token
from adapters.runner import Runner
from adapters.sampling import SamplingParams
from adapters.weights import init_weights

PROMPT = [(11 * i + 3) % 250 for i in range(45)]


def _runner(fmt: CacheFormat, dtype=torch.float64, graph: bool = False, chunk: int = 64) -> Runner:
    cc = SHORT.cache_config(page_size=4, full_capacity=512, swa_capacity=256)
    return Runner(SHORT, cc, device="cpu", dtype=dtype, weights=init_weights(SHORT, "cpu", dtype),
                  chunk_tokens=chunk, graph_decode=graph, index_format=fmt)  # fmt: skip


def _stored_keys(r: Runner, tokens: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The stored FP8 rows (values as bytes, scales) of every C4 entry of ``tokens``."""
    m = r.cache.match_prefix(tokens)
    req = r.cache.admit(tokens, m)
    slots = torch.as_tensor(r.cache.read_plan(req).stream(4).entry_slots)
    out = {}
    for layer, keys in r.pools.index_keys.items():
        out[layer] = (keys[slots].view(torch.uint8).clone(), r.pools.index_scale[layer][slots])
    r.cache.abort(req)
    return out


@pytest.mark.parametrize("graph", [False, True])
def test_prefill_and_decode_store_the_same_fp8_bytes(graph: bool) -> None:
    """Entries written one decode token at a time (paged decode, or graph decode) are the same
    bytes and scales as the entries a single prefill of the whole sequence writes."""
    decoded = _runner(CacheFormat.FP8, graph=graph)
    out = decoded.generate([PROMPT], SamplingParams(max_new_tokens=12))[0].output
    seq = PROMPT + out
    once = _runner(CacheFormat.FP8, chunk=64)
    once.generate([seq], SamplingParams(max_new_tokens=1))
    a, b = _stored_keys(decoded, seq[:-1]), _stored_keys(once, seq[:-1])
    assert a.keys() == b.keys() and len(a)
    for layer in a:
        assert torch.equal(a[layer][0], b[layer][0]) and torch.equal(a[layer][1], b[layer][1])
        scales = a[layer][1]
        assert bool((scales > 0).all()) and bool((torch.log2(scales) % 1 == 0).all())


def test_fp8_keys_stay_close_to_bf16_keys() -> None:
    """The same prompt with FP8 and with native keys: the logits differ (FP8 is really used),
    by little."""
    seen: dict[CacheFormat, torch.Tensor] = {}
    for fmt in (CacheFormat.BF16, CacheFormat.FP8):
        r = _runner(fmt, dtype=torch.float32)
        r.on_logits = lambda results, logits, fmt=fmt: seen.setdefault(fmt, logits.clone())
        r.generate([PROMPT], SamplingParams(max_new_tokens=1))
    diff = (seen[CacheFormat.FP8] - seen[CacheFormat.BF16]).abs().max().item()
    assert 0 < diff < 0.1 * seen[CacheFormat.BF16].abs().max().item()


def test_stored_rows_dequantise_to_the_entries() -> None:
    r = _runner(CacheFormat.FP8)
    r.generate([PROMPT], SamplingParams(max_new_tokens=1))
    layer, keys = next(iter(r.pools.index_keys.items()))
    rows = dequantize(QuantizedRows(CacheFormat.FP8, keys, r.pools.index_scale[layer]),
                      torch.float64)  # fmt: skip
    assert bool(torch.isfinite(rows).all()) and rows.abs().sum() > 0


def test_fp8_halves_the_indexer_bytes() -> None:
    cc = FLASH_SHAPED.cache_config(page_size=64, full_capacity=64 * 64, swa_capacity=64 * 64)
    bf16 = bytes_per_token(FLASH_SHAPED, cc, torch.bfloat16)
    fp8 = bytes_per_token(FLASH_SHAPED, cc, torch.bfloat16, CacheFormat.FP8)
    assert fp8.index == pytest.approx(bf16.index * (128 + 4) / 256)
    assert fp8.compressed == bf16.compressed and fp8.swa == bf16.swa
    pools = KVPools(SHORT, SHORT.cache_config(page_size=4, full_capacity=64, swa_capacity=64),
                    "cpu", torch.float32, index_format=CacheFormat.FP8)  # fmt: skip
    assert pools.nbytes().index == sum(
        k.numel() + 4 * pools.index_scale[i].numel() for i, k in pools.index_keys.items()
    )
    assert pools.scale_of(pools.swa[0]) is None


def test_fp4_indexer_keys_are_refused() -> None:
    with pytest.raises(ValueError, match="FP4"):
        KVPools(SHORT, SHORT.cache_config(page_size=4, full_capacity=64, swa_capacity=64),
                "cpu", torch.float32, index_format=CacheFormat.FP4)  # fmt: skip
