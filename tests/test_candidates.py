"""V4.1's two-level selection (docs/sharing.md, "Shared candidates"): the candidate source
publishes blocks of entries per query (the newest visible entry's block always, then the best
by the max of their logits), later indexer layers of its ratio take their top-k among them.

The filter excludes nothing while a query sees at most ``blocks * block`` entries (selections
and logits equal the unfiltered model's, bit for bit), and does filter beyond (small shapes:
4 blocks of 2). The reference, the paged path and the graph decode agree exactly in float64.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from small_models import SHORT, SHORT_SHARED, fp64_weights, one_thread
from test_model import TOKENS, Paged, assert_exact

from adapters.forward.graph_decode import GraphDecoder
from adapters.model import ops
from adapters.model.candidates import block_scores, select_candidates
from adapters.model.model import forward
from adapters.model.model_config import ModelConfig
from adapters.model.reference import DenseKeys, reference_logits

pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")

#: SHORT_SHARED (C4 index sources 1 and 5) with layer 1 the candidate source: 4 blocks of 2
SMALL_CANDS = dataclasses.replace(
    SHORT_SHARED, index_topk=4, candidate_source=1, candidate_blocks=4, candidate_block=2
)
#: the same with V4.1's 2,048 blocks of 8
V41_CANDS = dataclasses.replace(SMALL_CANDS, candidate_blocks=2048, candidate_block=8)
#: unshared (0, 4, 16, 4): every C4 layer runs its indexer, layer 3 restricted to layer 1's
UNSHARED_CANDS = dataclasses.replace(
    SHORT, index_topk=4, candidate_source=1, candidate_blocks=3, candidate_block=2
)


_one_thread = pytest.fixture(autouse=True, scope="module")(one_thread)


weights = fp64_weights


@functools.cache
def dense_run(cfg: ModelConfig, n: int) -> tuple[torch.Tensor, DenseKeys]:
    """The reference over ``TOKENS[:n]``, and its keys (selections, candidates)."""
    tokens = TOKENS[:n]
    ids = torch.tensor(tokens)
    keys = DenseKeys(cfg, len(tokens))
    with torch.no_grad():
        logits = forward(weights(cfg), ids, torch.arange(len(tokens)), keys)
    return logits, keys


def unfiltered(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` without shared candidates (one config whatever the block sizes were)."""
    return dataclasses.replace(cfg, candidate_source=None, candidate_blocks=2048, candidate_block=8)


def chosen_sets(keys: DenseKeys, layer: int) -> list[set[int]]:
    idx, valid = keys.selection[layer]
    return [set(i[v].tolist()) for i, v in zip(idx, valid)]


# -- the maths ------------------------------------------------------------------------------------


def test_select_candidates_by_example() -> None:
    inf = float("-inf")
    logits = torch.tensor(
        [
            [5.0, 0.0, 1.0, 9.0, 2.0, 2.0, 7.0, 0.0, 3.0, 1.0, 4.0],  # 11 visible
            [1.0, 2.0, 3.0, inf, inf, inf, inf, inf, inf, inf, inf],  # 3 visible
            [inf] * 11,  # none
        ]
    )
    lengths = torch.tensor([11, 3, 0])
    assert block_scores(logits, 2)[0].tolist() == [5.0, 9.0, 2.0, 7.0, 3.0, 4.0]
    cands = select_candidates(logits, lengths, num_blocks=3, block=2)
    picked = [set(b[v].tolist()) for b, v in zip(cands.blocks, cands.valid)]
    # row 0: newest block 5 (entry 10), then the best others: 1 (max 9) and 3 (max 7)
    assert picked == [{5, 1, 3}, {1, 0}, set()]
    mask = cands.entry_mask(11)
    assert mask[0].nonzero().flatten().tolist() == [2, 3, 6, 7, 10]
    assert mask[1, :3].all() and not mask[2].any()
    assert torch.isinf(cands.restrict(logits)[0, [0, 1, 4, 5, 8, 9]]).all()


@given(
    data=st.data(),
    g=st.integers(1, 40),
    block=st.integers(1, 5),
    num_blocks=st.integers(1, 9),
)
def test_candidate_properties(data, g: int, block: int, num_blocks: int) -> None:
    """The newest block is kept, min(num_blocks, visible blocks) blocks are; everything when
    the visible entries fit; the entry top-k is inside whenever topk < num_blocks (ties
    included: small integer logits)."""
    n = 3
    vals = data.draw(st.lists(st.integers(0, 3), min_size=n * g, max_size=n * g))
    lengths = torch.tensor(data.draw(st.lists(st.integers(0, g), min_size=n, max_size=n)))
    logits = torch.tensor(vals, dtype=torch.float64).view(n, g)
    visible = torch.arange(g)[None, :] < lengths[:, None]
    logits = logits.masked_fill(~visible, float("-inf"))
    cands = select_candidates(logits, lengths, num_blocks, block)
    mask = cands.entry_mask(g)
    for row in range(n):
        length = int(lengths[row])
        kept = set(cands.blocks[row][cands.valid[row]].tolist())
        assert len(kept) == int(cands.valid[row].sum())  # no block twice
        assert len(kept) == min(num_blocks, -(-length // block))
        if length:
            assert (length - 1) // block in kept
        if length <= num_blocks * block:
            assert mask[row][visible[row]].all()  # every visible entry competes
    topk = num_blocks - 1
    if topk:
        values, idx = ops.topk_lowest_index(logits, min(topk, g))
        assert mask.gather(1, idx)[torch.isfinite(values)].all()


# -- the reference --------------------------------------------------------------------------------


def test_no_filter_while_every_entry_fits() -> None:
    """V4.1's 2,048 x 8 over 200 tokens (50 entries), and 4 x 2 over 32 tokens (at most 8
    entries): selections and logits equal the unfiltered model's, bit for bit."""
    for cfg, n in ((V41_CANDS, 200), (SMALL_CANDS, 32)):
        base = unfiltered(cfg)
        got, keys = dense_run(cfg, n)
        want, plain = dense_run(base, n)
        assert keys.candidates is not None and plain.candidates is None
        for layer in (1, 5):
            assert torch.equal(keys.selection[layer][0], plain.selection[layer][0])
            assert torch.equal(keys.selection[layer][1], plain.selection[layer][1])
        assert torch.equal(got, want)


def test_filters_beyond_the_budget() -> None:
    """4 blocks of 2 over 200 tokens (up to 50 entries): layer 5 picks only candidates, so
    its selection (and the logits) differ from the unfiltered model's; the candidate source
    itself (layer 1) is unrestricted."""
    got, keys = dense_run(SMALL_CANDS, 200)
    want, plain = dense_run(unfiltered(SMALL_CANDS), 200)
    assert keys.candidates is not None
    inside = keys.candidates.entry_mask(50)
    idx, valid = keys.selection[5]
    assert inside.gather(1, idx)[valid].all()
    assert chosen_sets(keys, 1) == chosen_sets(plain, 1)
    differ = [a != b for a, b in zip(chosen_sets(keys, 5), chosen_sets(plain, 5))]
    assert sum(differ) > 50 and not any(differ[:32])  # nothing filtered while it fits
    assert not torch.equal(got, want) and torch.equal(got[:32], want[:32])


def test_bad_candidate_configs_rejected() -> None:
    for bad in (
        dict(candidate_source=2),  # C16: no indexer
        dict(candidate_source=3),  # C4 reusing layer 1's selection
        dict(candidate_source=9),
        dict(candidate_source=True),
        dict(candidate_blocks=0),
        dict(candidate_block=0),
    ):
        with pytest.raises(ValueError, match="candidate"):
            dataclasses.replace(SHORT_SHARED, **bad)  # type: ignore[arg-type]
    assert [SMALL_CANDS.restricts_to_candidates(i) for i in range(8)] == [i == 5 for i in range(8)]
    assert [UNSHARED_CANDS.restricts_to_candidates(i) for i in range(4)] == [0, 0, 0, 1]
    assert SMALL_CANDS.unshared().candidate_source is None
    assert SMALL_CANDS.first_layers(1).candidate_source is None
    assert SMALL_CANDS.first_layers(2).candidate_source == 1


# -- the cached paths -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg,page,schedule", [(SMALL_CANDS, 4, [37] * 8), (SMALL_CANDS, 16, [64, 5, 64, 100]),
                          (UNSHARED_CANDS, 8, [50] * 6)],
)  # fmt: skip
def test_paged_equals_reference(cfg: ModelConfig, page: int, schedule: list[int]) -> None:
    """Chunked prefill of 230 tokens then decode, candidates on and filtering: bit for bit."""
    prompt, extra = TOKENS[:230], TOKENS[300:304]
    eng = Paged(cfg, page, max(schedule))
    req = eng.admit(prompt, reuse=False)
    got = [eng.prefill(req, schedule)]
    for t in extra:
        got += eng.step([req], [[t]])
    want = reference_logits(weights(cfg), prompt + extra)
    assert_exact(torch.cat(got), want, f"page {page}")
    assert not torch.equal(want, reference_logits(weights(unfiltered(cfg)), prompt + extra))
    eng.cache.finish(req)


def test_graph_decoder_equals_reference() -> None:
    """Graph decode (eager on the CPU): a batch of three whose contexts straddle the budget."""
    cfg = SMALL_CANDS
    prompts = [TOKENS[:30], TOKENS[:121], TOKENS[200:260]]
    eng = Paged(cfg, 8, max_chunk=64, full_tokens=800)
    dec = GraphDecoder(eng.weights, eng.pools, eng.cc, 4, eng.cc.full_capacity, None, 64)
    reqs = [eng.admit(p, reuse=False) for p in prompts]
    got = [[eng.prefill(r, [64] * 3)] for r in reqs]
    fed: list[list[int]] = [[] for _ in prompts]
    rng = np.random.default_rng(7)
    for _ in range(6):
        toks = rng.integers(0, 256, len(reqs)).tolist()
        plan = eng.cache.extend_batch(reqs, [[t] for t in toks])
        logits = dec.step(reqs, toks, plan.deltas)
        for i in range(len(reqs)):
            got[i].append(logits[i : i + 1])
            fed[i].append(toks[i])
    for i, p in enumerate(prompts):
        assert_exact(torch.cat(got[i]), reference_logits(eng.weights, p + fed[i]), f"req {i}")
    for r in reqs:
        eng.cache.finish(r)


def test_forwards_without_candidates_refuse_a_model_that_has_them() -> None:
    """The bounded-replay oracle, training and context-parallel prefill do not apply shared
    candidates: each refuses such a model instead of computing another one silently."""
    from adapters.distributed.cp import CPKeys
    from adapters.model.replay_reference import SegmentedReference
    from adapters.training.keys import TrainKeys

    with pytest.raises(ValueError, match="bounded-replay oracle"):
        SegmentedReference(weights(SMALL_CANDS))
    with pytest.raises(ValueError, match="training"):
        TrainKeys(SMALL_CANDS, 1, 16)
    with pytest.raises(ValueError, match="context-parallel"):
        CPKeys(SMALL_CANDS, None, None, torch.device("cpu"))  # type: ignore[arg-type]
    SegmentedReference(weights(unfiltered(SMALL_CANDS)))  # without candidates: accepted
