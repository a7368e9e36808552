"""How much device memory a forward step needs beyond the pools and the weights.

The pools and the weights are allocated once; what a prefill step adds is transient: its
activations (per token of the step), the indexer's logits tiles and the top-k scratch (bounded
by `selection.LOGITS_TILE_BYTES`, whatever the context), and the step's entry tables (int64
per visible compressed entry of each request in the step). `StepMemory` models that peak; the
runner sizes every prefill step so the peak stays inside its budget and refuses, before
anything is allocated, a request whose one-token step would not fit (`MemoryBudgetError`).

The per-token figure counts the tensors alive at a layer's widest point (the residual streams
and their fp32 norms, the queries and their fp32 RoPE temporaries, the attention output and
its inverse RoPE, the compressor rows, the MLP), with a safety factor for the allocator's
rounding and fragmentation; `bench/long_context.py` prints it next to the measured peak.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adapters.forward.selection import LOGITS_TILE_BYTES
from adapters.model.model_config import ModelConfig
from shadowradix import InvalidRequestError

#: allocator rounding, fragmentation and the temporaries the model does not name
SAFETY = 1.5


class MemoryBudgetError(InvalidRequestError):
    """A request (or a step) needs more transient device memory than the runner's budget."""


@dataclass(frozen=True)
class StepMemory:
    """Transient bytes of one forward step of ``tokens`` tokens over requests with ``entries``
    visible compressed entries (summed over the step's requests and streams)::

        per_token * tokens + per_entry * entries + 3 * min(logits_tile, 4 * tokens * entries)

    the last term: one fp32 logits tile of the indexer and the top-k scratch (twice its size),
    never more than `selection.LOGITS_TILE_BYTES` whatever the context."""

    per_token: int
    per_entry: int
    logits_tile: int

    def peak(self, tokens: int, entries: int) -> int:
        logits = min(self.logits_tile, 4 * tokens * entries)
        return self.per_token * tokens + self.per_entry * entries + 3 * logits

    def max_tokens(self, budget: int, entries: int, limit: int = 1 << 30) -> int:
        """The most tokens (at most ``limit``) a step over requests with ``entries`` visible
        entries may hold within ``budget`` bytes (0: not even one). The peak grows with the
        tokens, so a bisection finds it."""
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.peak(mid, entries) <= budget else (lo, mid - 1)
        return lo


def step_memory(model: ModelConfig, dtype: torch.dtype) -> StepMemory:
    """The transient-memory model of ``model`` running in ``dtype``."""
    e = torch.tensor([], dtype=dtype).element_size()
    f = 8 if dtype == torch.float64 else 4
    d, h = model.head_dim, model.num_heads
    streams = model.hc_streams * model.hidden * (3 * e + 2 * f)  # streams, mixes, fp32 norm
    queries = h * d * (4 * e) + h * model.rope_dim * 3 * f  # q, attention out, RoPE both ways
    indexer = model.index_heads * model.index_dim * (2 * e + f)
    rows = 4 * (d + model.index_dim) * f  # C4 compressor rows (overlap doubles kv and score)
    mlp = 3 * model.mlp_hidden * e + model.vocab_size * f
    per_token = int(SAFETY * (streams + queries + indexer + rows + mlp))
    per_entry = 8 * (2 if model.ratios else 0)  # the int64 slot tables of the step
    return StepMemory(per_token=per_token, per_entry=per_entry, logits_tile=LOGITS_TILE_BYTES)


@dataclass(frozen=True)
class PrefillBudget:
    """A runner's step-memory model and budget (``None``: no budget). Raises `ValueError` for a
    budget that is not a positive number of bytes."""

    model: ModelConfig
    memory: StepMemory
    budget: int | None

    def __post_init__(self) -> None:
        if self.budget is not None and self.budget < 1:
            raise ValueError("memory_budget must be a positive number of bytes")

    def check(self, total_len: int, step_tokens: int = 1) -> None:
        """Raises `MemoryBudgetError` if a request of ``total_len`` tokens cannot run even a
        ``step_tokens``-token step within the budget."""
        if self.budget is None:
            return
        need = self.memory.peak(step_tokens, visible_entries(self.model, total_len))
        if need > self.budget:
            raise MemoryBudgetError(
                f"a {total_len}-token request needs {need / 2**30:.2f} GiB of step memory for "
                f"{step_tokens} token(s); the runner's budget is {self.budget / 2**30:.2f} GiB "
                "(raise memory_budget or free device memory)"
            )

    def step_tokens(self, entries: int, most: int) -> int:
        """Tokens (at most ``most``) a step over requests with ``entries`` visible entries may
        hold."""
        if self.budget is None:
            return most
        return self.memory.max_tokens(self.budget, entries, limit=most)


def prefill_budget(
    model: ModelConfig, dtype: torch.dtype, device: torch.device, budget: int | None
) -> PrefillBudget:
    """The budget a runner gets: ``budget``, or on CUDA 85 % of the memory free now (call it
    once pools, weights and graph buffers are allocated), or none."""
    if budget is None:
        free = free_device_memory(device)
        budget = None if free is None else int(0.85 * free)  # pragma: no cover - needs a GPU
    return PrefillBudget(model, step_memory(model, dtype), budget)


def visible_entries(model: ModelConfig, context_len: int) -> int:
    """Compressed entries a request of ``context_len`` tokens reads, over every stream."""
    return sum(context_len // r for r in model.ratios)


def free_device_memory(device: torch.device) -> int | None:
    """Bytes free on a CUDA device now (None elsewhere: no budget)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)  # pragma: no cover - needs a GPU
    return int(free)  # pragma: no cover - needs a GPU
