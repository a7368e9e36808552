"""Device-resident drafts (#15): a greedy verify step whose drafts never reach the host before
the verify forward (`DeviceDraftSource.propose_device`, `GraphVerifier.verify(drafts=...)`),
judged from ONE host read (drafts and the target's argmax together), the cache's placeholder
draft values set by `ShadowRadixCache.resolve_draft` before the rollback. Its outputs equal the
host path's and plain greedy decoding's (the dense reference), for MTP drafts and for a
controllable oracle with long acceptances, stop tokens and length cuts; the host path stays
selectable (``SpeculativeDecoder.device_drafts = False``) and batches that sample take it."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from small_models import SHORT as CFG
from small_models import one_thread

from adapters.engine.drafts import DraftBatch, device_source
from adapters.engine.runner import Runner
from adapters.engine.sampling import SamplingParams
from adapters.engine.speculative import MTPDraft, OracleDraft
from adapters.model.reference import reference_generate
from adapters.model.weights import init_weights
from shadowradix import InvalidRequestError

pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
_one_thread = pytest.fixture(autouse=True, scope="module")(one_thread)

STEM = np.random.default_rng(11).integers(0, 256, 30).tolist()
PROMPTS = [STEM[:9], STEM[:21] + [3], STEM[:5]]
NEW = 9


@functools.cache
def weights():
    return init_weights(CFG, "cpu", torch.float64)


@functools.cache
def _ref(prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    return tuple(reference_generate(weights(), list(prompt), n))


def ref(prompt: list[int], n: int = NEW) -> list[int]:
    return list(_ref(tuple(prompt), n))


class DeviceOracle(OracleDraft):
    """`OracleDraft` with a device path: its drafts as a tensor (acceptances of any length)."""

    def propose_device(self, batch: DraftBatch) -> torch.Tensor:
        return torch.tensor(self.propose(batch), dtype=torch.long)


def make(draft, k: int = 3, graph: bool = True, page: int = 4) -> Runner:
    cc = CFG.cache_config(page_size=page, full_capacity=64 * 8, swa_capacity=page * 16,
                          debug=True, speculative=True)  # fmt: skip
    return Runner(CFG, cc, device="cpu", dtype=torch.float64, weights=weights(), chunk_tokens=8,
                  speculative_tokens=k, draft=draft, graph_decode=graph)  # fmt: skip


def clean(r: Runner) -> None:
    st = r.cache.stats()
    assert r.num_pending == 0 and st.num_requests == 0 and st.full.held_pages == 0
    r.cache.check_invariants()


def oracle(rate: float) -> DeviceOracle:
    return DeviceOracle({tuple(p): ref(p, NEW + 8) for p in PROMPTS}, rate, seed=3)


@pytest.mark.parametrize("source", ["mtp", "oracle-0.7", "oracle-1"])
def test_device_path_equals_host_path_and_plain_greedy(source: str) -> None:
    outs = {}
    for on in (True, False):
        draft = MTPDraft() if source == "mtp" else oracle(float(source.split("-")[1]))
        r = make(draft)
        assert r.spec is not None and device_source(draft) is draft
        r.spec.device_drafts = on
        params = [SamplingParams(max_new_tokens=NEW), SamplingParams(max_new_tokens=5),
                  SamplingParams(max_new_tokens=NEW, stop_token=ref(PROMPTS[2])[3])]  # fmt: skip
        outs[on] = [res.output for res in r.generate(PROMPTS, params)]
        assert (r.spec.stats.device_steps > 0) is on
        assert r.spec.stats.device_steps in (0, r.spec.stats.forwards)
        clean(r)
    assert outs[True] == outs[False]
    want = [ref(PROMPTS[0]), ref(PROMPTS[1], 5), ref(PROMPTS[2])[:4]]
    assert outs[True] == want


def test_one_host_read_per_verify_step(monkeypatch) -> None:
    """On the device path a verify step reads the device once: the drafts and the target's
    argmax in one ``tolist`` (the host path reads the drafts, then the argmax)."""
    r = make(MTPDraft(), k=2)
    assert r.spec is not None
    for p in PROMPTS[:2]:
        r.submit(p, SamplingParams(max_new_tokens=NEW))
    while r.num_prefilling:
        r.step()
    reads = {"n": 0}
    original = torch.Tensor.tolist

    def counted(t):
        reads["n"] += 1
        return original(t)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    for on, per_step in ((True, 1), (False, 2)):
        r.spec.device_drafts = on
        before, forwards = reads["n"], r.spec.stats.forwards
        r.step()
        assert r.spec.stats.forwards == forwards + 1
        assert reads["n"] - before == per_step
    monkeypatch.undo()
    r.run()
    clean(r)


def test_sampling_batches_and_paged_verify_take_the_host_path() -> None:
    r = make(MTPDraft())
    params = [SamplingParams(max_new_tokens=6), SamplingParams(max_new_tokens=6,
              temperature=0.7, seed=1)]  # fmt: skip
    out = r.generate(PROMPTS[:2], params)
    st = r.spec.stats if r.spec is not None else None
    assert st is not None and st.device_steps < st.forwards  # mixed steps: the host path
    assert out[0].output == ref(PROMPTS[0], 6)
    paged = make(MTPDraft(), graph=False)
    assert paged.spec is not None and not paged.spec.on_device(paged.scheduler.running)
    assert paged.generate([PROMPTS[0]], SamplingParams(max_new_tokens=6))[0].output == ref(
        PROMPTS[0], 6
    )
    assert paged.spec.stats.device_steps == 0
    assert device_source(OracleDraft({}, 0.5)) is None
    clean(r)
    clean(paged)


def test_resolve_draft_and_device_drafts_are_checked() -> None:
    r = make(MTPDraft(), k=2)
    cache = r.cache
    req = cache.admit(PROMPTS[0])
    cache.extend(req, PROMPTS[0])
    with pytest.raises(InvalidRequestError, match="holds 0 draft tokens"):
        cache.resolve_draft(req, [1, 2, 3])
    cache.extend_draft_batch([req], [[7, 0, 0]])
    with pytest.raises(InvalidRequestError, match="holds 3 draft tokens, not 2"):
        cache.resolve_draft(req, [1, 2])
    cache.resolve_draft(req, [7, 5, 6])
    assert req.tokens[-3:] == [7, 5, 6]
    cache.rollback(req, 1)
    assert req.tokens == [*PROMPTS[0], 7, 5]
    assert r.model_runner.verifier is not None
    with pytest.raises(ValueError, match="device drafts must be"):
        r.model_runner.verifier.verify([req], [[1, 2, 3]], deltas=(),
                                       drafts=torch.zeros(1, 3, dtype=torch.long))  # fmt: skip
    cache.finish(req)
    paged = make(MTPDraft(), graph=False)
    with pytest.raises(ValueError, match="need the graph verifier"):
        paged.model_runner._verify(None, torch.zeros(1, 2))  # type: ignore[arg-type]
