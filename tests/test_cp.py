"""Context-parallel prefill (#16 item 2): cp ranks' final-token logits equal the single-process
dense reference's, bit for bit in fp64 (max |diff| == 0.0: no reduction is split across ranks,
every query sees the same operands in the same order), and so do the compressed entries at
their global positions. The gloo cases share one spawn of 4 ranks (cp = 2 on a subgroup);
the layout and failure cases run in-process (`ThreadWorld`)."""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from small_models import CFG, SHORT, SHORT_SHARED

from adapters.distributed.cp import cp_prefill
from adapters.distributed.cp_comm import DistComm, ThreadComm, ThreadWorld
from adapters.distributed.cp_layout import CPLayout, CPLayoutError
from adapters.distributed.cp_spawn import spawn_gloo
from adapters.model.model import forward
from adapters.model.reference import DenseKeys
from adapters.model.weights import init_weights

WIDE = replace(SHORT, window=40)  # windows reach back over three 16-token chunks
#: name -> (model, prompt length, chunk_len, cp)
CASES = {
    "short_cp2": (SHORT, 150, 16, 2),
    "short_cp4": (SHORT, 150, 16, 4),
    "wide_cp4": (WIDE, 150, 16, 4),
    "tiny_cp4": (CFG, 600, 128, 4),  # window 128, C4 + C128, chunks of 128
    "shared_cp2": (SHORT_SHARED, 120, 16, 2),
}


def _prompt(length: int) -> torch.Tensor:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(length))


@functools.cache
def _reference(cfg, length):  # type: ignore[no-untyped-def]
    """fp64 logits of the last token and the entries, from one dense pass."""
    w = init_weights(cfg, dtype=torch.float64)
    keys = DenseKeys(cfg, length)
    logits = forward(w, _prompt(length), torch.arange(length), keys)[-1]
    return logits, keys


class NoGather(DistComm):  # pragma: no cover - spawned ranks
    """Skips the all-gather: other ranks' parts arrive as zeros."""

    def all_gather(self, t):  # type: ignore[no-untyped-def]
        parts = super().all_gather(t)
        return [p if q == self.rank else torch.zeros_like(p) for q, p in enumerate(parts)]


class NoHalo(DistComm):  # pragma: no cover - spawned ranks
    """Skips the SWA halo: window keys from other ranks arrive as zeros."""

    def exchange(self, sends, recv_rows, like):  # type: ignore[no-untyped-def]
        return {s: torch.zeros_like(t) for s, t in super().exchange(sends, recv_rows, like).items()}


def _ranks(rank: int, out: str) -> None:  # pragma: no cover - spawned ranks
    import torch.distributed as dist

    pair = dist.new_group([0, 1])
    comms = {2: lambda: DistComm(pair), 4: lambda: DistComm()}
    runs = {name: (cfg, n, chunk, comms[cp]) for name, (cfg, n, chunk, cp) in CASES.items()}
    runs["no_gather_cp2"] = (SHORT, 150, 16, lambda: NoGather(pair))
    runs["no_halo_cp2"] = (SHORT, 150, 16, lambda: NoHalo(pair))
    for name, (cfg, n, chunk, make) in runs.items():
        if name.endswith("cp2") and rank > 1:
            continue
        w = init_weights(cfg, dtype=torch.float64)
        res = cp_prefill(w, _prompt(n), chunk, make())
        torch.save(dict(logits=res.logits, entries=res.entries, index_keys=res.index_keys,
                        positions=res.positions), Path(out) / f"{name}_r{rank}.pt")  # fmt: skip


@pytest.fixture(scope="module")
def gloo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cp")
    spawn_gloo(_ranks, 4, (str(out),))
    return out


def _load(out: Path, name: str, cp: int) -> list[dict]:
    return [torch.load(out / f"{name}_r{r}.pt") for r in range(cp)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_gloo_logits_and_entries_equal_one_rank(gloo: Path, name: str) -> None:
    cfg, n, _, cp = CASES[name]
    logits, keys = _reference(cfg, n)
    ranks = _load(gloo, name, cp)
    for r in ranks:
        assert (r["logits"] - logits).abs().max().item() == 0.0
        for i, e in keys.entries.items():  # the whole prompt's entries, at global indices
            assert torch.equal(r["entries"][i], e)
        for i, k in keys.index_keys.items():
            assert torch.equal(r["index_keys"][i], k)
    owned = np.sort(np.concatenate([r["positions"].numpy() for r in ranks]))
    assert np.array_equal(owned, np.arange(n))  # every token computed once


@pytest.mark.parametrize("name", ["no_gather_cp2", "no_halo_cp2"])
def test_gloo_skipping_an_exchange_breaks_the_logits(gloo: Path, name: str) -> None:
    logits, _ = _reference(SHORT, 150)
    diff = max((r["logits"] - logits).abs().max().item() for r in _load(gloo, name, 2))
    assert diff > 1e-3


def test_threads_match_the_reference_at_odd_cp() -> None:
    logits, keys = _reference(SHORT_SHARED, 150)
    w = init_weights(SHORT_SHARED, dtype=torch.float64)
    res = ThreadWorld(3).run(lambda c: cp_prefill(w, _prompt(150), 16, c))
    for r in res:
        assert (r.logits - logits).abs().max().item() == 0.0
        assert all(torch.equal(r.entries[i], e) for i, e in keys.entries.items())


def test_threads_boundary_entries_matter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Leaving out the entries pooled across a chunk boundary (C4's overlap: group ``g`` also
    pools group ``g - 1``, shipped by another rank) changes the logits."""
    import adapters.distributed.cp as cp

    def no_boundaries(*args, **kwargs):  # type: ignore[no-untyped-def]
        sp = plan(*args, **kwargs)
        return replace(sp, cross_groups=sp.cross_groups[:0], cross_src=sp.cross_src[:0])

    plan = cp.stream_plan
    logits, _ = _reference(SHORT, 150)
    w = init_weights(SHORT, dtype=torch.float64)
    monkeypatch.setattr(cp, "stream_plan", no_boundaries)
    bad = ThreadWorld(2).run(lambda c: cp_prefill(w, _prompt(150), 16, c))
    assert (bad[0].logits - logits).abs().max().item() > 1e-3


def test_layout_round_robin_and_halo() -> None:
    lay = CPLayout(length=70, cp=2, chunk_len=16)
    assert lay.num_chunks == 5
    assert list(lay.positions(1)) == list(range(16, 32)) + list(range(48, 64))
    assert list(lay.owner(np.array([0, 15, 16, 64, 69]))) == [0, 0, 1, 0, 0]
    assert list(lay.local_row(np.array([0, 33, 64, 69]))) == [0, 17, 32, 37]
    assert list(lay.halo(1, 4)) == [13, 14, 15, 45, 46, 47]  # W - 1 before each chunk
    assert list(lay.halo(0, 20)) == list(range(16, 32)) + list(range(48, 64))
    assert list(lay.complete_groups(0, 16)) == [0, 2]  # group 4 = [64, 80) is incomplete
    assert list(lay.crosses(np.array([0, 1, 4, 5]), 4)) == [False, False, True, False]


def test_bad_layouts_raise_typed_errors_before_any_communication() -> None:
    w = init_weights(SHORT, dtype=torch.float64)
    with pytest.raises(CPLayoutError, match="multiple"):
        ThreadWorld(2).run(lambda c: cp_prefill(w, _prompt(150), 24, c))  # C16 groups split
    with pytest.raises(CPLayoutError, match="every rank"):
        ThreadWorld(4).run(lambda c: cp_prefill(w, _prompt(40), 16, c))  # 3 chunks, 4 ranks
    with pytest.raises(CPLayoutError):
        CPLayout(length=0, cp=1, chunk_len=16)
    with pytest.raises(CPLayoutError, match="rank 2"):
        CPLayout(length=64, cp=2, chunk_len=16).positions(2)


def test_thread_world_reraises_a_rank_error() -> None:
    def body(c: ThreadComm) -> int:
        if c.rank == 1:
            raise KeyError("rank 1 failed")
        c.all_gather(torch.zeros(1))  # rank 0 waits here until released
        return c.rank

    with pytest.raises(KeyError, match="rank 1"):
        ThreadWorld(2).run(body)
    with pytest.raises(ValueError):
        ThreadWorld(0)
