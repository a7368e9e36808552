"""PD disaggregation over torch.distributed: a prefill engine hands a prompt's cached prefix to a
decode engine in another process, by page index (issue #16 item 1; docs/distributed.md).

Both engines are plain `Runner`s with the same model, cache config and pool formats. The
protocol, one request at a time, point to point (gloo: bytes staged through host memory; NCCL:
device to device)::

    prefill (sender)                               decode (receiver)
    generate(prompt, 1 token): prefix cached
    export_layout: pin, page ids   ── Offer ──►    plan_import (pure): pages it lacks
                                   ◄── Need ──     (or ◄── Refusal ── : typed, nothing changed)
    gather those pages' rows       ── bytes ──►    all bytes arrived → import_prefix,
                                                   scatter rows at its own page ids
                                   ◄── Ack ───
    release_layout (unpin)                         submit(prompt) / run: the prompt hits it

The sender unpins on every outcome (ack, refusal, the receiver's death), so nothing is lost at
the sender: its prefix stays cached like any other. The receiver imports only once every byte
has arrived, so a sender that dies mid-transfer leaves it unchanged (`TransferAborted`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from adapters.distributed.pd_pools import gather_pages, scatter_pages, signature, transfer_bytes
from adapters.engine.runner import Runner
from adapters.engine.sampling import SamplingParams
from shadowradix import (
    ImportRefused,
    PrefixLayout,
    RefusalReason,
    export_layout,
    import_prefix,
    plan_import,
    release_layout,
)


@dataclass(frozen=True)
class Offer:
    prompt: tuple[int, ...]
    layout: PrefixLayout
    pools: tuple[Any, ...]


@dataclass(frozen=True)
class Need:
    full_index: tuple[int, ...]
    swa_index: tuple[int, ...]
    num_bytes: int


@dataclass(frozen=True)
class Refusal:
    reason: RefusalReason
    detail: str
    needed: tuple[int, int] = (0, 0)
    available: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class Ack:
    num_tokens: int
    num_bytes: int


@dataclass(frozen=True)
class TransferReport:
    """One side's account of a transfer. ``num_tokens``: the prefix the receiver now caches
    (0 if refused); ``num_bytes``: page bytes that crossed; ``expected_bytes``: the bytes of
    the pages named (`pd_pools.transfer_bytes`); ``seconds``: offer to ack (sender) or
    offer to scatter (receiver); ``bytes_seconds``: the page bytes alone (gather + send on
    the sender, receive + scatter on the receiver)."""

    num_tokens: int
    full_pages: int
    swa_pages: int
    num_bytes: int
    expected_bytes: int
    seconds: float
    bytes_seconds: float
    refusal: Refusal | None = None

    @property
    def refused(self) -> bool:
        return self.refusal is not None


class TransferAborted(RuntimeError):
    """The peer died or broke the protocol mid-transfer. On the receiver nothing was imported;
    on the sender the layout was released."""


def _send(obj: object, peer: int, group: Any) -> None:
    dist.send_object_list([obj], dst=peer, group=group)


def _recv(peer: int, group: Any, kind: type | tuple[type, ...]) -> Any:
    box: list[Any] = [None]
    try:
        dist.recv_object_list(box, src=peer, group=group)
    except RuntimeError as exc:
        raise TransferAborted(f"rank {peer} went away: {exc}") from exc
    if not isinstance(box[0], kind):
        raise TransferAborted(f"rank {peer} sent {type(box[0]).__name__}, expected {kind}")
    return box[0]


def _wire_device(runner: Runner, group: Any) -> torch.device:
    """Where page bytes travel from: the pools' device under NCCL, host memory under gloo."""
    nccl = dist.get_backend(group) == "nccl"
    return runner.device if nccl else torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill(runner: Runner, prompt: Sequence[int]) -> int:
    """Compute ``prompt`` on the prefill engine (its pages stay cached); its first token."""
    (result,) = runner.generate([list(prompt)], SamplingParams(max_new_tokens=1))
    if result.finish_reason == "error":
        raise RuntimeError(f"prefill failed: {result.error}")
    return result.output[0]


def send_prefix(
    runner: Runner, prompt: Sequence[int], dst: int, group: Any = None
) -> TransferReport:
    """Offer ``prompt``'s cached prefix (what the decode engine's admission can reuse: up to
    ``len - 1`` tokens) to rank ``dst`` and send the page bytes it asks for. Returns after the
    ack or the refusal; raises `TransferAborted` if ``dst`` dies. Unpins in every case."""
    t0 = time.perf_counter()
    layout = export_layout(runner.cache, list(prompt), max_len=len(prompt) - 1)
    try:
        _send(Offer(tuple(prompt), layout, signature(runner.pools)), dst, group)
        answer = _recv(dst, group, (Need, Refusal))
        if isinstance(answer, Refusal):
            return TransferReport(0, 0, 0, 0, 0, time.perf_counter() - t0, 0.0, answer)
        full = layout.full_pages[np.array(answer.full_index, dtype=np.int64)]
        swa = layout.swa_pages[np.array(answer.swa_index, dtype=np.int64)]
        t1 = time.perf_counter()
        buf = gather_pages(runner.pools, full, swa).to(_wire_device(runner, group))
        dist.send(buf, dst=dst, group=group)
        t2 = time.perf_counter()
        ack = _recv(dst, group, Ack)
        expected = transfer_bytes(runner.pools, len(full), len(swa))
        return TransferReport(ack.num_tokens, len(full), len(swa), buf.numel(), expected,
                              time.perf_counter() - t0, t2 - t1)  # fmt: skip
    finally:
        release_layout(runner.cache, layout)


def receive_prefix(runner: Runner, src: int, group: Any = None) -> tuple[list[int], TransferReport]:
    """Take one offer from rank ``src`` into ``runner``'s cache and pools: the prompt and the
    report. Refuses (answering with a `Refusal`, changing nothing) a layout it has no room
    for or cannot read; raises `TransferAborted`, changing nothing, if ``src`` dies first."""
    offer = _recv(src, group, Offer)
    t0 = time.perf_counter()
    prompt, layout = list(offer.prompt), offer.layout
    try:
        if offer.pools != signature(runner.pools):
            raise ImportRefused(RefusalReason.MISMATCH, "the pools' tensors differ")
        plan = plan_import(runner.cache, prompt, layout)
    except ImportRefused as exc:
        refusal = Refusal(exc.reason, exc.detail, exc.needed, exc.available)
        _send(refusal, src, group)
        return prompt, TransferReport(0, 0, 0, 0, 0, time.perf_counter() - t0, 0.0, refusal)
    nbytes = transfer_bytes(runner.pools, *plan.needed)
    _send(Need(plan.full_index, plan.swa_index, nbytes), src, group)
    t1 = time.perf_counter()
    buf = torch.empty(nbytes, dtype=torch.uint8, device=_wire_device(runner, group))
    try:
        dist.recv(buf, src=src, group=group)
    except RuntimeError as exc:
        raise TransferAborted(f"rank {src} died before its page bytes arrived: {exc}") from exc
    receipt = import_prefix(runner.cache, prompt, layout)  # nothing ran here since the plan
    if receipt.full.index.tolist() != list(plan.full_index):
        raise AssertionError("the receiver's cache changed between plan and import")
    scatter_pages(runner.pools, buf, receipt.full.dst, receipt.swa.dst)
    _sync(runner.device)
    t2 = time.perf_counter()
    _send(Ack(receipt.num_tokens, nbytes), src, group)
    return prompt, TransferReport(receipt.num_tokens, len(receipt.full), len(receipt.swa),
                                  nbytes, nbytes, t2 - t0, t2 - t1)  # fmt: skip
