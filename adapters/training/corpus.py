"""The training corpus: the King James Bible from Debian's ``bible-kjv-text`` (docs/training.md).

``python -m adapters.training.corpus fetch [--deb FILE] [--out data/kjv]`` gets the package
(``apt-get
download``, unless ``--deb`` names a copy), checks its SHA-256, reads the compressed text
(`corpus_brs`), and writes a deterministic split held out **by book**: ``train.txt`` and
``heldout.txt``, each the books in canonical order, one verse a line without its reference, a
blank line between books; both checked against recorded SHA-256s.
``python -m adapters.training.corpus fixture`` cuts the small excerpt the tests train on from that
split
(``data/kjv_fixture``, committed). Pure Python, no torch.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import lzma
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from adapters.training.corpus_brs import parse_verses, read_brs

PACKAGE, VERSION = "bible-kjv-text", "4.38"
DEB_NAME = f"{PACKAGE}_{VERSION}_all.deb"
DEB_SHA256 = "d61b6aad4c51ba9e2800b825325fa6a09e99a0d02a9bb6dc4724fcc4995a1b7a"
DATA_MEMBER = "./usr/lib/bible.data"
#: the decompressed text of ``bible.data`` (4,404,475 bytes, 31,102 verses)
TEXT_SHA256 = "e53aaf0af1e58f259e35d0d9f7ca1bbe154fd77bb95471279b37b34d3c397a98"
#: held-out books (the data file's abbreviations): narrative, wisdom, prophecy, a gospel and
#: three epistles, 4.4 % of the text
HELDOUT_BOOKS = ("Ruth", "Eccl", "Joel", "John", "Gal", "Jas", "1Pet")
SPLIT_SHA256 = {
    "train.txt": "1e3726e5aff0b89d7585bfd33cec39646419d61f77a4a01e4820b9fe81fd49d7",  # 3,945,958 B
    "heldout.txt": "927917411145f98e22c0051045c8c347a4063e740dda378dbd4b7c9def748ff8",  # 191,956 B
}
DEFAULT_DIR = Path(__file__).resolve().parents[2] / "data" / "kjv"
FIXTURE_DIR = Path(__file__).resolve().parents[2] / "data" / "kjv_fixture"
#: bytes of each split the fixture keeps (cut at a line end)
FIXTURE_BYTES = {"train.txt": 24_000, "heldout.txt": 6_000}


class CorpusError(RuntimeError):
    """The corpus could not be fetched or does not match its recorded checksum."""


@dataclass(frozen=True)
class Split:
    """A corpus split as bytes: ``train`` and ``heldout`` (each books of verse lines)."""

    train: bytes
    heldout: bytes


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _check(name: str, data: bytes, expected: str) -> None:
    got = sha256(data)
    if got != expected:
        raise CorpusError(f"{name}: SHA-256 {got}, expected {expected}")


def download_deb(directory: Path) -> Path:
    """``apt-get download`` of the pinned version into ``directory``. Raises `CorpusError`
    where apt is missing or fails."""
    try:
        subprocess.run(["apt-get", "download", f"{PACKAGE}={VERSION}"], cwd=directory,
                       check=True, capture_output=True)  # fmt: skip
    except (OSError, subprocess.CalledProcessError) as exc:
        raise CorpusError(
            f"apt-get download {PACKAGE}={VERSION} failed ({exc}); download {DEB_NAME} from a "
            "Debian mirror (pool/main/b/bible-kjv/) and pass it with --deb"
        ) from exc
    return directory / DEB_NAME


def _ar_members(deb: bytes) -> dict[str, bytes]:
    """Members of a ``.deb`` (a Unix ``ar`` archive)."""
    if not deb.startswith(b"!<arch>\n"):
        raise CorpusError("not a .deb (ar) archive")
    members, pos = {}, 8
    while pos + 60 <= len(deb):
        header = deb[pos : pos + 60]
        name, size = header[:16].decode().strip().rstrip("/"), int(header[48:58])
        members[name] = deb[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size & 1)
    return members


def data_file(deb: bytes) -> bytes:
    """``bible.data`` from the package's ``data.tar.xz``."""
    members = _ar_members(deb)
    if "data.tar.xz" not in members:
        raise CorpusError(f"no data.tar.xz in the package (members: {sorted(members)})")
    tar_bytes = lzma.decompress(members["data.tar.xz"])
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        member = tar.extractfile(DATA_MEMBER)
        if member is None:
            raise CorpusError(f"no {DATA_MEMBER} in the package")
        return member.read()


def split_text(text: bytes, heldout_books: tuple[str, ...] = HELDOUT_BOOKS) -> Split:
    """The split of the decompressed text: every verse of a held-out book goes to ``heldout``,
    every other verse to ``train``; whole books, never interleaved lines."""
    books: dict[str, list[bytes]] = {}
    for verse in parse_verses(text):
        books.setdefault(verse.book, []).append(verse.text)
    missing = set(heldout_books) - set(books)
    if missing:
        raise CorpusError(f"held-out books not in the text: {sorted(missing)}")

    def join(names: list[str]) -> bytes:
        return b"\n".join(b"\n".join(books[n]) + b"\n" for n in names)

    return Split(
        train=join([b for b in books if b not in heldout_books]),
        heldout=join([b for b in books if b in heldout_books]),
    )


def fetch(out: Path = DEFAULT_DIR, deb_path: Path | None = None) -> Split:
    """Fetches, checks and splits the corpus, and writes ``out/{train,heldout}.txt``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = deb_path or download_deb(Path(tmp))
        deb = Path(path).read_bytes()
    _check(DEB_NAME, deb, DEB_SHA256)
    text = read_brs(data_file(deb))
    _check("bible.data text", text, TEXT_SHA256)
    split = split_text(text, HELDOUT_BOOKS)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in (("train.txt", split.train), ("heldout.txt", split.heldout)):
        _check(name, data, SPLIT_SHA256[name])
        (out / name).write_bytes(data)
    return split


def load_split(directory: Path = DEFAULT_DIR, verify: bool = True) -> Split:
    """The split written by `fetch` (or a fixture of the same layout). ``verify``: check the
    full corpus' recorded SHA-256s (only for the files `fetch` writes). Raises `CorpusError`
    for a missing file (with the command that makes it) or a mismatch."""
    parts = {}
    for name in ("train.txt", "heldout.txt"):
        path = Path(directory) / name
        if not path.exists():
            raise CorpusError(f"{path} is missing: run `python -m adapters.training.corpus fetch`")
        parts[name] = path.read_bytes()
        if verify:
            _check(str(path), parts[name], SPLIT_SHA256[name])
    return Split(train=parts["train.txt"], heldout=parts["heldout.txt"])


def fixture(split: Split, out: Path = FIXTURE_DIR) -> None:
    """Writes the tests' excerpt: the first `FIXTURE_BYTES` of each split, cut at a line end."""
    out.mkdir(parents=True, exist_ok=True)
    for name, data in (("train.txt", split.train), ("heldout.txt", split.heldout)):
        cut = data.rfind(b"\n", 0, FIXTURE_BYTES[name]) + 1
        (out / name).write_bytes(data[:cut])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adapters.training.corpus", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    get = sub.add_parser("fetch", help="download, check and split the corpus")
    get.add_argument("--deb", type=Path, help=f"a local {DEB_NAME} instead of apt-get download")
    get.add_argument("--out", type=Path, default=DEFAULT_DIR, help="output folder (data/kjv)")
    fix = sub.add_parser("fixture", help="cut the tests' excerpt from a fetched split")
    fix.add_argument("--corpus", type=Path, default=DEFAULT_DIR)
    fix.add_argument("--out", type=Path, default=FIXTURE_DIR)
    args = parser.parse_args(argv)
    try:
        if args.command == "fetch":
            split = fetch(args.out, args.deb)
            print(f"{args.out}: train {len(split.train)} bytes, held out {len(split.heldout)} "
                  f"bytes ({', '.join(HELDOUT_BOOKS)})")  # fmt: skip
        else:
            fixture(load_split(args.corpus), args.out)
            print(f"{args.out}: fixture written")
    except CorpusError as exc:
        print(f"corpus: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
