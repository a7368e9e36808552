"""Fork / join of a step's independent work onto a side CUDA stream, legal inside a capture.

Multi-stream attention prep (`graph_decode.GraphKeys.prepare`): a compressed layer's compressor
and indexer read only the layer's normed input, so they run on the side stream while the
current stream computes the q / kv projections::

    current  --rec(fork)-- q, kv projections, rope, SWA store --wait(done)-- attention
    side                 \\--wait(fork)-- compress, index, top-k --rec(done)--/

Under `torch.cuda.graph` this is the capture's fork/join pattern: the side stream waits on an
event of the capturing stream before its first kernel (so it joins the capture), and every
`Pending` is joined before the step returns (`GraphKeys.attend` joins each layer's), so the
capturing stream waits on the side's last event before the capture ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True)
class Pending(Generic[T]):
    """Work started by `SideStream.fork`: its result, the event that marks it done on the side
    stream (None: it ran inline), and its inputs, kept referenced until the join."""

    value: T
    done: torch.cuda.Event | None
    inputs: object

    def join(self) -> T:
        """The result, after making the current stream wait for the side's work."""
        if self.done is not None:
            torch.cuda.current_stream().wait_event(self.done)
        return self.value


class SideStream:
    """A side stream of ``device`` for `fork` (on the CPU none: the work runs inline, in the
    order `fork` is called, which tests use to check the reordered step)."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def concurrent(self) -> bool:
        """Whether forked work runs on a stream of its own (CUDA), not inline."""
        return self.stream is not None

    def fork(self, work: Callable[[], T], inputs: object) -> Pending[T]:
        """Runs ``work`` on the side stream after everything queued so far on the current
        stream; join the result before reading it, and before the step (or capture) ends.

        ``inputs`` (tensors the current stream allocated that ``work`` reads) stay referenced
        by the `Pending` until it is joined: eagerly, the caching allocator could otherwise
        reuse their memory for a current-stream tensor written while the side reads it; inside a
        graph the capture's memory pool is static, so keeping the references suffices (no
        ``record_stream``). Tensors ``work`` allocates belong to the side stream's pool and
        are read on the current stream only after the join."""
        if self.stream is None:
            return Pending(work(), None, inputs)
        fork = torch.cuda.Event()
        fork.record()  # on the current (possibly capturing) stream
        self.stream.wait_event(fork)
        with torch.cuda.stream(self.stream):
            value = work()
            done = torch.cuda.Event()
            done.record()  # on the side stream
        return Pending(value, done, inputs)
