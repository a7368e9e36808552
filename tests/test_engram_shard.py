"""Host-sharded Engram tables (#17 item 5) on 2 spawned gloo ranks: each rank holds half the
rows, the all-reduced lookup equals the whole table's bit for bit, and a runner with the
sharded placement on every rank emits the greedy tokens of the device placement."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from adapters.distributed.cp_spawn import spawn_gloo
from adapters.engine.runner import Runner
from adapters.engine.sampling import SamplingParams
from adapters.memory.engram_table import DeviceRows, init_table
from adapters.model.model_config import EngramPlacement, preset

CFG = preset("tiny-engram", engram_rows=509)
PROMPTS = [[(7 * i) % 251 for i in range(40)], [(7 * i) % 251 for i in range(32)] + [5, 6]]


def _generate(placement: EngramPlacement) -> list[list[int]]:
    cfg = replace(CFG, engram_placement=placement)
    cc = cfg.cache_config(page_size=16, full_capacity=512, swa_capacity=512)
    runner = Runner(cfg, cc, chunk_tokens=32, graph_decode=True)
    return [r.output for r in runner.generate(PROMPTS, SamplingParams(max_new_tokens=4))]


def _ranks(rank: int, out: str) -> None:  # pragma: no cover - spawned ranks
    from adapters.distributed.engram_shard import ShardedRows, place_engram

    sharded = place_engram(replace(CFG, engram_placement=EngramPlacement.SHARDED),
                           torch.device("cpu"), torch.float32)  # fmt: skip
    assert isinstance(sharded, ShardedRows)
    ids = torch.randint(0, 509, (2, 30, CFG.engram_lookups), generator=torch.Generator())
    full = DeviceRows(init_table(CFG), torch.device("cpu"), torch.float32).lookup(ids)
    result = dict(
        local_rows=int(sharded.table.values.shape[0]),
        equal=bool(torch.equal(sharded.lookup(ids), full)),
        outputs=_generate(EngramPlacement.SHARDED),
    )
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def test_sharded_lookup_and_greedy_equal_device(tmp_path: Path) -> None:
    spawn_gloo(_ranks, 2, (str(tmp_path),))
    want = _generate(EngramPlacement.DEVICE)
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["local_rows"] == 509  # half of 2 x 509 rows
        assert got["equal"]
        assert got["outputs"] == want
