"""What overlap scheduling keeps from one `Runner.step` to the next: the decode step launched
and not yet read back (`InFlightStep`), the host copy of its sampled tokens (`TokenCopy`), and
the input tokens of the next step taken from it on the device (`input_tokens`)."""

from __future__ import annotations

import numpy as np
import torch

from adapters.engine.sequence import _Seq
from adapters.memory.device import upload


class TokenCopy:
    """The host copy of one step's sampled tokens. On CUDA: a non-blocking copy into pinned
    memory and an event recorded after it, so reading waits for this copy only (the steps
    queued behind it keep the device busy); on the CPU the tokens themselves."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if tokens.is_cuda:  # pragma: no cover - needs a GPU
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tokens

    def values(self) -> list[int]:
        """The tokens, once the copy is done (blocks until then)."""
        if self._event is not None:  # pragma: no cover - needs a GPU
            self._event.synchronize()
        return self._host.tolist()  # type: ignore[no-any-return]


class InFlightStep:
    """A launched decode step: its rows (``seqs``, in batch order), each row's greedy token on
    the device (``sampled``) and its host copy. ``closing[i]``: row ``i``'s token is its
    request's last (``max_new_tokens``): the request was finished in the cache right after the
    launch, and its result is returned when the step is resolved. ``resolved``: its tokens
    were read back and emitted."""

    def __init__(self, seqs: list[_Seq], sampled: torch.Tensor) -> None:
        self.seqs, self.sampled = seqs, sampled
        self.copy = TokenCopy(sampled)
        self.closing = [False] * len(seqs)
        self.resolved = False
        self._rows = {id(s): i for i, s in enumerate(seqs)}

    def row_of(self, seq: _Seq) -> int | None:
        """``seq``'s row while the step's tokens are not read back (``None``: not a row, or
        resolved: its token is then on the host, in its output)."""
        return None if self.resolved else self._rows.get(id(seq))

    @property
    def num_closing(self) -> int:
        """Requests whose result waits for this step's tokens."""
        return 0 if self.resolved else sum(self.closing)


def input_tokens(seqs: list[_Seq], prev: InFlightStep | None) -> list[int] | torch.Tensor:
    """The input token of each decode row: a row of ``prev`` (not read back) takes its sampled
    token on the device, any other row its output's last token. A list when every row's token
    is on the host; ``prev.sampled`` itself when the batch is ``prev``'s; else one gather."""
    rows = [prev.row_of(s) if prev is not None else None for s in seqs]
    if prev is None or all(r is None for r in rows):
        return [s.result.output[-1] for s in seqs]
    if rows == list(range(len(prev.seqs))):
        return prev.sampled
    packed = np.array(
        [
            [s.result.output[-1] if r is None else 0 for s, r in zip(seqs, rows)],
            [0 if r is None else r for r in rows],
            [r is not None for r in rows],
        ],
        dtype=np.int64,
    )
    packed_t = upload(packed, prev.sampled.device)
    return torch.where(packed_t[2].bool(), prev.sampled[packed_t[1]], packed_t[0])
