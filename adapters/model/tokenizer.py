"""Byte-level tokenizer: UTF-8 bytes are tokens 0..255, plus BOS (256) and EOS (257)."""

from __future__ import annotations

from collections.abc import Iterable

BOS, EOS = 256, 257


class ByteTokenizer:
    vocab_size = 258
    bos, eos = BOS, EOS

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return ([BOS] if bos else []) + list(text.encode("utf-8"))

    def decode(self, tokens: Iterable[int]) -> str:
        """Text of the byte tokens (specials dropped, invalid UTF-8 replaced)."""
        return bytes(t for t in tokens if 0 <= t < 256).decode("utf-8", errors="replace")
