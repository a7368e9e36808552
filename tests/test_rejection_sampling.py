"""Speculative (rejection) sampling keeps the target distribution (adapters/engine/rejection.py).

Function level: on an 8-symbol vocabulary with random target distributions ``p_j`` per position
(independent of the prefix) and random draft distributions ``q_j`` the drafts are sampled from,
the emitted token at every position passes a χ² goodness-of-fit test against ``p_j``; a rule
that always accepts (it emits the draft's distribution) fails the same test. Runner level:
temperature sampling under speculation runs, is reproducible per seed, and greedy requests in
the same batches still equal plain decoding.
"""

from __future__ import annotations

import functools

import pytest
import torch
from small_models import SMALL, one_thread

from adapters.engine.rejection import RejectionResult, rejection_sample
from adapters.engine.runner import Runner
from adapters.engine.sampling import SamplingParams
from adapters.engine.speculative import DraftBatch, MTPDraft, OracleDraft, SampledDraft
from adapters.forward.mtp import reference_mtp_draft
from adapters.model.model_config import preset
from adapters.model.weights import init_weights

V, K, N = 8, 2, 40_000
#: χ² critical value for 7 degrees of freedom at α = 1e-4 (tables: 29.88); with 3 positions
#: tested per case, a correct rule fails a seeded run with probability < 1e-3
CHI2_CRIT_7 = 29.88


def chi2(samples: torch.Tensor, p: torch.Tensor) -> float:
    """Pearson's χ² of ``samples`` (token ids) against the distribution ``p`` ``(V,)``."""
    counts = torch.bincount(samples, minlength=len(p)).double()
    expected = p.double() * len(samples)
    return float(((counts - expected) ** 2 / expected).sum())


def random_dists(gen: torch.Generator, rows: int) -> torch.Tensor:
    """``rows`` random distributions over ``V``, none too close to 0 (χ² needs expected > 5)."""
    w = torch.rand(rows, V, generator=gen, dtype=torch.float64) + 0.15
    return w / w.sum(dim=-1, keepdim=True)


def always_accept(drafts, target_probs, uniforms, draft_probs=None) -> RejectionResult:
    """A deliberately wrong rule: keeps every draft, then samples the bonus token."""
    b, k = drafts.shape
    full = torch.full((b,), k, dtype=torch.long)
    cdf = target_probs[:, k].cumsum(-1)
    bonus = torch.searchsorted(cdf, uniforms[:, k : k + 1] * cdf[:, -1:], right=True)[:, 0]
    return RejectionResult(full, bonus.clamp(max=V - 1))


def emitted_by_position(rule, one_hot: bool, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Runs ``rule`` on N requests sharing p and q; returns, per position ``j <= K``, the tokens
    emitted there (by requests that emitted that far) and the target distributions."""
    gen = torch.Generator().manual_seed(seed)
    p, q = random_dists(gen, K + 1), random_dists(gen, K)
    if one_hot:  # a deterministic draft: each request's drafts are fixed random tokens
        drafts = torch.randint(0, V, (N, K), generator=gen)
        draft_probs = None
    else:
        drafts = torch.stack([torch.multinomial(q[j], N, True, generator=gen) for j in range(K)], 1)
        draft_probs = q.expand(N, K, V)
    uniforms = torch.rand(N, K + 1, generator=gen, dtype=torch.float64)
    res = rule(drafts, p.expand(N, K + 1, V), uniforms, draft_probs)
    tokens = torch.cat((drafts, torch.zeros(N, 1, dtype=torch.long)), dim=1)
    tokens[torch.arange(N), res.accepted] = res.next_token
    return [tokens[res.accepted >= j, j] for j in range(K + 1)], p


@pytest.mark.parametrize("one_hot", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_rejection_sampling_passes_chi2_against_the_target(one_hot: bool, seed: int) -> None:
    per_position, p = emitted_by_position(rejection_sample, one_hot, seed)
    for j, tokens in enumerate(per_position):
        assert len(tokens) > 400  # enough requests reach every position (one-hot: ~1/8 each)
        assert chi2(tokens, p[j]) < CHI2_CRIT_7, f"position {j}"


@pytest.mark.parametrize("one_hot", [False, True])
def test_always_accepting_fails_the_same_chi2_test(one_hot: bool) -> None:
    per_position, p = emitted_by_position(always_accept, one_hot, seed=0)
    # positions 0 and 1 carry the draft's tokens, not the target's
    assert all(chi2(per_position[j], p[j]) > 10 * CHI2_CRIT_7 for j in range(K))
    assert chi2(per_position[K], p[K]) < CHI2_CRIT_7  # the bonus token alone is right


def test_acceptance_probability_is_min_one_p_over_q() -> None:
    """One draft, exact expectations: P(accept x) = min(1, p(x)/q(x)); a draft equal to the
    target accepts everything; a one-hot draft of a token with p = 1 is always kept."""
    gen = torch.Generator().manual_seed(3)
    p, q = random_dists(gen, 2), random_dists(gen, 1)
    x = torch.multinomial(q[0], N, True, generator=gen)[:, None]
    u = torch.rand(N, 2, generator=gen, dtype=torch.float64)
    res = rejection_sample(x, p.expand(N, 2, V), u, q.expand(N, 1, V))
    expected = float((q[0] * torch.clamp(p[0] / q[0], max=1)).sum())
    assert abs(res.accepted.double().mean().item() - expected) < 0.01
    same = rejection_sample(x, p.expand(N, 2, V), u, p[:1].expand(N, 1, V))
    assert bool((same.accepted == 1).all())
    certain = torch.zeros(1, 2, V, dtype=torch.float64)
    certain[0, :, 5] = 1.0
    sure = rejection_sample(torch.tensor([[5]]), certain, torch.tensor([[0.999, 0.5]]))
    assert sure.accepted.tolist() == [1] and sure.next_token.tolist() == [5]
    with pytest.raises(ValueError, match="uniforms"):
        rejection_sample(x, p.expand(N, 2, V), u[:, :1])


# -- the runner ---------------------------------------------------------------------------------

CFG = preset("tiny", **SMALL, window=16, compress_ratios=(0, 4, 16, 4))
PROMPTS = [[5, 9, 2, 7, 7, 1], [5, 9, 2, 7, 3], [40, 41, 42]]


_one_thread = pytest.fixture(autouse=True, scope="module")(one_thread)


@functools.cache
def weights():
    return init_weights(CFG, "cpu", torch.float64)


def runner(k: int | None, draft=None, graph: bool = False) -> Runner:
    cc = CFG.cache_config(
        page_size=4, full_capacity=512, swa_capacity=128, speculative=k is not None
    )
    kw = {} if k is None else {"speculative_tokens": k, "draft": draft, "graph_decode": graph}
    return Runner(
        CFG, cc, device="cpu", dtype=torch.float64, weights=weights(), chunk_tokens=7, **kw
    )


class CheckedSampledMTP(MTPDraft):
    """`MTPDraft` checking its sampled proposals: the first draft's distribution is the dense
    reference MTP's softmax(logits / T), every draft has positive probability under its own
    distribution, and greedy requests in the batch draft the reference's greedy tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.checked = 0

    def propose(self, batch: DraftBatch) -> list[list[int]] | SampledDraft:
        out = super().propose(batch)
        sampled = isinstance(out, SampledDraft)
        assert sampled == any(t > 0 for t in batch.temperatures)
        for i, (p, o, t) in enumerate(zip(batch.prompts, batch.outputs, batch.temperatures)):
            tokens, logits = reference_mtp_draft(weights(), p + o, batch.num_tokens)
            if t == 0:
                assert (out.tokens if isinstance(out, SampledDraft) else out)[i] == tokens
                continue
            assert isinstance(out, SampledDraft)
            expected = torch.softmax(logits[0].double() / t, dim=-1)
            torch.testing.assert_close(out.probs[i, 0], expected, rtol=0, atol=1e-12)
            assert all(out.probs[i, j, x] > 0 for j, x in enumerate(out.tokens[i]))
            self.checked += 1
        return out


def outputs(r: Runner, params: list[SamplingParams]) -> list[list[int]]:
    ids = [r.submit(p, sp) for p, sp in zip(PROMPTS, params)]
    done = {res.request_id: res for res in r.run()}
    assert r.num_pending == 0 and r.cache.stats().num_requests == 0
    return [done[i].output for i in ids]


def test_speculative_temperature_sampling_runs_reproducibly_and_greedy_stays_exact() -> None:
    greedy = SamplingParams(max_new_tokens=12)
    plain = outputs(runner(None), [greedy] * 3)
    mixed = [SamplingParams(12, 0.8, seed=1), greedy, SamplingParams(12, 1.5, seed=2)]
    table = {tuple(p): o for p, o in zip(PROMPTS, plain)}
    checked, runs_mtp = CheckedSampledMTP(), []
    drafts = (lambda: checked, lambda: OracleDraft(table, 0.9, seed=0))  # MTP, long acceptances
    for make_draft in drafts:
        runs = [outputs(runner(3, make_draft()), mixed) for _ in range(2)]
        runs_mtp = runs_mtp if make_draft is not drafts[0] else runs[0]
        assert runs[0] == runs[1]  # the seeds fix every draw
        out = runs[0]
        assert out[1] == plain[1]  # the greedy request in the batch is plain decoding's
        assert all(len(o) == 12 and all(0 <= t < CFG.vocab_size for t in o) for o in out)
        assert out[0] != plain[0] and out[2] != plain[2]  # sampled, not greedy
    assert checked.checked > 8
    assert outputs(runner(3, graph=True), mixed) == runs_mtp  # GraphVerifier (eager on the CPU)
    r = runner(3, OracleDraft(table, 1.0))
    assert outputs(r, [greedy] * 3) == plain
    assert r.spec.stats.mean_acceptance_length > 3.5  # the oracle's greedy drafts all accepted
    other = outputs(runner(3), [SamplingParams(12, 0.8, seed=7)] * 3)
    assert other[0] != runs[0][0]  # another seed, another sample


def conditional_probs(prompt: list[int], temperature: float) -> torch.Tensor:
    """The distribution plain sampling draws the token after ``prompt`` from."""
    rows: list[torch.Tensor] = []
    r = runner(None)
    r.on_logits = lambda results, logits: rows.append(logits[0].clone())
    r.submit(prompt, SamplingParams(1))
    r.run()
    return torch.softmax(rows[0].double() / temperature, dim=-1)


@pytest.mark.parametrize("source", ["mtp", "oracle"])
def test_the_first_verified_token_follows_the_target_distribution(source: str) -> None:
    """Many seeds of one prompt, 2 tokens each: the second token is the first one a verify
    step emits. Each sample ``y`` given its first token ``a`` is mapped through the randomised
    probability integral transform of ``p(. | prompt, a)`` (uniform on [0, 1) exactly when
    ``y ~ p``), binned into 8 and χ²-tested."""
    temperature, prompt, n = 0.15, PROMPTS[0], 400
    greedy = outputs(runner(None), [SamplingParams(3)] * 3)[0]
    draft = None if source == "mtp" else OracleDraft({tuple(prompt): greedy}, 1.0)
    r = runner(2, draft)
    for seed in range(n):
        r.submit(prompt, SamplingParams(2, temperature, seed=seed))
    pairs = [tuple(res.output) for res in r.run()]
    cond = {a: conditional_probs(prompt + [a], temperature) for a in {a for a, _ in pairs}}
    jitter = torch.rand(n, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    pit = torch.stack([cond[a][:y].sum() + u * cond[a][y] for (a, y), u in zip(pairs, jitter)])
    bins = (pit * V).long().clamp(max=V - 1)
    assert chi2(bins, torch.full((V,), 1.0 / V)) < CHI2_CRIT_7
    assert r.spec.stats.accepted_tokens > (n // 5 if source == "oracle" else -1)
