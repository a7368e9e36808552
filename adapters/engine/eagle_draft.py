"""`EagleDraft`: the EAGLE head (`adapters.model.eagle`) as a `DraftSource`.

Each request's draft is ``k`` chained head steps from the target's hidden state at its last
committed position (``DraftBatch.hidden``) and its pending token: greedy, or, for a request
that samples, each token drawn from softmax(head logits / T) with the request's seeded
uniforms (a `SampledDraft`, verified by rejection sampling). The head keeps no state between
proposals and reads nothing from the pools: its only context is the feature.

It declares ``uses_mtp = True`` because that is how the protocol hands a source the hidden
state: the runner then also keeps the MTP layer's state in every forward, which this source
does not read (one small projection per token), and the target must have an MTP layer.

On CUDA (``DraftContext.use_graphs``) the greedy draft of each batch bucket is captured once
as a CUDA graph over fixed input buffers (the head reads no pool, so nothing invalidates a
graph); the sampled path and the CPU run eagerly.
"""

from __future__ import annotations

import torch

from adapters.engine.drafts import DraftBatch, DraftContext, SampledDraft
from adapters.engine.rejection import sample_tempered
from adapters.model.eagle import EagleWeights, draft_chain
from adapters.model.weights import ModelWeights
from adapters.model.weights_file import WeightsError


class EagleDraft:
    """Drafts with an EAGLE head trained for the runner's target (`load_eagle` checks that).
    `bind` raises `WeightsError` for a head whose hidden size or vocabulary is not the
    target's."""

    uses_mtp = True

    def __init__(self, head: EagleWeights) -> None:
        self.head = head
        self.target: ModelWeights | None = None
        self.num_tokens = 0
        self.use_graphs = False
        self._feature: torch.Tensor | None = None  # (max_batch, D) graph input buffers
        self._tokens: torch.Tensor | None = None  # (max_batch,)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def bind(self, context: DraftContext) -> None:
        target, c = context.weights, self.head.config
        cfg = target.config
        if (c.hidden, c.vocab_size) != (cfg.hidden, cfg.vocab_size):
            raise WeightsError(
                "EAGLE head",
                f"hidden {c.hidden} / vocabulary {c.vocab_size} do not fit the "
                f"target's {cfg.hidden} / {cfg.vocab_size}",
            )
        self.target, self.num_tokens = target, context.num_tokens
        self.head = self.head.to(target.device, target.dtype)
        self.use_graphs = context.use_graphs
        self._feature = torch.zeros(context.max_batch, cfg.hidden, device=target.device,
                                    dtype=target.dtype)  # fmt: skip
        self._tokens = torch.zeros(context.max_batch, dtype=torch.long, device=target.device)
        self._graphs.clear()

    def propose(self, batch: DraftBatch) -> list[list[int]] | SampledDraft:
        if any(t > 0 for t in batch.temperatures) and batch.uniforms is not None:
            hidden, pending = self._inputs(batch)
            return self._sampled(hidden, pending, batch, batch.num_tokens)
        return self.propose_device(batch).tolist()  # type: ignore[no-any-return]

    def propose_device(self, batch: DraftBatch) -> torch.Tensor:
        """The greedy drafts ``(B, k)`` on the device, not read back (a graph replay on CUDA:
        a copy of its output buffer)."""
        hidden, pending = self._inputs(batch)
        assert self.target is not None
        if self.use_graphs:  # pragma: no cover - needs a GPU
            return self._replay(hidden, pending)[: len(pending)]
        with torch.no_grad():
            tokens, _, _ = draft_chain(self.target, self.head, hidden, pending, batch.num_tokens)
        return tokens

    def _inputs(self, batch: DraftBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if self.target is None or batch.hidden is None:
            raise RuntimeError("EagleDraft is not bound to a runner")
        dev = self.target.device
        host = torch.tensor([o[-1] for o in batch.outputs], dtype=torch.long)
        pending = host.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else host
        return batch.hidden.to(dev, self.target.dtype), pending

    def _sampled(self, hidden, pending, batch: DraftBatch, k: int) -> SampledDraft:
        assert self.target is not None and batch.uniforms is not None
        temps = torch.tensor(batch.temperatures, dtype=torch.float64, device=hidden.device)
        uniforms = batch.uniforms.to(hidden.device)
        probs: list[torch.Tensor] = []

        def pick(logits: torch.Tensor, j: int) -> torch.Tensor:
            tokens, p = sample_tempered(logits, temps, uniforms[:, j])
            probs.append(p)
            return tokens

        with torch.no_grad():
            tokens, _, _ = draft_chain(self.target, self.head, hidden, pending, k, pick)
        return SampledDraft(tokens.tolist(), torch.stack(probs, dim=1).cpu())

    # -- CUDA graphs (greedy) ----------------------------------------------------------------

    def _run(self, bucket: int) -> torch.Tensor:
        assert self.target is not None and self._feature is not None and self._tokens is not None
        feature, tokens = self._feature[:bucket], self._tokens[:bucket]
        with torch.no_grad():
            return draft_chain(self.target, self.head, feature, tokens, self.num_tokens)[0]

    def _replay(self, hidden: torch.Tensor, pending: torch.Tensor):  # pragma: no cover
        assert self._feature is not None and self._tokens is not None
        b = len(pending)
        bucket = min(max(1, 1 << (b - 1).bit_length()), self._feature.shape[0])
        self._feature[:b] = hidden
        self._tokens[:b] = pending
        if bucket not in self._graphs:
            self._graphs[bucket] = self._capture(bucket)
        graph, out = self._graphs[bucket]
        graph.replay()
        return out[:b].clone()

    def _capture(self, bucket: int):  # pragma: no cover - needs a GPU
        # Warm up on a side stream (allocator pools, lazy inits), then capture; the head reads
        # only the two input buffers, so padding rows compute garbage nobody reads.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._run(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._run(bucket)
        return graph, out
