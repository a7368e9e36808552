"""Byte batches of a corpus split: training crops and evaluation chunks.

Every sequence starts with BOS at position 0, as a prompt does in the runner
(`ByteTokenizer.encode`). Training crops start at the beginning of a verse line; the crops of
step ``s`` depend only on ``(seed, s)``, so a resumed run draws the same batches.
"""

from __future__ import annotations

import torch

from adapters.model.tokenizer import BOS

#: mixes the step into the batch generator's seed
_STEP_MIX = 1_000_003


class TokenData:
    """One split as bytes on ``device``. Raises `ValueError` for a text shorter than one
    sequence."""

    def __init__(self, text: bytes, seq_len: int, device: torch.device | str = "cpu") -> None:
        if seq_len < 2 or len(text) < seq_len:
            raise ValueError(f"a {len(text)}-byte text cannot fill {seq_len}-token sequences")
        self.seq_len, self.device = seq_len, torch.device(device)
        self.data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        starts = torch.cat((torch.zeros(1, dtype=torch.long),
                            (self.data == ord("\n")).nonzero()[:, 0] + 1))  # fmt: skip
        self.starts = starts[starts <= len(text) - (seq_len - 1)]

    def batch(self, seed: int, step: int, batch: int) -> torch.Tensor:
        """``(batch, seq_len)`` tokens of step ``step``: BOS, then ``seq_len - 1`` bytes from a
        line start drawn uniformly."""
        gen = torch.Generator().manual_seed(seed * _STEP_MIX + step)
        picks = self.starts[torch.randint(len(self.starts), (batch,), generator=gen)]
        rows = picks[:, None] + torch.arange(self.seq_len - 1)[None, :]
        return _with_bos(self.data[rows]).to(self.device)

    def chunks(self, max_bytes: int | None = None) -> list[torch.Tensor]:
        """The text (its first ``max_bytes``) as consecutive non-overlapping chunks of
        ``seq_len - 1`` bytes, each ``(seq_len,)`` tokens after BOS; the last one shorter."""
        data = self.data if max_bytes is None else self.data[:max_bytes]
        step = self.seq_len - 1
        pieces = [data[a : a + step] for a in range(0, len(data), step)]
        return [_with_bos(p[None])[0].to(self.device) for p in pieces if len(p)]

    def spread_chunks(self, max_bytes: int) -> list[torch.Tensor]:
        """About ``max_bytes`` of chunks at evenly spaced offsets over the whole text (an
        evaluation subset of a large split)."""
        step = self.seq_len - 1
        count = max(1, min(len(self.data) // step, max_bytes // step))
        stride = len(self.data) // count
        rows = torch.arange(count)[:, None] * stride + torch.arange(step)[None, :]
        return list(_with_bos(self.data[rows]).to(self.device))


def _with_bos(rows: torch.Tensor) -> torch.Tensor:
    bos = torch.full((rows.shape[0], 1), BOS, dtype=torch.long)
    return torch.cat((bos, rows.long()), dim=1)
