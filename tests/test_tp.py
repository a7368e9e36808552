"""Tensor-parallel attention with head padding (#16 item 3): tp ranks' logits equal the
single-process dense reference's within 1e-12 in fp64 (measured 0.0 on CPU; not asserted as
0.0 because the all-reduce of the output projection's partial sums may add in another order
than one matmul), on the same bits on every rank, including ranks whose head count is padded
per call to the kernel's multiple. The gloo cases share one spawn of 4 ranks."""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from small_models import CFG, SHORT, SHORT_SHARED

from adapters.distributed.cp_comm import DistComm, ThreadWorld
from adapters.distributed.cp_spawn import spawn_gloo
from adapters.distributed.tp import (
    HeadMultiple,
    HeadPaddingError,
    PaddedHeads,
    TPError,
    TPLayout,
    shard_weights,
    tp_forward,
    tp_keys,
)
from adapters.distributed.tp_runner import greedy_run, head_counts, model_cache_config, tp_runner
from adapters.model.reference import DenseKeys, reference_logits
from adapters.model.weights import init_weights

LENGTH = 90
SIX = replace(SHORT, num_heads=6)
#: name -> (model, tp, head multiple); heads per rank -> padded heads per call
CASES = {
    "even_tp2": (SHORT, 2, 1),  # 1 -> 1
    "pad_tp2": (SIX, 2, 4),  # 3 -> 4
    "pad_tp4": (replace(SHORT, num_heads=8), 4, 4),  # 2 -> 4
    "pad_tp2_wide": (SHORT, 2, 8),  # 1 -> 8
}


#: TP Runners (paged prefill, paged or graph decode; #16): name -> (model, tp, head multiple,
#: graph decode); two prompts batched, chunked prefill, 8 greedy tokens each
RUNNER_CASES = {
    "runner_tp2_paged": (replace(CFG, num_heads=6), 2, 4, False),  # 3 -> 4, window 128, C128
    "runner_tp2_graph": (replace(CFG, num_heads=6), 2, 4, True),
    "runner_tp4_graph": (replace(SHORT, num_heads=8), 4, 4, True),  # 2 -> 4
}
RUNNER_PROMPTS = [[(7 * i + 3) % 256 for i in range(150)], [(5 * i + 1) % 256 for i in range(200)]]
NEW_TOKENS = 8


def _cache_config(cfg):  # type: ignore[no-untyped-def]
    return model_cache_config(cfg, page_size=16, full=2048, swa=512)


def _runner_case(cfg, tp, multiple, graph, comm):  # type: ignore[no-untyped-def]
    """Greedy outputs, every forward's logits and the head counts of a TP Runner (tp = 1 with
    ``comm`` None: the plain Runner over the full weights)."""
    from adapters.engine.runner import Runner

    w = init_weights(cfg, dtype=torch.float64)
    kw = dict(chunk_tokens=64, graph_decode=graph)
    if comm is None:
        r = Runner(cfg, _cache_config(cfg), "cpu", torch.float64, weights=w, **kw)
    else:
        r = tp_runner(w, _cache_config(cfg), TPLayout(tp, multiple), comm, **kw)
    out, logits = greedy_run(r, RUNNER_PROMPTS, NEW_TOKENS)
    return out, logits, (head_counts(r) if comm is not None else {})


def _prompt() -> torch.Tensor:
    return torch.randint(0, 256, (LENGTH,), generator=torch.Generator().manual_seed(7))


@functools.cache
def _reference(cfg):  # type: ignore[no-untyped-def]
    return reference_logits(init_weights(cfg, dtype=torch.float64), _prompt())


def _run(cfg, layout: TPLayout, comm) -> tuple[torch.Tensor, list[int]]:  # type: ignore[no-untyped-def]
    w = init_weights(cfg, dtype=torch.float64)
    keys, guard = tp_keys(DenseKeys(cfg, LENGTH), layout)
    shard = shard_weights(w, layout, comm.rank)
    return tp_forward(shard, _prompt(), torch.arange(LENGTH), keys, comm), guard.head_counts


def _ranks(rank: int, out: str) -> None:  # pragma: no cover - spawned ranks
    import torch.distributed as dist

    pair = dist.new_group([0, 1])
    for name, (cfg, tp, multiple) in CASES.items():
        if tp == 2 and rank > 1:
            continue
        comm = DistComm(pair if tp == 2 else None)
        logits, heads = _run(cfg, TPLayout(tp, multiple), comm)
        torch.save(dict(logits=logits, heads=heads), Path(out) / f"{name}_r{rank}.pt")
    for name, (cfg, tp, multiple, graph) in RUNNER_CASES.items():
        if tp == 2 and rank > 1:
            continue
        outs, logits, heads = _runner_case(
            cfg, tp, multiple, graph, DistComm(pair if tp == 2 else None)
        )
        torch.save(dict(outputs=outs, logits=logits, heads=heads), Path(out) / f"{name}_r{rank}.pt")


@pytest.fixture(scope="module")
def gloo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tp")
    spawn_gloo(_ranks, 4, (str(out),))
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_gloo_logits_equal_one_rank(gloo: Path, name: str) -> None:
    cfg, tp, multiple = CASES[name]
    ranks = [torch.load(gloo / f"{name}_r{r}.pt") for r in range(tp)]
    ref = _reference(cfg)
    padded = TPLayout(tp, multiple).padded_heads(cfg)
    for r in ranks:
        assert (r["logits"] - ref).abs().max().item() <= 1e-12
        assert torch.equal(r["logits"], ranks[0]["logits"])  # replicated streams stay equal
        assert set(r["heads"]) == {padded}  # every attention call ran padded
    assert padded % multiple == 0


@functools.cache
def _runner_reference(cfg, graph):  # type: ignore[no-untyped-def]
    return _runner_case(cfg, 1, 1, graph, None)


@pytest.mark.parametrize("name", sorted(RUNNER_CASES))
def test_gloo_tp_runner_equals_one_rank(gloo: Path, name: str) -> None:
    """Each rank's Runner (its heads' shards, replicated pools) emits the single engine's
    greedy tokens, and every forward's logits (prefill chunks, each decode step) are within
    1e-12 of the single engine's; every attention call ran with the padded head count."""
    cfg, tp, multiple, graph = RUNNER_CASES[name]
    outs, logits, _ = _runner_reference(cfg, graph)
    padded = TPLayout(tp, multiple).padded_heads(cfg)
    for r in [torch.load(gloo / f"{name}_r{q}.pt") for q in range(tp)]:
        assert r["outputs"] == outs
        assert len(r["logits"]) == len(logits)
        assert sum(t.numel() > 0 for t in logits) >= NEW_TOKENS  # each decode step's
        for mine, ref in zip(r["logits"], logits):
            assert mine.shape == ref.shape
            assert not mine.numel() or (mine - ref).abs().max().item() <= 1e-12
        assert set(r["heads"]) == {padded} and padded != cfg.num_heads // tp


def test_threads_tp_runner_tail_only_and_errors() -> None:
    """In-process ranks: a tail-only TP Runner (the padded keys restrict to the tail rows)
    emits what the single tail-only engine emits; `tp_weights` refuses a group of the wrong
    size and weights already sharded."""
    from adapters.distributed.tp import tp_weights
    from adapters.engine.runner import Runner

    cfg = replace(SHORT_SHARED, num_heads=4)
    w = init_weights(cfg, dtype=torch.float64)
    cc = _cache_config(cfg)
    one = Runner(cfg, cc, "cpu", torch.float64, weights=w, chunk_tokens=64, tail_only=True)
    want, _ = greedy_run(one, RUNNER_PROMPTS, 4)

    def rank(c):  # type: ignore[no-untyped-def]
        r = tp_runner(w, cc, TPLayout(2, 4), c, chunk_tokens=64, tail_only=True)
        from adapters.engine.sampling import SamplingParams

        res = r.generate(RUNNER_PROMPTS, SamplingParams(max_new_tokens=4))
        return [x.output for x in res], head_counts(r)

    for outs, heads in ThreadWorld(2).run(rank):
        assert outs == want and set(heads) == {4}
    with pytest.raises(TPError, match="group of 1"):
        ThreadWorld(1).run(lambda c: tp_weights(w, TPLayout(2), c))
    with pytest.raises(TPError, match="already"):
        ThreadWorld(1).run(lambda c: tp_weights(tp_weights(w, TPLayout(1), c), TPLayout(1), c))
    with pytest.raises(TypeError):
        head_counts(one)


def test_threads_padding_is_what_the_kernel_sees() -> None:
    """Without `PaddedHeads` the guard (the kernel's contract) refuses the rank's 3 heads;
    with it the call runs with 4 and the logits equal the reference."""
    cfg, layout = SIX, TPLayout(2, 4)
    w = init_weights(cfg, dtype=torch.float64)

    def unpadded(c):  # type: ignore[no-untyped-def]
        keys = HeadMultiple(DenseKeys(cfg, LENGTH), 4)
        shard = shard_weights(w, layout, c.rank)
        return tp_forward(shard, _prompt(), torch.arange(LENGTH), keys, c)

    with pytest.raises(HeadPaddingError, match="3 heads"):
        ThreadWorld(2).run(unpadded)
    res = ThreadWorld(2).run(lambda c: _run(cfg, layout, c))
    for logits, heads in res:
        assert (logits - _reference(cfg)).abs().max().item() <= 1e-12
        assert heads and set(heads) == {4}


def test_padded_heads_crop_to_the_real_heads() -> None:
    """The padded call's real heads equal an unpadded call's (within 1e-12: the batched
    products over 8 heads may take another BLAS path than over 3)."""
    cfg = SIX
    w = init_weights(cfg, dtype=torch.float64)
    lw = w.layers[2]  # C4: window, indexer, entries
    n = 40
    x = torch.randn(n, cfg.hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    q = torch.randn(n, 3, cfg.head_dim, dtype=torch.float64)
    kv = torch.randn(n, cfg.head_dim, dtype=torch.float64)
    from adapters.model.model import LayerInput

    layer = LayerInput(2, replace(lw, sink=lw.sink[:3]), x, q, kv, torch.arange(n))
    plain = DenseKeys(cfg, n).attend(layer)
    padded = PaddedHeads(DenseKeys(cfg, n), 8).attend(layer)
    assert padded.shape == plain.shape == (n, 3, cfg.head_dim)
    assert (padded - plain).abs().max().item() <= 1e-12
    assert (padded - plain).abs().max().item() < (plain - plain.roll(1, dims=1)).abs().max()


def test_layout_errors_are_typed() -> None:
    assert TPLayout(2, 64).padded_heads(replace(SHORT, num_heads=16)) == 64
    with pytest.raises(TPError, match="do not split"):
        TPLayout(4, 1).local_heads(SIX)
    with pytest.raises(TPError):
        TPLayout(0)
    with pytest.raises(TPError, match="rank 2"):
        TPLayout(2).heads(SHORT, 2)
