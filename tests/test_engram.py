"""Engram memory (#17 item 5): hashed n-grams whatever the chunking, the fp8 table the same in
every placement and split, and the runner's paged and graph decode equal to the dense
reference across chunk and prefix-hit boundaries, on the device and in host memory."""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import numpy as np
import pytest
import torch

from adapters.distributed.engram_shard import EngramPlacementError, place_engram
from adapters.engine.modes import UnsupportedModeError
from adapters.engine.runner import Runner
from adapters.engine.sampling import SamplingParams
from adapters.memory.engram_table import DeviceRows, HostRows, init_table
from adapters.memory.formats import CacheFormat, QuantizedRows, dequantize, quantize
from adapters.model.engram import (
    EngramInputError,
    chunk_ngrams,
    decode_ngrams,
    pad_token,
    sequence_ngrams,
)
from adapters.model.model_config import EngramPlacement, ModelConfig, preset
from adapters.model.reference import reference_generate, reference_logits
from adapters.model.weights import init_weights

CFG = preset("tiny-engram", engram_rows=509)
CPU = torch.device("cpu")
PAD = pad_token(CFG.vocab_size)
#: 70 tokens: chunks of 32 split it at 32 and 64; the second shares 64 (a prefix hit), the
#: third 32 tokens with it
PROMPTS = [
    [(7 * i) % 251 for i in range(70)],
    [(7 * i) % 251 for i in range(64)] + [3, 1, 4],
    [(7 * i) % 251 for i in range(32)] + [9] * 5,
]
NEW = 6


@cache
def _weights() -> object:
    return init_weights(CFG)


@cache
def _baseline() -> tuple[list[list[int]], list[int]]:
    """The device placement's paged greedy outputs and cached lengths (equal to the reference:
    `test_paged_logits_equal_reference_across_chunks`, `test_baseline_is_the_reference`)."""
    results = _runner(CFG, graph_decode=False).generate(PROMPTS, SamplingParams(max_new_tokens=NEW))
    return [r.output for r in results], [r.cached_tokens for r in results]


def _runner(cfg: ModelConfig, **kw: object) -> Runner:
    cc = cfg.cache_config(page_size=16, full_capacity=1024, swa_capacity=768)
    return Runner(cfg, cc, chunk_tokens=32, **kw)  # type: ignore[arg-type]


def test_config_refuses_bad_engram_fields() -> None:
    with pytest.raises(ValueError, match="engram_layers"):
        replace(CFG, engram_layers=(6,))
    with pytest.raises(ValueError, match="engram_ngram"):
        replace(CFG, engram_ngram=1)
    with pytest.raises(ValueError, match="positive"):
        replace(CFG, engram_rows=0)
    with pytest.raises(ValueError, match="EngramPlacement"):
        replace(CFG, engram_placement="host")


@pytest.mark.parametrize("cuts", [(), (1,), (2, 3), (5, 6, 9)])
def test_chunk_ngrams_reach_back_across_chunks(cuts: tuple[int, ...]) -> None:
    tokens = torch.tensor([11, 12, 13, 14, 15, 16, 17, 18, 19, 20])
    whole = sequence_ngrams(tokens, 3, PAD)
    assert whole[0].tolist() == [PAD, PAD, 11] and whole[4].tolist() == [13, 14, 15]
    bounds = [0, *cuts, len(tokens)]
    ctx = [tokens[max(0, a - 2) : b].numpy() for a, b in zip(bounds, bounds[1:])]
    got = chunk_ngrams(ctx, [b - a for a, b in zip(bounds, bounds[1:])], 3, PAD)
    assert np.array_equal(got, whole.numpy())
    last = decode_ngrams([tokens[7:9].numpy()], torch.tensor([20]), 3, PAD)
    assert last.tolist() == [whole[9].tolist()]


def test_table_shards_are_the_table_and_fp8_quantised() -> None:
    full = init_table(CFG)
    assert full.values.dtype == torch.float8_e4m3fn and full.values.shape == (2 * 509, 32)
    rows = dequantize(QuantizedRows(CacheFormat.FP8, full.values, full.scales), torch.float32)
    assert torch.equal(dequantize(quantize(rows, CacheFormat.FP8), torch.float32), rows)
    assert rows.std() > 0.5 and torch.all(torch.log2(full.scales) % 1 == 0)  # pow2 scales
    for rank in range(3):
        part = init_table(CFG, rank=rank, world=3)
        assert torch.equal(part.values.float(), full.values[rank::3].float())
        assert torch.equal(part.scales, full.scales[rank::3])


def test_host_lookup_equals_device_lookup() -> None:
    table = init_table(CFG)
    ids = torch.randint(0, 509, (2, 40, CFG.engram_lookups), generator=torch.Generator())
    dev = DeviceRows(table, CPU, torch.float32).lookup(ids)
    host = HostRows(table, CPU, torch.float32).lookup(ids)
    assert dev.shape == (2, 40, CFG.engram_lookups * 32) and torch.equal(dev, host)
    want = table.values[509 + ids[1, 3, 2]].float() * table.scales[509 + ids[1, 3, 2]]
    assert torch.equal(dev[1, 3, 64:96], want)


def test_forward_without_tables_raises() -> None:
    with pytest.raises(EngramInputError):
        reference_logits(_weights(), PROMPTS[0][:8])  # type: ignore[arg-type]


def test_paged_logits_equal_reference_across_chunks() -> None:
    runner, rows = _runner(CFG, graph_decode=False), []
    runner.on_logits = lambda results, logits: rows.append(logits[0].clone())
    out = runner.generate([PROMPTS[0]], SamplingParams(max_new_tokens=2))[0].output
    engram = place_engram(CFG, CPU, torch.float32)
    ref = reference_logits(_weights(), PROMPTS[0] + out[:1], engram=engram)  # type: ignore[arg-type]
    assert (rows[0] - ref[69]).abs().max() < 1e-4  # the prompt's last row: chunk 3 of 3
    assert (rows[1] - ref[70]).abs().max() < 1e-4  # the first decode row


@pytest.mark.parametrize(
    "placement, graph, overlap",
    [
        (EngramPlacement.DEVICE, True, True),
        (EngramPlacement.HOST, False, None),
        (EngramPlacement.HOST, True, True),
    ],
)
def test_greedy_equal_across_placements(
    placement: EngramPlacement, graph: bool, overlap: bool | None
) -> None:
    runner = _runner(replace(CFG, engram_placement=placement), graph_decode=graph, overlap=overlap)
    results = runner.generate(PROMPTS, SamplingParams(max_new_tokens=NEW))
    outputs, cached = _baseline()
    assert [r.cached_tokens for r in results] == cached == [0, 64, 32]  # hits at boundaries
    assert [r.output for r in results] == outputs


def test_baseline_is_the_reference() -> None:
    rows = place_engram(CFG, CPU, torch.float32)
    want = reference_generate(_weights(), PROMPTS[2], NEW, engram=rows)  # type: ignore[arg-type]
    assert _baseline()[0][2] == want  # its prefix hit ends mid-n-gram (position 32)


def test_speculation_and_sharded_without_group_are_refused() -> None:
    cc = CFG.cache_config(page_size=16, full_capacity=1024, swa_capacity=768, speculative=True)
    with pytest.raises(UnsupportedModeError, match="Engram memory layers with speculative"):
        Runner(CFG, cc, chunk_tokens=32, speculative_tokens=2, graph_decode=False)
    from adapters.engine import runner as runner_module

    def no_pools(*args, **kwargs):
        raise AssertionError("pools sized before the refusal")

    with pytest.MonkeyPatch.context() as mp:  # refused with the other modes, before any pool
        mp.setattr(runner_module, "pool_bytes", no_pools)
        with pytest.raises(UnsupportedModeError, match="speculative"):
            Runner(CFG, cc, chunk_tokens=32, speculative_tokens=2, graph_decode=False)
    with pytest.raises(EngramPlacementError, match="process group"):
        place_engram(replace(CFG, engram_placement=EngramPlacement.SHARDED), CPU, torch.float32)
