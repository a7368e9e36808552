"""The query tiles of `adapters.forward.selection`: bounded logits, power-of-two tiles, and few
distinct
kernel specialisations over a long prompt (each new one is seconds of Triton compiling: before
tiles were powers of two, a 1M-token prefill in 8K chunks met 13 top-k shapes, about half of
its 68 s on the H200)."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from adapters.forward.selection import logits_tile_rows, query_tiles


@pytest.mark.parametrize(
    "queries,entries", [(8192, 2048), (8192, 100_000), (5000, 262_144), (1, 7)]
)
def test_tiles_cover_the_queries_within_the_budget(queries, entries):
    tiles = query_tiles(queries, entries)
    assert tiles[0].start == 0 and tiles[-1].stop == queries
    assert all(a.stop == b.start for a, b in zip(tiles, tiles[1:]))
    step = logits_tile_rows(entries)
    assert step & (step - 1) == 0 and step * entries * 4 <= max(1 << 30, 4 * entries)
    assert all(t.stop - t.start == step for t in tiles[:-1])


def test_a_tile_is_the_largest_power_of_two_that_fits():
    assert logits_tile_rows(32768) == 8192  # exactly 1 GiB
    assert logits_tile_rows(32769) == 4096
    assert logits_tile_rows(1 << 40) == 1  # at least one query


def _spec(v: int) -> str:
    """How Triton specialises an integer argument."""
    return "1" if v == 1 else "16" if v % 16 == 0 else "-"


def test_a_million_token_prefill_meets_few_topk_shapes(monkeypatch):
    """Lightning TopK's launch plans (constexprs, and the divisibility of its integer arguments)
    over every tile of a 1,048,576-token prompt in 8,192-token chunks, on a 132-SM device."""
    topk = importlib.import_module("adapters.kernels.topk_lightning")
    monkeypatch.setattr(topk, "_sm_count", lambda device: 132)
    d = {k: v.default for k, v in inspect.signature(topk.lightning_topk).parameters.items()}
    knobs = topk._Knobs(
        d["block"] or 1024, d["ctas"], d["num_warps"] or 8,
        topk.HIST_MASK if d["hist_mask"] is None else d["hist_mask"], d["pdl"], d["algorithm"],
        d["chunk"], tuple(d["bound_warps"]), d["tile"], d["gather_regs"],
    )  # fmt: skip
    shapes = set()
    for step in range(1, 129):
        entries = 2048 * step  # C4 entries visible at the chunk's end
        for tile in query_tiles(8192, entries):
            b = tile.stop - tile.start
            p = topk._plan(b, entries, entries, 512, torch.device("cpu"), False, True, knobs, False)
            meta = tuple(tuple(sorted((k, str(v)) for k, v in x.meta.items())) for x in p.launches)
            ints = tuple(_spec(v) for v in (b, p.n, p.hn, p.stride, p.span, p.c, p.m, p.r, p.cc))
            shapes.add((meta, ints))
    assert len(shapes) <= 4, len(shapes)
