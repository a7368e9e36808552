"""The fields of a `Runner`, declared once for the roles its class is made of (`admission`,
`forward`, `emission`, `prefill`, `decode`, `overlap`): types only, every one set by
`Runner.__init__`. Each role reads and updates them as the runner's own state; nothing here
runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from adapters.engine.inflight import InFlightStep
from adapters.engine.runner_stats import RunnerStats
from adapters.engine.sequence import GenerationResult, _Seq
from adapters.engine.speculative import SpeculativeDecoder
from adapters.engine.waiting import WaitingQueue
from adapters.forward.graph_decode import GraphDecoder
from adapters.forward.memory_plan import PrefillBudget
from adapters.memory.pools import KVPools
from adapters.model.model_config import ModelConfig
from adapters.model.weights import ModelWeights
from shadowradix import PageTableDelta, ShadowRadixCache

if TYPE_CHECKING:
    from adapters.memory.offload import C4Offload


class RunnerBase:
    """The runner's state (see `Runner` for what each knob means)."""

    device: torch.device
    model: ModelConfig
    cache: ShadowRadixCache
    pools: KVPools
    weights: ModelWeights
    #: the HiSparse host mirror and device buffer (None without HiSparse), and its pages
    offload: C4Offload | None
    _device_pages: int
    #: graph decode (None: decode runs the paged path), speculation (None: plain decode)
    decoder: GraphDecoder | None
    spec: SpeculativeDecoder | None
    spec_tokens: int
    #: the MTP layer's state is kept in every forward (an MTP draft source)
    _mtp: bool
    tail_only: bool
    chunk_tokens: int
    max_running: int
    memory: PrefillBudget
    stats: RunnerStats
    #: every row's main hidden state of the last paged forward (MTP drafts only)
    _step_hidden: torch.Tensor | None
    _waiting: WaitingQueue
    _running: list[_Seq]
    _next_id: int
    _unclaimed: list[GenerationResult]
    #: results finished outside the forward that returns them (an isolated failure, a step in
    #: flight read back early for a preemption), returned by the step they happened in
    _salvaged: list[GenerationResult]
    #: overlap scheduling (`overlap`): the decode step launched and not yet read back, and the
    #: table changes of decoding requests not yet given to the graph decoder
    overlap: bool
    _inflight: InFlightStep | None
    _table_deltas: list[PageTableDelta]
    #: steps taken (admission order, the HiSparse decode rotation)
    _clock: int
    on_logits: Callable[[list[GenerationResult], torch.Tensor], None] | None
