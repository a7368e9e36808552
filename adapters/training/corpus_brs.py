"""Reader of the Bible Retrieval System's compressed text (Debian's ``bible-kjv-text``).

``/usr/lib/bible.data`` is an ``EC02`` file: the text cut into windows of ``window_size`` bytes
(64 KiB), each compressed on its own by Unix ``compress`` (LZW, block mode, up to 16-bit codes),
so that one verse can be read without the rest. Layout, big-endian::

    0x00  b"EC02Compressed Data File", zero padded
    0x54  window_size (u32), num_windows (u32)
    0x5C  num_windows + 1 offsets (u32): window i is bytes [offsets[i], offsets[i+1])
    ...   the ``compress`` header (1f 9d, flags) before window 0's codes

The text is one verse a line, ``Ge1:1 In the beginning ...``, after one title line. Pure
Python, no torch: the corpus script runs on any machine with the ``.deb``.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

MAGIC = b"EC02"
_HEADER = 0x54
_CLEAR, _FIRST = 256, 257
_REFERENCE = re.compile(rb"^([1-3]?[A-Za-z]+)(\d+):(\d+) (.*)$")


class CorpusFormatError(ValueError):
    """The data file is not the format this reader knows (or is corrupt)."""


def _skip_group(bitpos: int, group_start: int, n_bits: int) -> int:
    """``compress`` reads codes ``n_bits * 8`` bits at a time; a change of code width (or a
    clear) discards the rest of the current group."""
    group = n_bits * 8
    return group_start + -(-(bitpos - group_start) // group) * group


def unlzw(data: bytes, max_bits: int = 16) -> bytes:
    """The bytes of one block-mode LZW stream (``compress``'s codes, no header). Raises
    `CorpusFormatError` for a code that refers to no table entry."""
    out = bytearray()
    table: list[bytes] = [bytes([i]) for i in range(256)] + [b""]
    n_bits, bitpos, group_start = 9, 0, 0
    value, total = int.from_bytes(data, "little"), len(data) * 8
    prev: bytes | None = None
    while bitpos + n_bits <= total:
        code = (value >> bitpos) & ((1 << n_bits) - 1)
        bitpos += n_bits
        if code == _CLEAR:
            del table[_FIRST:]
            bitpos = group_start = _skip_group(bitpos, group_start, n_bits)
            n_bits, prev = 9, None
            continue
        if code < len(table):
            entry = table[code]
        elif code == len(table) and prev is not None:  # the KwKwK case
            entry = prev + prev[:1]
        else:
            raise CorpusFormatError(f"LZW code {code} past the table ({len(table)} entries)")
        if prev is not None and len(table) < 1 << max_bits:
            table.append(prev + entry[:1])
        out += entry
        prev = entry
        if len(table) > (1 << n_bits) - 1 and n_bits < max_bits:
            bitpos = group_start = _skip_group(bitpos, group_start, n_bits)
            n_bits += 1
    return bytes(out)


def read_brs(data: bytes) -> bytes:
    """The whole text of an ``EC02`` data file. Raises `CorpusFormatError` for another file
    or a window that does not decompress to ``window_size`` bytes (the last one: at most)."""
    if not data.startswith(MAGIC) or len(data) < _HEADER + 8:
        raise CorpusFormatError("not a Bible Retrieval System data file (no EC02 header)")
    window_size, num_windows = struct.unpack(">II", data[_HEADER : _HEADER + 8])
    table_end = _HEADER + 8 + 4 * (num_windows + 1)
    offsets = struct.unpack(f">{num_windows + 1}I", data[_HEADER + 8 : table_end])
    if offsets[-1] != len(data) or list(offsets) != sorted(offsets):
        raise CorpusFormatError("window offsets do not cover the file")
    text = bytearray()
    for i in range(num_windows):
        window = unlzw(data[offsets[i] : offsets[i + 1]])
        last = i == num_windows - 1
        if len(window) > window_size or (not last and len(window) != window_size):
            raise CorpusFormatError(f"window {i} decompressed to {len(window)} bytes")
        text += window
    return bytes(text)


@dataclass(frozen=True)
class Verse:
    book: str  # the data file's abbreviation: Ge, Exo, ..., Rev
    chapter: int
    verse: int
    text: bytes


def parse_verses(text: bytes) -> list[Verse]:
    """Every verse line of the text, in order (the title line is skipped). Raises
    `CorpusFormatError` for any other line that is not ``<book><chapter>:<verse> <text>``."""
    verses = []
    for number, line in enumerate(text.split(b"\n")[1:], start=2):
        if not line:
            continue
        match = _REFERENCE.match(line)
        if match is None:
            raise CorpusFormatError(f"line {number} is not a verse: {line[:40]!r}")
        book, chapter, verse, body = match.groups()
        verses.append(Verse(book.decode(), int(chapter), int(verse), body))
    return verses
