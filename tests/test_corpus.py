"""The corpus (#15): the Bible Retrieval System's EC02 reader, the split by book, the fixture.
No network: a small EC02 file is built here with an LZW encoder written from the format."""

from __future__ import annotations

import io
import lzma
import struct
import tarfile

import pytest

from adapters.training import corpus
from adapters.training.corpus_brs import CorpusFormatError, parse_verses, read_brs, unlzw


def lzw(data: bytes, max_bits: int = 16) -> bytes:
    """``compress``-style block-mode LZW codes (no header, no clear), as `unlzw` reads them."""
    table = {bytes([i]): i for i in range(256)}
    free, n_bits, codes = 257, 9, []
    cur = b""
    for byte in data:
        nxt = cur + bytes([byte])
        if nxt in table:
            cur = nxt
            continue
        codes.append((table[cur], n_bits))
        if free < 1 << max_bits:
            table[nxt] = free
            free += 1
        cur = bytes([byte])
        if free > (1 << n_bits) - 1 and n_bits < max_bits:
            codes.append((None, n_bits))  # a width change ends the group
            n_bits += 1
    if cur:
        codes.append((table[cur], n_bits))
    value, pos, group_start = 0, 0, 0
    for code, width in codes:
        if code is None:
            pos = group_start = group_start + -(-(pos - group_start) // (width * 8)) * width * 8
            continue
        value |= code << pos
        pos += width
    return value.to_bytes(-(-pos // 8), "little")


def ec02(text: bytes, window: int) -> bytes:
    windows = [lzw(text[a : a + window]) for a in range(0, len(text), window)]
    head = b"EC02Compressed Data File".ljust(0x54, b"\0")
    head += struct.pack(">II", window, len(windows))
    offsets, pos = [], len(head) + 4 * (len(windows) + 1) + 3
    for w in windows:
        offsets.append(pos)
        pos += len(w)
    offsets.append(pos)
    return head + struct.pack(f">{len(offsets)}I", *offsets) + b"\x1f\x9d\x90" + b"".join(windows)


TEXT = (b"Holy Bible title line.\n"
        + b"".join(b"Ge1:%d In the beginning was verse %d, and it was so.\n" % (i, i)
                   for i in range(1, 60))
        + b"Ruth1:1 Now it came to pass.\nRuth1:2 And the name of the man.\n"
        + b"1Pet1:1 Peter, an apostle.\nRev22:21 The grace of our Lord. Amen.\n")  # fmt: skip


def test_ec02_windows_decompress_to_the_text() -> None:
    assert unlzw(lzw(b"abababababab" * 50)) == b"abababababab" * 50
    assert read_brs(ec02(TEXT, 512)) == TEXT  # several windows, the last one short
    with pytest.raises(CorpusFormatError, match="EC02"):
        read_brs(b"not a data file" * 10)
    broken = bytearray(ec02(TEXT, 512))
    broken[0x5C + 3] += 1  # window 0 starts a byte late
    with pytest.raises(CorpusFormatError):
        read_brs(bytes(broken))


def test_the_split_holds_out_whole_books_without_references() -> None:
    split = corpus.split_text(TEXT, heldout_books=("Ruth", "1Pet"))
    ruth, peter = b"Now it came to pass.\nAnd the name of the man.\n", b"Peter, an apostle.\n"
    assert split.heldout == ruth + b"\n" + peter
    assert split.train.startswith(b"In the beginning was verse 1,")
    assert split.train.endswith(b"\n\nThe grace of our Lord. Amen.\n")
    assert b"Ruth" not in split.train and b"Ge1:" not in split.train
    with pytest.raises(corpus.CorpusError, match="not in the text"):
        corpus.split_text(TEXT, heldout_books=("Jonah",))
    with pytest.raises(CorpusFormatError, match="not a verse"):
        parse_verses(b"title\nGe1:1 fine\nno reference here\n")


def test_a_deb_is_read_and_checked(tmp_path, monkeypatch) -> None:
    data = ec02(TEXT, 256)
    tar = io.BytesIO()
    with tarfile.open(fileobj=tar, mode="w") as t:
        info = tarfile.TarInfo(corpus.DATA_MEMBER)
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    xz = lzma.compress(tar.getvalue())
    deb = b"!<arch>\n" + b"data.tar.xz/".ljust(48) + str(len(xz)).encode().ljust(10) + b"`\n" + xz
    assert corpus.data_file(deb) == data
    path = tmp_path / corpus.DEB_NAME
    path.write_bytes(deb)
    with pytest.raises(corpus.CorpusError, match="SHA-256"):  # not the pinned package
        corpus.fetch(tmp_path / "out", path)
    monkeypatch.setattr(corpus, "DEB_SHA256", corpus.sha256(deb))
    monkeypatch.setattr(corpus, "TEXT_SHA256", corpus.sha256(TEXT))
    monkeypatch.setattr(corpus, "HELDOUT_BOOKS", ("Ruth",))
    with pytest.raises(corpus.CorpusError, match="train.txt: SHA-256"):  # another split
        corpus.fetch(tmp_path / "out", path)


def test_the_committed_fixture_is_verse_lines_of_both_splits() -> None:
    split = corpus.load_split(corpus.FIXTURE_DIR, verify=False)
    assert split.train.startswith(b"In the beginning God created the heaven and the earth.\n")
    assert split.heldout.startswith(b"Now it came to pass in the days when the judges ruled")
    for text, size in ((split.train, corpus.FIXTURE_BYTES["train.txt"]),
                       (split.heldout, corpus.FIXTURE_BYTES["heldout.txt"])):  # fmt: skip
        assert size - 400 < len(text) <= size and text.endswith(b".\n")
    with pytest.raises(corpus.CorpusError, match="adapters.training.corpus fetch"):
        corpus.load_split(corpus.FIXTURE_DIR / "absent")
